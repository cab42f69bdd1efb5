"""Lab 13 - the loss without the full logits: chunked, and fused with the head.

At 32k tokens and a 128k vocabulary the head's logits are 8 GiB in bf16, their float32 copy 16 GiB,
their gradient 16 GiB more: the largest tensors of a Llama-3-8B step. Both losses here compute the
same cross-entropy (the mean over every target that is not ``IGNORE``) one chunk of tokens at a
time, so only one chunk's logits ever exist:

    chunked        each chunk's head and loss under ``torch.utils.checkpoint``: forward keeps only the
                   chunk's input (a view of the hidden states); backward recomputes that chunk's logits,
                   then takes their gradient. One more head matmul per token.
    fused-linear   the head and the loss in one autograd function that takes the gradients during the
                   forward, chunk by chunk, and keeps only them (the hidden states' and the head
                   weight's), as Liger Kernel's fused linear cross-entropy does
                   (https://arxiv.org/abs/2410.10989). No recomputation; the head's weight gradient is
                   held from forward to backward (none for a frozen head, as under LoRA: only the
                   hidden states' gradient is taken).

Both are plain PyTorch: on a GPU they run the same aten ops, without Liger's Triton kernels (which
also fuse the softmax into the logits' buffer: a trace of these functions keeps a chunk's float32
logits and softmax apart). ``tests/test_lab13.py`` holds the loss and every gradient to the full loss's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

#: Chunks of tokens the loss is split into: torchtune's default for its chunked cross-entropy
#: (``num_output_chunks=8``, https://github.com/pytorch/torchtune/blob/main/torchtune/modules/loss/ce_chunked_output_loss.py)
LOSS_CHUNKS = 8
IGNORE = -100  # a target the loss skips (a prompt's tokens in fine-tuning), as F.cross_entropy's default


# --8<-- [start:chunked]
def chunked_loss(hidden, head, targets, chunks: int = LOSS_CHUNKS):
    """The mean cross-entropy of ``head(hidden)`` against ``targets``, ``chunks`` chunks of tokens at a time,
    each recomputed in backward (torch.utils.checkpoint): one chunk's logits alive at a time."""
    h, t = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
    size = -(-t.numel() // chunks)
    total = sum(checkpoint(_chunk_sum, hc, head.weight, tc, use_reentrant=False)
                for hc, tc in zip(h.split(size), t.split(size)))
    return total / (t != IGNORE).sum()


def _chunk_sum(h, weight, t):
    logits = F.linear(h, weight)
    return F.cross_entropy(logits.float(), t, reduction="sum", ignore_index=IGNORE)
# --8<-- [end:chunked]


# --8<-- [start:fused]
def fused_linear_loss(hidden, head, targets, chunks: int = LOSS_CHUNKS):
    """The same loss, the head fused in: gradients taken in forward, chunk by chunk (:class:`FusedLinearCE`)."""
    return FusedLinearCE.apply(hidden, head.weight, targets, chunks)


class FusedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunks):
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
        h, t = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
        size, valid = -(-t.numel() // chunks), t != IGNORE
        count = valid.sum()
        with torch.autocast(device, enabled=False):
            w = weight.to(dtype)  # autocast's cast, once (none when the weights are already in it)
            grad_h = torch.empty_like(hidden).view_as(h)
            grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None  # none for a frozen head (LoRA)
            loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start in range(0, t.numel(), size):
                rows = slice(start, start + size)
                loss += _chunk_grads(h[rows].to(dtype), w, t[rows], valid[rows] / count, grad_h[rows], grad_w)
        ctx.save_for_backward(grad_h.view_as(hidden), grad_w)
        return loss  # each token weighted by 1 / count: the mean

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h.mul_(grad_loss), grad_w if grad_w is None else grad_w.mul_(grad_loss), None, None  # in place


def _chunk_grads(h, w, t, weight, grad_h, grad_w):
    """One chunk: its summed loss; its gradients written into ``grad_h`` and added to ``grad_w``
    (``weight``: each token's share of the mean, 0 for an ignored one; ``grad_w`` None: a frozen head).
    Its tensors die on return."""
    logits = (h @ w.t()).float()
    lse = logits.logsumexp(-1)
    picked = logits.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)
    g = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax, in place of the logits
    g.scatter_add_(1, t.clamp(min=0).unsqueeze(1), -torch.ones_like(picked).unsqueeze(1))  # minus the one-hot
    g = g.mul_(weight.unsqueeze(1)).to(h.dtype)  # d loss / d logits, in the matmuls' dtype
    grad_h.copy_(g @ w)
    if grad_w is not None:
        grad_w += g.t() @ h  # into the weight's dtype, in place
    return ((lse - picked) * weight).sum()
# --8<-- [end:fused]


#: --loss: how the head's output becomes the loss (None: the model's own, every position's logits at once)
LOSSES = {"full": None, "chunked": chunked_loss, "fused-linear": fused_linear_loss}
