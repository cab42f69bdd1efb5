"""Lab 15 - QLoRA's frozen weights: 4-bit NormalFloat with double quantization (Dettmers et al., 2023).

QLoRA (https://arxiv.org/abs/2305.14314, section 3) stores the frozen base of a LoRA in 4 bits:

* **NormalFloat (NF4)**: 16 values placed at quantiles of a normal distribution, scaled to [-1, 1],
  with an exact zero. A pretrained weight is close to normal, so each of the 16 codes is used about
  equally often: the most information 4 bits can hold for such data. Each block of 64 weights is
  divided by its largest magnitude (absmax) and every weight becomes the index of its nearest code;
  two indices are packed in a byte.
* **Double quantization**: the absmax constants (one float32 per 64 weights: 0.5 bit per weight) are
  themselves quantized, to 8 bits in blocks of 256 (``blockwise.py``'s dynamic map, after
  subtracting their mean), with one float32 scale per block: 8/64 + 32/(64 x 256) = 0.127 bit.
* **Compute in bf16**: the layer stores 4-bit codes but multiplies in bf16. Forward dequantizes the
  weight, multiplies and lets the bf16 copy go; backward dequantizes it again to pass the gradient
  to the input. The frozen weight gets no gradient and keeps nothing for backward.

``Linear4bit`` holds the codes and constants as buffers (quantize a model after giving it its dtype
and device: a later ``.to(bfloat16)`` would cast the float32 constants). Its dequantized weight is
made inside ``marks.category("dequantized")``: a ledger that watches names it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from blockwise import Codebook, Quantized8, blocks, dequantize_blockwise, dynamic_map, nearest, quantize_blockwise

from labkit import marks

# The 16 NF4 values as the QLoRA paper publishes them (appendix E) and bitsandbytes ships them
# (``get_4bit_type("nf4")``); :func:`normal_float` derives them from the normal quantiles (tested equal
# to float32 rounding: the paper's are scipy's float64 quantiles rounded once).
NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0])
BLOCK, DOUBLE_BLOCK = 64, 256  # QLoRA's block sizes: weights per absmax, absmax per float32 scale
OFFSET = 0.9677083  # the outermost quantile: the normal's tails beyond it fold onto -1 and 1
DYNAMIC = Codebook.of(dynamic_map(signed=True))  # the absmax constants' map (double quantization)
NF4_BOOK = Codebook.of(NF4)
PAIRS = torch.stack([NF4[torch.arange(256) >> 4], NF4[torch.arange(256) & 0xF]], dim=1)  # a byte's two values


# --8<-- [start:codebook]
def normal_float(offset: float = OFFSET) -> torch.Tensor:
    """NF4 from its definition: 8 positive and 7 negative normal quantiles, evenly spaced in probability
    from ``offset`` to 1/2 (the 1/2 quantile, 0, once), divided by the largest: 16 values in [-1, 1]."""
    positive = torch.special.ndtri(torch.linspace(offset, 0.5, 9)[:-1].double())
    negative = -torch.special.ndtri(torch.linspace(offset, 0.5, 8)[:-1].double())
    values = torch.sort(torch.cat([negative, torch.zeros(1, dtype=torch.float64), positive])).values
    return (values / values.abs().max()).float()
# --8<-- [end:codebook]


@dataclass
class NF4Weight:
    """A weight in NF4 with double-quantized constants: what a frozen QLoRA base keeps."""

    codes: torch.Tensor  # uint8, two 4-bit codes per byte: ceil(n / 2) bytes
    absmax: Quantized8  # the absmax per BLOCK weights, 8-bit codes in blocks of DOUBLE_BLOCK
    offset: torch.Tensor  # float32 scalar: the mean subtracted from the absmax before quantizing them
    shape: torch.Size
    block: int


# --8<-- [start:quantize]
def quantize_nf4(w: torch.Tensor, block: int = BLOCK, double_block: int = DOUBLE_BLOCK) -> NF4Weight:
    """``w`` (any float dtype) as NF4 codes in blocks of ``block``, its absmax double-quantized."""
    flat = w.reshape(-1).float()
    rows = torch.nn.functional.pad(flat, (0, -flat.numel() % block)).view(-1, block)
    absmax = rows.abs().amax(dim=1)  # one float32 per block
    scaled = (rows * (1.0 / absmax.clamp(min=1e-38)).unsqueeze(1)).clamp(-1, 1)
    codes = nearest(scaled, NF4_BOOK).to(torch.uint8).view(-1)[:flat.numel()]  # (1)!
    if codes.numel() % 2:  # an odd count: the last byte's second code is a zero weight's, NF4's 0.0
        codes = torch.cat([codes, codes.new_full((1,), int((NF4 == 0).nonzero()))])
    packed = codes[0::2] << 4 | codes[1::2]  # (2)!
    offset = absmax.mean()
    constants = quantize_blockwise(absmax - offset, double_block, DYNAMIC)  # (3)!
    return NF4Weight(packed, constants, offset, w.shape, block)


def dequantize_nf4(q: NF4Weight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight back in ``dtype``: each code's NF4 value times its block's absmax (itself dequantized),
    a chunk at a time into the output: its float32 working copies stay at 32 MiB whatever the weight."""
    n = q.shape.numel()
    absmax = dequantize_blockwise(q.absmax, DYNAMIC) + q.offset  # (4)!
    out = torch.empty(n, dtype=dtype, device=q.codes.device)
    pairs, chunk = PAIRS.to(q.codes.device), chunk_of(q.block)
    for start in range(0, n, chunk):  # (5)!
        end = min(start + chunk, n)
        values = pairs[q.codes[start // 2: (end + 1) // 2].long()].view(-1)[:end - start]  # float32, as bitsandbytes
        if (end - start) % q.block:
            values = torch.nn.functional.pad(values, (0, -(end - start) % q.block))  # the last, partial block
        values.view(-1, q.block).mul_(absmax[start // q.block: -(-end // q.block)].unsqueeze(1))
        out[start:end] = values[:end - start]  # rounded to ``dtype`` once
    return out.view(q.shape)


def chunk_of(block: int) -> int:
    """Values dequantized at once: about 2**22 (32 MiB of float32 working copies), whole blocks, even."""
    return 2 * block * max(1, 2 ** 21 // block)
# --8<-- [end:quantize]


# --8<-- [start:linear4bit]
class DequantizedMatmul(torch.autograd.Function):
    """x @ W.T with W dequantized from NF4 in forward and again in backward; nothing is saved."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: Linear4bit) -> torch.Tensor:
        ctx.layer = layer  # the codes, not a dequantized copy
        with marks.category("dequantized"):
            w = layer.weight_bf16()  # (1)!
        out = x.to(w.dtype) @ w.t()
        return out if layer.bias is None else out + layer.bias

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None
        with marks.category("dequantized"):
            w = ctx.layer.weight_bf16()  # (2)!
        return grad.to(w.dtype) @ w, None  # the input's gradient; the frozen weight gets none


class Linear4bit(nn.Module):
    """A frozen ``nn.Linear`` in NF4: codes and constants as buffers (a bias stays as it was), bf16 matmuls."""

    def __init__(self, linear: nn.Linear, block: int = BLOCK, double_block: int = DOUBLE_BLOCK,
                 compute_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        q = quantize_nf4(linear.weight.detach(), block, double_block)
        self.register_buffer("codes", q.codes)
        self.register_buffer("absmax_codes", q.absmax.codes)
        self.register_buffer("absmax_scales", q.absmax.absmax)
        self.register_buffer("absmax_offset", q.offset)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.block, self.double_block, self.compute_dtype = block, double_block, compute_dtype

    def quantized(self) -> NF4Weight:
        absmax = Quantized8(self.absmax_codes, self.absmax_scales, self.double_block)
        return NF4Weight(self.codes, absmax, self.absmax_offset, torch.Size((self.out_features, self.in_features)),
                         self.block)

    def weight_bf16(self) -> torch.Tensor:
        return dequantize_nf4(self.quantized(), self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return DequantizedMatmul.apply(x, self)
# --8<-- [end:linear4bit]


def quantize_linears(module: nn.Module, block: int = BLOCK, double_block: int = DOUBLE_BLOCK) -> list[Linear4bit]:
    """Replace every ``nn.Linear`` inside ``module`` (a model's blocks: bitsandbytes' 4-bit loading leaves
    the head alone) by a Linear4bit."""
    out = []
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                layer = Linear4bit(child, block, double_block)
                setattr(parent, name, layer)
                out.append(layer)
    return out


def constants(layer: Linear4bit) -> list[torch.Tensor]:
    """What a Linear4bit needs besides its codes to read its weight back: the quantization constants."""
    return [layer.absmax_codes, layer.absmax_scales, layer.absmax_offset]


def nf4_bytes(numel: int, block: int = BLOCK, double_block: int = DOUBLE_BLOCK) -> dict[str, int]:
    """Bytes of one weight of ``numel`` values in NF4: the codes, and the constants (absmax codes, their
    float32 scales, the float32 offset)."""
    n_blocks = blocks(numel, block)
    return {"codes": -(-numel // 2), "constants": n_blocks + 4 * blocks(n_blocks, double_block) + 4}
