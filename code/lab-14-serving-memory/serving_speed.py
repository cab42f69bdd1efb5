"""Lab 14 - how fast a GPU can decode: memory capacity decides how many requests fit, memory
bandwidth how fast each one gets its next token.

A kernel is limited by arithmetic or by memory traffic, whichever takes longer. Its **arithmetic
intensity** I (floating-point operations per byte moved between HBM and the chip) says which: a GPU
of peak P FLOP/s and HBM bandwidth W B/s attains at most ``min(P, I x W)`` (the roofline), and the
two meet at the **ridge point** ``P / W``. Below it the kernel waits on memory.

* A training matmul, a (d_out x d_in) weight times t tokens, does ``2 t d_in d_out`` FLOPs and moves
  the input, the weight and the output once each (what a tiled kernel approaches): over a thousand FLOPs
  per byte at training sizes, far right of the ridge.
* A decode step makes one token for each of B sequences. It reads every weight matrix once (the
  embedding table only the B rows it looks up; a tied head reads the whole table) and every
  sequence's keys and values, c tokens each; it does 2 FLOPs per matmul weight and per sequence,
  plus ``4 a d_head`` per layer per cached token for attention. At B = 1 that is about one FLOP per
  byte: the GPU waits on HBM, and **tokens/s <= W x B / bytes read per step**.

What is left out: the norms', RoPE's and softmax's element-wise FLOPs, and the activations' own
traffic (a decode step's activations are a few vectors per sequence); reading every byte once is a
lower bound on traffic, so the bound on tokens/s is an upper one. The hardware numbers are **cited**
from NVIDIA, each with its source; the arithmetic is **derived** (``tests/test_lab14.py`` counts the
FLOPs of a real decode step with PyTorch's FlopCounterMode and holds them to ``decode_step``).
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit import labs
from labkit.table import Table

FIT_GPUS = labs.load(13, "fit_gpus")  # the cards' memory as their datasheets state it, once

H100_PAGE = "https://www.nvidia.com/en-us/data-center/h100/"
H200_PAGE = "https://www.nvidia.com/en-us/data-center/h200/"
HOPPER_BLOG = "https://developer.nvidia.com/blog/nvidia-hopper-architecture-in-depth/"
HOPPER_TUNING = "https://docs.nvidia.com/cuda/hopper-tuning-guide/index.html"
ADA_TUNING = "https://docs.nvidia.com/cuda/ada-tuning-guide/index.html"
ADA_WHITEPAPER = "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf"
CUDA_GPUS = "https://developer.nvidia.com/cuda-gpus"  # which compute capability each card has
KB, MB = 1 << 10, 1 << 20  # NVIDIA's KB and MB of on-chip memory are binary (65,536 x 4 B = "256 KB")


@dataclass(frozen=True)
class Cited:
    """One number as a source states it: its value in bytes, B/s or FLOP/s, the words, the sources."""

    value: float
    stated: str
    sources: tuple[str, ...]


@dataclass(frozen=True)
class Chip:
    """A card's memory levels and speeds. ``name`` is Lab 13's (``fit_gpus.GPUS``), whose datasheet
    entry states the card's memory."""

    name: str
    label: str
    registers_per_sm: Cited
    l1_shared_per_sm: Cited  # L1 cache and shared memory: one array per SM, split as a kernel asks
    l2: Cited | None  # None: NVIDIA's pages for the card give no figure
    bandwidth: Cited  # HBM (GDDR on a GeForce card) to the chip
    bf16_dense: Cited  # peak bf16 tensor-core FLOP/s without structured sparsity

    @property
    def memory(self) -> Cited:
        gpu = FIT_GPUS.GPUS[self.name]
        amount, unit = gpu.stated.split()[:2]
        if unit != "GB":
            raise ValueError(f"{self.name}: cannot read the memory of {gpu.stated!r}")
        return Cited(float(amount) * 1e9, gpu.stated, (gpu.datasheet,))

    @property
    def ridge(self) -> float:
        """FLOPs per byte where the roofline bends: peak FLOP/s over bandwidth (derived)."""
        return self.bf16_dense.value / self.bandwidth.value


