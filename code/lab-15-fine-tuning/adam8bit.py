"""Lab 15 - AdamW with 8-bit states (Dettmers et al., 2022, "8-bit Optimizers via Block-wise Quantization").

AdamW keeps two moments per parameter: 8 bytes in float32, more than a bf16 weight and its gradient
together. The 8-bit optimizer (https://arxiv.org/abs/2110.02861) keeps each moment as one byte per
value, in blocks of 2,048 with a float32 absmax per block (``blockwise.py``), the first moment on the
signed dynamic map, the second (never negative) on the unsigned one: 2 bytes per parameter and
8 bytes per 2,048. Each step dequantizes a block's moments to float32, makes the ordinary AdamW
update, and quantizes them again; the update itself is in float32, so only the stored moments lose
precision, and blocks keep one large gradient from coarsening the whole tensor.

As bitsandbytes does (``min_8bit_size``), a tensor of fewer than 4,096 values keeps float32 moments:
for a norm's weight the constants would cost more than they save.

The update runs over a tensor a chunk of whole blocks at a time, so its float32 working copies stay a
few MiB whatever the tensor's size (bitsandbytes' CUDA kernel goes further: a block at a time, in
registers, no working copies at all).

**Paged optimizers** (bitsandbytes' ``PagedAdamW8bit``, QLoRA section 3) allocate the state with CUDA
unified memory (``cudaMallocManaged``): when the GPU runs short, the driver moves pages of it to host
memory and back on access, so a spike (a long sequence's activations) pages the optimizer state
out instead of ending the run (https://huggingface.co/docs/bitsandbytes/main/en/explanations/optimizers#paged-optimizers).
A CPU cannot show that, and this lab does not claim to: PyTorch's allocator does not see managed
memory either, so ``torch.cuda.max_memory_allocated`` leaves a paged optimizer's state out.
"""

from __future__ import annotations

import math

import torch
from blockwise import Codebook, Quantized8, dequantize_blockwise, dynamic_map, quantize_blockwise

SIGNED, UNSIGNED = Codebook.of(dynamic_map(signed=True)), Codebook.of(dynamic_map(signed=False))
BLOCK = 2048  # the paper's block; bitsandbytes' kernels use 256
MIN_8BIT = 4096  # smaller tensors keep float32 moments (bitsandbytes' min_8bit_size)
CHUNK_BLOCKS = 256  # blocks updated at once: the float32 working copies are this many blocks long
#: Bytes ``update`` holds at once per value of a chunk, by the bytes of a weight (and its gradient): the
#: float32 moments read back, their quantization's padded rows, magnitudes, scaled values and int64 indices,
#: the denominator; a bf16 weight and gradient add their float32 copies. Plus 4 B per block (the absmax
#: found). Counted by the ledger on this code (``tests/test_lab15.py`` holds it to the byte).
WORKING_BYTES = {4: 29, 2: 37}


class AdamW8bit(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) whose moments are stored as 8-bit blockwise codes."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, block: int = BLOCK, min_8bit: int = MIN_8BIT) -> None:
        if block < 1:
            raise ValueError(f"block must be 1 or more, got {block}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.block, self.min_8bit = block, min_8bit

    # --8<-- [start:step]
    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(self.fresh_state(p))  # (1)!
                state["step"] += 1
                n, chunk = p.numel(), self.block * CHUNK_BLOCKS
                for start in range(0, n, chunk):  # (2)!
                    self.update(p, state, group, start, min(start + chunk, n))
        return None

    def update(self, p, state, group, start: int, end: int) -> None:
        """Dequantize the moments of values start:end, take an AdamW step there, quantize them again."""
        (beta1, beta2), step, lr = group["betas"], state["step"], group["lr"]
        g = p.grad.view(-1)[start:end].float()
        m, v = self.read(state, "m", start, end), self.read(state, "v", start, end)  # (3)!
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / math.sqrt(1 - beta2 ** step)).add_(group["eps"])
        w = p.view(-1)[start:end]
        w32 = w.float()  # the weight itself when it is float32
        w32.mul_(1 - lr * group["weight_decay"]).addcdiv_(m, denom, value=-lr / (1 - beta1 ** step))
        if w32 is not w:
            w.copy_(w32)  # a bf16 weight: the float32 result rounded once
        self.write(state, "m", m, start, end)  # (4)!
        self.write(state, "v", v, start, end)
    # --8<-- [end:step]

    def fresh_state(self, p: torch.Tensor) -> dict:
        """Zero moments: 8-bit codes and a zero absmax per block, or float32 for a small tensor."""
        if p.numel() < self.min_8bit:
            return {"step": 0, "m": torch.zeros_like(p, dtype=torch.float32),
                    "v": torch.zeros_like(p, dtype=torch.float32)}
        n_blocks = -(-p.numel() // self.block)
        return {"step": 0, "m": torch.zeros_like(p, dtype=torch.uint8), "v": torch.zeros_like(p, dtype=torch.uint8),
                "m_absmax": torch.zeros(n_blocks, device=p.device), "v_absmax": torch.zeros(n_blocks, device=p.device)}

    def read(self, state: dict, name: str, start: int, end: int) -> torch.Tensor:
        """A moment of values start:end (a whole number of blocks from the start) in float32."""
        codes = state[name].view(-1)[start:end]
        if codes.dtype == torch.float32:
            return codes  # a small tensor's moment, updated in place
        absmax = state[f"{name}_absmax"][start // self.block: -(-end // self.block)]
        return dequantize_blockwise(Quantized8(codes, absmax, self.block), self.table(name, codes))

    def write(self, state: dict, name: str, values: torch.Tensor, start: int, end: int) -> None:
        codes = state[name].view(-1)[start:end]
        if codes.dtype == torch.float32:
            return
        q = quantize_blockwise(values, self.block, self.table(name, codes))
        codes.copy_(q.codes)
        state[f"{name}_absmax"][start // self.block: -(-end // self.block)].copy_(q.absmax)

    @staticmethod
    def table(name: str, like: torch.Tensor) -> Codebook:
        return (SIGNED if name == "m" else UNSIGNED).to(like.device)


def working_bytes(values: int, element: int, block: int = BLOCK) -> int:
    """The most ``update`` holds at once for a chunk of ``values`` (a weight of ``element`` bytes)."""
    return WORKING_BYTES[element] * values + 4 * -(-values // block)


def state_bytes(numel: int, block: int = BLOCK, min_8bit: int = MIN_8BIT) -> int:
    """Bytes AdamW8bit keeps for a tensor of ``numel`` values: two 1-byte codes per value and two float32
    absmax per block, or two float32 moments below ``min_8bit`` values (the step count is a Python int)."""
    if numel < min_8bit:
        return 8 * numel
    return 2 * numel + 8 * -(-numel // block)
