"""Lab 13 - context parallelism (``--cp``): ring attention, written out, and the step of one rank.

Long sequences run out of memory in the activations, which grow with the tokens. Context
parallelism (Liu et al. 2023, "Ring Attention", https://arxiv.org/abs/2310.01889) splits the
sequence of every micro-batch over N ranks: each rank embeds, normalises, projects and runs the MLP
on its own tokens only, so every activation is 1/N as long. Attention alone needs the whole
sequence: every query meets every earlier key. So the ranks stand in a ring; each keeps its queries
and passes its K/V chunk on. At each of N steps a rank attends its queries to the chunk it holds
while the next one arrives (two chunks on the rank, one in use and one in flight), and merges the
partial result by its log-sum-exp (the online softmax of flash attention). Backward runs the ring
again: the K/V chunks go round, and beside them each chunk's gradient, to which every rank adds its
share until it arrives home.

What each rank keeps for backward is what flash attention keeps on its own tokens: q, k, v, the
merged output and its log-sum-exp. PyTorch's ``context_parallel``
(``torch/distributed/tensor/experimental/_context_parallel/_attention.py`` in torch 2.13) keeps the
same; it intercepts the CUDA kernels' ops only (flash, memory-efficient, cuDNN), so on a CPU (and
on fake CPU tensors) it never engages: this file writes the ring itself, calling the CPU flash
kernel per chunk. PyTorch passes the chunks by an all-gather by default (every chunk of K/V on every
rank at once); ``set_rotate_method("alltoall")`` gives the ring traced here.

Causal masking, with torchtitan's default head-tail split (``context_parallel_load_balancer =
"headtail"``; ``balanced=False``: contiguous chunks): the sequence is cut into 2N chunks and rank r
holds chunks r and 2N-1-r, so every rank has early and late tokens and the same work. At step 0 a
rank attends its own two chunks with the causal mask (their concatenation is in order); from an
earlier rank it needs only that rank's first chunk, every query against it unmasked; from a later
rank only its own second chunk's queries, against both of that rank's chunks, unmasked.

The trace (``--cp``) is rank 0 of the ring, head-tail split: the model runs on seq / cp tokens (RoPE's
tables are as long; their positions would be the rank's own, which changes no byte), every causal
attention is :class:`RingAttention`, and each pass is a real isend/irecv on the fake process group,
received into fresh buffers (``communication``). Under ``--tp`` the ring runs on the TP rank's own heads
(the column-parallel projections leave q, k and v local tensors of heads / tp heads) and passes to the
rank ``--tp`` ranks on: tp is the mesh's innermost dimension, cp the next, as torchtitan's mesh
(``torchtitan/distributed/parallel_dims.py``). Not traced with op-level checkpointing policies: a
policy that saves attention's outputs would save each ring step's partial one here, where PyTorch's
ring, running below DTensor's dispatch, shows the policy only the merged output.
"""

from __future__ import annotations

import contextlib
import queue
import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit import marks

ATTEND = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # (out, logsumexp); GQA as enable_gqa
ATTEND_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


# --8<-- [start:ring]
def blocks(rank: int, size: int, step: int, balanced: bool):
    """What rank ``rank`` attends at ``step`` of the ring: (which of its queries, which of the held
    chunk's keys, causal), each a slice of the sequence dimension; None: nothing (all masked)."""
    whole, first, second = slice(None), slice(0, 1), slice(1, 2)  # halves, in units of half a chunk
    source = (rank - step) % size  # the rank whose K/V chunk this rank holds now
    if step == 0:
        return whole, whole, True
    if source < rank:
        return (whole, first, False) if balanced else (whole, whole, False)
    return (second, whole, False) if balanced else None