REGISTERS = "256 KB"  # "64K 32-bit registers per SM" (the tuning guides); "256 KB" (the Hopper blog's table)
HOPPER_L1 = "256 KB"  # "combined L1 cache, texture cache, and shared memory" of compute capability 9.0
HOPPER_BF16 = "1,979 TFLOPS with sparsity"  # the product pages' footnote; half of it without
CHIPS = {c.name: c for c in (
    Chip("h100-80gb", "H100 SXM",
         Cited(64 * KB * 4, REGISTERS, (HOPPER_BLOG,)),
         Cited(256 * KB, HOPPER_L1, (HOPPER_TUNING,)),
         Cited(50 * MB, "50 MB", (HOPPER_BLOG,)),
         Cited(3.35e12, "3.35 TB/s", (H100_PAGE,)),
         Cited(1979e12 / 2, HOPPER_BF16, (H100_PAGE,))),
    Chip("h200-141gb", "H200 SXM",  # the H100's chip: its per-SM numbers are compute capability 9.0's
         Cited(64 * KB * 4, REGISTERS, (HOPPER_TUNING, CUDA_GPUS)),
         Cited(256 * KB, HOPPER_L1, (HOPPER_TUNING, CUDA_GPUS)),
         None,
         Cited(4.8e12, "4.8 TB/s", (H200_PAGE,)),
         Cited(1979e12 / 2, HOPPER_BF16, (H200_PAGE,))),
    Chip("rtx4090-24gb", "RTX 4090",
         Cited(64 * KB * 4, REGISTERS, (ADA_TUNING,)),
         Cited(128 * KB, "128 KB", (ADA_TUNING,)),
         Cited(72 * MB, "72 MB", (ADA_WHITEPAPER,)),
         Cited(1008e9, "1,008 GB/s", (ADA_WHITEPAPER,)),
         Cited(165.2e12, "165.2 TFLOPS, FP32 accumulate", (ADA_WHITEPAPER,))),  # 330.4 with sparsity
)}


_NV = "https://www.nvidia.com/en-us/data-center/"
#: Every card of Lab 13's table: its memory bandwidth, as its maker states it (cited); the three above from
#: their chips, the others from their product pages (SXM figures for the A100s, per GPU for HGX B200).
BANDWIDTHS = {c.name: c.bandwidth for c in CHIPS.values()} | {
    "a100-80gb": Cited(2039e9, "2,039 GB/s", (_NV + "a100/",)),
    "a100-40gb": Cited(1555e9, "1,555 GB/s", (_NV + "a100/",)),
    "l40s-48gb": Cited(864e9, "864 GB/s", (_NV + "l40s/",)),
    "l4-24gb": Cited(300e9, "300 GB/s", (_NV + "l4/",)),
    "a10-24gb": Cited(600e9, "600 GB/s", (_NV + "products/a10-gpu/",)),
    "h100-nvl-94gb": Cited(3.9e12, "3.9 TB/s", (_NV + "h100/",)),
    "b200-180gb": Cited(8e12, "8 TB/s", (_NV + "hgx/",)),
    "rtx-a6000-48gb": Cited(768e9, "768 GB/s", ("https://www.nvidia.com/en-us/design-visualization/rtx-a6000/",)),
    "mi300x-192gb": Cited(5.3e12, "5.3 TB/s",
                          ("https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html",)),
}


def bound(gpu: str, weight_bytes: int, kv_bytes_per_token: int, context: int, batch: int = 1) -> float:
    """The most tokens per second ``batch`` sequences of ``context`` tokens can decode on one ``gpu``
    (derived): each step reads every resident weight once (``weight_bytes``: as stored, quantized or not)
    and each sequence's keys and values, and makes one token per sequence, so
    tokens/s <= bandwidth x batch / (weights + batch x context x KV bytes per token)."""
    return batch * BANDWIDTHS[gpu].value / (weight_bytes + batch * context * kv_bytes_per_token)


