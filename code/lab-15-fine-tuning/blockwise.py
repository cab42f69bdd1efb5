"""Lab 15 - blockwise 8-bit quantization with the dynamic map (Dettmers et al., 2022).

One number per byte: a value is divided by the largest magnitude of its block (``absmax``, kept in
float32), so it lies in [-1, 1], and stored as the index of the nearest of 256 values, the
*dynamic map*. Blocks keep an outlier's damage local: one large value only coarsens its own block.

The dynamic map ("dynamic tree quantization", Dettmers 2016, https://arxiv.org/abs/1511.04561,
used by the 8-bit optimizers, https://arxiv.org/abs/2110.02861, section 2): after the sign bit, a
run of zero bits says how many decades below 1 the value is, a one bit ends the run, and the bits
left are a linear fraction of [0.1, 1]. So values near 1 get 6 bits of fraction and values near
1e-6 none: precision follows magnitude, as a float's does. A moment's values span many decades,
which is why the map suits optimizer state. Unsigned (a second moment is never negative), the sign
bit becomes one more bit of fraction.

Two users in this lab: the 8-bit AdamW (``adam8bit.py``) keeps its two moments this way, and NF4's
double quantization (``nf4.py``) keeps its absmax constants this way, in blocks of 256.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DECADES = 7  # 1e-6 .. 1: how many powers of ten the map covers below 1



# --8<-- [start:dynamic_map]
def dynamic_map(signed: bool = True) -> torch.Tensor:
    """The 256 sorted float32 values of the dynamic map: 0, 1, and per decade 10**-k (k = 6 .. 0) the
    midpoints of 2**(6 - k) equal bins of [0.1, 1] (twice as many unsigned), both signs when ``signed``."""
    values = [torch.zeros(1), torch.ones(1)]
    for k in range(DECADES):  # k = 0: the decade just below 1, the finest
        bins = 2 ** (DECADES - 1 - k + (0 if signed else 1))
        edges = torch.linspace(0.1, 1, bins + 1, dtype=torch.float32)
        middles = (edges[:-1] + edges[1:]) / 2
        scaled = middles * torch.tensor(10.0 ** -k, dtype=torch.float32)
        values += [scaled, -scaled] if signed else [scaled]
    out = torch.sort(torch.cat(values)).values
    assert out.numel() == 256
    return out
# --8<-- [end:dynamic_map]


@dataclass(frozen=True)
class Codebook:
    """A sorted table of values and the midpoints between neighbours (a value is stored as its nearest)."""

    values: torch.Tensor
    midpoints: torch.Tensor

    @classmethod
    def of(cls, values: torch.Tensor) -> Codebook:
        return cls(values, (values[:-1] + values[1:]) / 2)

    def to(self, device: torch.device) -> Codebook:
        return self if self.values.device == device else Codebook(self.values.to(device), self.midpoints.to(device))


@dataclass
class Quantized8:
    """A tensor in blocks: one uint8 code per value, one float32 absmax per block."""

    codes: torch.Tensor  # uint8, the tensor's shape
    absmax: torch.Tensor  # float32, one per block (the last block may be shorter)
    block: int


# --8<-- [start:blockwise]
def nearest(scaled: torch.Tensor, book: Codebook) -> torch.Tensor:
    """The index of the nearest value of ``book`` for each of ``scaled`` (a tie goes down)."""
    return torch.bucketize(scaled, book.midpoints.to(scaled.device))


def blocks_of(x: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    """``x`` flattened, in float32, padded with zeros to whole blocks: (blocks, block), and its length."""
    flat = x.reshape(-1).float()
    pad = -flat.numel() % block
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, block), flat.numel()


def quantize_blockwise(x: torch.Tensor, block: int, book: Codebook) -> Quantized8:
    """Each block of ``x`` divided by its absmax and rounded to the nearest value of ``book``."""
    rows, n = blocks_of(x, block)
    absmax = rows.abs().amax(dim=1)
    scaled = (rows * (1.0 / absmax.clamp(min=1e-38)).unsqueeze(1)).clamp(-1, 1)  # an all-zero block stays 0
    codes = nearest(scaled, book).to(torch.uint8).view(-1)
    codes = codes[:n].clone() if codes.numel() > n else codes  # the padding's codes are not kept
    return Quantized8(codes.view(x.shape), absmax, block)


def dequantize_blockwise(q: Quantized8, book: Codebook) -> torch.Tensor:
    """float32 values: each code's value in ``book`` times its block's absmax."""
    rows, n = blocks_of(q.codes, q.block)  # codes as padded rows of floats (their values are indices)
    values = book.values.to(q.codes.device)[rows.long()] * q.absmax.unsqueeze(1)
    return values.view(-1)[:n].view(q.codes.shape)
# --8<-- [end:blockwise]


def blocks(numel: int, block: int) -> int:
    """Blocks (and absmax constants) a tensor of ``numel`` values takes."""
    return -(-numel // block)