def halves(t: torch.Tensor, part: slice) -> torch.Tensor:
    """``part`` of ``t`` along the sequence (dim 2: q, k, v are (B, heads, T, head_dim), a log-sum-exp
    (B, heads, T)), in halves: slice(None) is all of it."""
    if part.start is None:
        return t
    half = t.size(2) // 2
    return t[:, :, part.start * half:part.stop * half]


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries against every rank's K/V, passed round ``ring``."""

    @staticmethod
    def forward(ctx, q, k, v, ring, balanced: bool):
        acc = torch.promote_types(q.dtype, torch.float32)  # merged in fp32 (or fp64), as PyTorch's CP
        b, heads, t, d = q.shape  # laid out (B, T, heads, head_dim), as the flash kernels return their output:
        out = torch.zeros(b, t, heads, d, dtype=acc, device=q.device).transpose(1, 2)  # o_proj reads it as a view
        lse = torch.full(q.shape[:3], -torch.inf, dtype=acc, device=q.device)
        held = (k, v)
        for step in range(ring.size):
            arriving = ring.pass_on(held) if step < ring.size - 1 else None  # the next chunk, in flight
            part = blocks(ring.rank, ring.size, step, balanced)
            if part is not None:
                rows, cols, causal = part
                o, m = ATTEND(halves(q, rows), halves(held[0], cols), halves(held[1], cols), 0.0, causal)
                merge(halves(out, rows), halves(lse, rows), o, m)
            held = arriving.wait() if arriving is not None else None
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)  # what flash attention keeps, on this rank's tokens
        ctx.ring, ctx.balanced = ring, balanced
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, dout = ctx.ring, dout.contiguous()
        dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)  # gradients summed in fp32, as PyTorch's CP
        held = (k, v)
        grads = tuple(torch.zeros(t.shape, dtype=lse.dtype, device=t.device) for t in held)  # the held chunk's
        for step in range(ring.size):
            arriving = ring.pass_on(held) if step < ring.size - 1 else None
            part = blocks(ring.rank, ring.size, step, ctx.balanced)
            if part is not None:
                rows, cols, causal = part
                lse_rows = halves(lse, rows).contiguous()
                g = ATTEND_BACKWARD(halves(dout, rows), halves(q, rows), halves(held[0], cols), halves(held[1], cols),
                                    halves(out, rows), lse_rows, 0.0, causal)
                halves(dq, rows).add_(g[0])
                for total, share in zip(grads, g[1:]):
                    halves(total, cols).add_(share)
            returning = ring.pass_on(grads)  # on to the next rank, which holds this chunk next
            held = arriving.wait() if arriving is not None else None
            grads = returning.wait()  # after N passes: this rank's own chunk's gradients, every share added
        return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None, None


def merge(out, lse, o, m) -> None:
    """Fold a block's output ``o`` and log-sum-exp ``m`` into the running ``out`` and ``lse``, in place:
    each weighted by its share of the new total, exp(its lse - the new lse) (the online softmax)."""
    total = torch.logaddexp(lse, m)
    out.mul_(torch.exp(lse - total).unsqueeze(-1)).add_(o * torch.exp(m - total).unsqueeze(-1))
    lse.copy_(total)
# --8<-- [end:ring]


def shard(t: torch.Tensor, rank: int, size: int, balanced: bool) -> torch.Tensor:
    """Rank ``rank``'s tokens of ``t`` (dim 2): chunk r of N, or chunks r and 2N-1-r of 2N (head-tail)."""
    if not balanced:
        return t.chunk(size, dim=2)[rank]
    chunks = t.chunk(2 * size, dim=2)
    return torch.cat((chunks[rank], chunks[2 * size - 1 - rank]), dim=2)


def unshard(parts: list[torch.Tensor], balanced: bool) -> torch.Tensor:
    """The whole sequence again from every rank's ``parts`` (``shard``'s inverse)."""
    if not balanced:
        return torch.cat(parts, dim=2)
    heads = [p.chunk(2, dim=2) for p in parts]
    return torch.cat([h[0] for h in heads] + [h[1] for h in reversed(heads)], dim=2)


class Sent:
    """What ``pass_on`` returns: ``wait()`` gives the tensors received from the previous rank."""

    def __init__(self, wait) -> None:
        self.wait = wait