def matmul(tokens: int, d_in: int, d_out: int, element_bytes: int = 2) -> tuple[int, int]:
    """(FLOPs, bytes) of ``Y = X W^T``, X (tokens, d_in), W (d_out, d_in): a multiply and an add per
    weight per token; X and W read once, Y written once."""
    return 2 * tokens * d_in * d_out, element_bytes * (tokens * d_in + d_out * d_in + tokens * d_out)


def decode_step(spec, context: int, batch: int = 1, element_bytes: int = 2) -> tuple[int, int]:
    """(FLOPs, bytes read) of one decode step of a zoo Llama: ``batch`` sequences, each attending to
    ``context`` cached tokens (its new one included), weights and KV cache in ``element_bytes``."""
    if spec.family != "llama":
        raise ValueError(f"{spec.name}: decode_step counts dense Llamas (a mixture of experts reads routed experts)")
    h, table = spec.width, spec.vocab * spec.width
    norms = (2 * spec.layers + 1) * h
    matmul_weights = spec.param_count() - norms - (0 if spec.tied else table)  # a tied head multiplies by the table
    weights_read = spec.param_count() - (0 if spec.tied else table - batch * h)  # the embedding: B rows
    attention = 4 * spec.layers * spec.heads * spec.head_dim * context  # q.k and p.v, per new token
    kv_read = batch * context * spec.kv_bytes_per_token(element_bytes)
    return batch * (2 * matmul_weights + attention), element_bytes * weights_read + kv_read


def attainable(chip: Chip, intensity: float) -> float:
    """The roofline: FLOP/s a kernel of ``intensity`` FLOPs per byte can reach on ``chip``."""
    return min(chip.bf16_dense.value, intensity * chip.bandwidth.value)


def decode(chip: Chip, spec, context: int, batch: int = 1) -> dict:
    """One decode step on ``chip`` (derived): its FLOPs and bytes read (the weights' and the KV cache's),
    FLOPs per byte, and the bandwidth bound on tokens per second: the step reads its bytes once, at the
    card's bandwidth, and makes ``batch`` tokens."""
    flops, read = decode_step(spec, context, batch)
    kv = batch * context * spec.kv_bytes_per_token(2)
    return {"batch": batch, "context": context, "flops": flops, "bytes": read, "weight_bytes": read - kv,
            "kv_bytes": kv, "intensity": flops / read, "tokens_per_s": batch * chip.bandwidth.value / read}


def sizes_table() -> Table:
    """Each card's memory, level by level, as NVIDIA states it (cited)."""
    return Table(["GPU", "registers / SM", "L1 + shared / SM", "L2", "memory"],
                 [[c.label, c.registers_per_sm.stated, c.l1_shared_per_sm.stated, c.l2.stated if c.l2 else None,
                   c.memory.stated] for c in CHIPS.values()])


def decode_table(steps: list[dict]) -> Table:
    """Decode steps (:func:`decode`): bytes read, FLOPs per byte and the bound on tokens per second."""
    return Table([("sequences", "int"), ("context", "int"), ("bytes read per step", "size"), ("FLOPs / byte", "float:1"),
                  ("tokens / s at most", "float:0")],
                 [[d["batch"], d["context"], d["bytes"], d["intensity"], d["tokens_per_s"]] for d in steps])


def speeds_table() -> Table:
    """Each card's HBM bandwidth and dense bf16 peak (cited), and its ridge point (derived)."""
    return Table(["GPU", "memory bandwidth", ("bf16 TFLOP/s, dense", "float:1"), ("ridge, FLOPs / byte", "float:0")],
                 [[c.label, c.bandwidth.stated, c.bf16_dense.value / 1e12, c.ridge] for c in CHIPS.values()])


def sources() -> list[str]:
    """Every source the hardware numbers cite, each once."""
    facts = [f for c in CHIPS.values() for f in (c.registers_per_sm, c.l1_shared_per_sm, c.l2, c.memory,
                                                 c.bandwidth, c.bf16_dense) if f is not None]
    return list(dict.fromkeys(s for f in facts for s in f.sources))