class ThreadRing:
    """N ranks as N threads of one process, each with an inbox (the simulation the test runs)."""

    def __init__(self, rank: int, inboxes: list[queue.Queue]) -> None:
        self.rank, self.size, self.inboxes = rank, len(inboxes), inboxes

    def pass_on(self, tensors) -> Sent:
        self.inboxes[(self.rank + 1) % self.size].put(tuple(t.clone() for t in tensors))
        return Sent(self.inboxes[self.rank].get)


def simulate(q, k, v, dout, size: int, balanced: bool = True):
    """Ring attention of (B, heads, T, head_dim) ``q``, ``k``, ``v`` over ``size`` simulated ranks (threads),
    then its backward from ``dout``: the output and (dq, dk, dv), each rank's share put back in order."""
    inboxes = [queue.Queue() for _ in range(size)]
    outs, grads, errors = [None] * size, [None] * size, []

    def rank(r: int) -> None:
        try:
            local = [shard(t, r, size, balanced).detach().requires_grad_() for t in (q, k, v)]
            out = RingAttention.apply(*local, ThreadRing(r, inboxes), balanced)
            out.backward(shard(dout, r, size, balanced))
            outs[r], grads[r] = out.detach(), [t.grad for t in local]
        except BaseException as exc:  # pragma: no cover - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return unshard(outs, balanced), [unshard([g[i] for g in grads], balanced) for i in range(3)]


class FakeGroupRing:
    """This process as rank 0 of ``size`` ranks of the (fake) process group: each pass sends the held
    tensors to the next rank and receives the previous rank's into fresh buffers, as real isend/irecv."""

    def __init__(self, size: int, stride: int = 1) -> None:
        self.rank, self.size, self.stride = 0, size, stride  # stride: the ring's neighbours in the world

    def pass_on(self, tensors) -> Sent:
        with marks.category("communication"):
            received = tuple(torch.empty_like(t) for t in tensors)
        ops = [dist.P2POp(dist.isend, t, self.stride) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, (self.size - 1) * self.stride) for t in received]
        works = dist.batch_isend_irecv(ops)

        def wait():
            for w in works:
                w.wait()
            return received
        return Sent(wait)


@contextlib.contextmanager
def ring_attention(ring, balanced: bool = True):
    """Every causal ``F.scaled_dot_product_attention`` in the block run as :class:`RingAttention` on ``ring``:
    the function swapped for the block, as PyTorch's ``context_parallel`` does by default (its
    monkey-patch dispatch mode; a TorchFunctionMode would miss checkpointing's recompute in backward)."""
    plain = F.scaled_dot_product_attention

    def attend(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if not is_causal or attn_mask is not None or dropout_p or scale is not None:
            raise NotImplementedError("the ring here runs causal attention without a mask, dropout or a scale")
        return RingAttention.apply(q, k, v, ring, balanced)  # GQA: the kernel serves each KV head's queries

    F.scaled_dot_product_attention = attend
    try:
        yield
    finally:
        F.scaled_dot_product_attention = plain


def context_parallel(config, stride: int = 1):
    """The context ``--cp`` runs the step in (nothing without it): rank 0's ring on the fake group, its
    neighbours ``stride`` ranks apart (--tp's degree: a mesh's tp dimension is innermost, as torchtitan's)."""
    return ring_attention(FakeGroupRing(config.cp, stride)) if config.cp > 1 else contextlib.nullcontext()


def local_tokens(config) -> int:
    """The tokens of each sequence this rank holds: --seq / --cp (one for a decode step)."""
    return 1 if config.task == "decode" else config.seq // config.cp


def check(config) -> str | None:
    """What ``--cp`` cannot trace, in one line (None: it can); the rules shared with the calculator are
    Lab 01's fit_rules.check_combinations."""
    if config.cp == 1:
        return None
    if config.spec.family not in ("llama", "mixtral"):
        return f"--cp {config.cp} rings a zoo Llama's or Mixtral's attention, not {config.model}'s"
    if config.compile:
        return f"--cp {config.cp} with --compile is not traced together: leave one out"
    return None
