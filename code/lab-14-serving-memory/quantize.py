"""Lab 14 - weights in fewer bits: group-wise int4 and per-channel int8 in plain PyTorch, and the bytes
each serving format keeps for one weight matrix.

A server keeps every weight resident and reads all of them at every decode step, so the weights'
precision is the first lever on serving memory: what they give up goes to the KV pool. Weight-only
formats keep the activations in bf16 and store each (out, in) matrix in fewer bits, plus the numbers
that bring the values back:

* **int4, group-wise** (AWQ, Lin et al. 2024; GPTQ, Frantar et al. 2023): each row is cut into groups
  of ``group`` inputs (128 by default). A group keeps an fp16 scale s and a 4-bit zero point z; a
  weight w is stored as q = clamp(round(w / s) + z, 0, 15) and read back as (q - z) s. Eight 4-bit
  numbers are packed into one int32. AWQ and GPTQ differ in how they choose the values (scaling salient
  channels; correcting each column's error from a Hessian), not in what is stored, except that a
  GPTQ checkpoint also carries ``g_idx``, each input's group (one int32 per input).
* **int8** (W8A8): symmetric, one fp32 scale per output row: q = round(w / s), s = max|w| / 127.
* **fp8** (e4m3, one fp32 scale per matrix) and **NVFP4** (4-bit e2m1 values, an e4m3 scale per 16 and
  an fp32 scale per matrix) are counted from their published layouts and not implemented here.

:data:`FORMATS` lists, for each ``--weights`` choice, the tensors vLLM's linear method creates for one
matrix (their shapes and dtypes, at the tag :data:`VLLM_TAG` in the files :data:`SOURCES` names), so
its bytes are exact, scales and zeros included. ``tests/test_lab14.py`` holds the int4 and int8
quantizers' real outputs to those bytes, their dequantized weights to half a step of the original, and
:func:`linear` (group by group, never the whole dequantized matrix) to ``F.linear`` on the dequantized
weight. Which matrices are quantized is :func:`quantized_linears`'s rule; the rest stay bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

VLLM_TAG = "v0.22.0"
_VLLM = f"https://github.com/vllm-project/vllm/blob/{VLLM_TAG}/vllm/model_executor/layers/quantization/"
SOURCES = {
    "bf16": "https://huggingface.co/meta-llama/Meta-Llama-3-8B (the checkpoint's own dtype)",
    "fp8": _VLLM + "fp8.py (Fp8LinearMethod.create_weights: an fp8 weight and one fp32 weight_scale per "
           "matrix); https://docs.vllm.ai/en/latest/features/quantization/fp8/",
    "int8": _VLLM + "compressed_tensors/schemes/compressed_tensors_w8a8_int8.py (an int8 weight and an fp32 "
            "weight_scale per output channel); https://docs.vllm.ai/en/latest/features/quantization/int8/",
    "int4-awq": _VLLM + "awq.py (AWQLinearMethod.create_weights: qweight (in, out/8) int32, qzeros "
                "(in/group, out/8) int32, scales (in/group, out) fp16); https://arxiv.org/abs/2306.00978",
    "int4-gptq": _VLLM + "gptq_marlin.py (GPTQMarlinLinearMethod.create_weights: qweight (in/8, out) int32, "
                 "g_idx (in) int32, qzeros and scales as AWQ's); https://arxiv.org/abs/2210.17323",
    "nvfp4": _VLLM + "compressed_tensors/schemes/compressed_tensors_w4a4_nvfp4.py (weight_packed (out, in/2) "
             "uint8, weight_scale (out, in/16) fp8 e4m3, weight_global_scale and input_global_scale fp32); "
             "https://developer.nvidia.com/blog/introducing-nvfp4-for-efficient-and-accurate-low-precision-inference/",
}
PACK = 8  # 4-bit numbers per int32


@dataclass(frozen=True)
class Format:
    """A ``--weights`` choice: bits per weight, the group its scales cover, and the tensors of one matrix."""

    name: str
    bits: int
    group: int | None  # the default group size (None: one scale per row or per matrix, as the format says)
    tunable: bool  # --group-size may change the group

    def tensors(self, out: int, inp: int, group: int | None = None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The tensors one (out, in) weight matrix is stored as: name -> (shape, dtype)."""
        g, i4, f16, f32 = group or self.group, torch.int32, torch.float16, torch.float32
        if self.name == "bf16":
            return {"weight": ((out, inp), torch.bfloat16)}
        if self.name == "fp8":
            return {"weight": ((out, inp), torch.float8_e4m3fn), "weight_scale": ((1,), f32)}
        if self.name == "int8":
            return {"weight": ((out, inp), torch.int8), "weight_scale": ((out, 1), f32)}
        if self.name == "int4-awq":
            return {"qweight": ((inp, out // PACK), i4), "qzeros": ((inp // g, out // PACK), i4),
                    "scales": ((inp // g, out), f16)}
        if self.name == "int4-gptq":
            return {"qweight": ((inp // PACK, out), i4), "g_idx": ((inp,), i4),
                    "qzeros": ((inp // g, out // PACK), i4), "scales": ((inp // g, out), f16)}
        return {"weight_packed": ((out, inp // 2), torch.uint8), "weight_scale": ((out, inp // 16), torch.float8_e4m3fn),
                "weight_global_scale": ((1,), f32), "input_global_scale": ((1,), f32)}  # nvfp4

    def nbytes(self, out: int, inp: int, group: int | None = None, block: int | None = None) -> int:
        """Bytes of one matrix in this format (each tensor rounded up to ``block`` bytes, as the
        CUDA caching allocator does; None: exact)."""
        total = 0
        for shape, dtype in self.tensors(out, inp, group).values():
            n = torch.Size(shape).numel() * dtype.itemsize
            total += -(-n // block) * block if block else n
        return total

    def check(self, out: int, inp: int, group: int | None = None) -> str | None:
        """Why an (out, in) matrix cannot take this format (None: it can)."""
        g = group or self.group
        if self.name.startswith("int4"):
            if inp % g:
                return f"a group size of {g} does not divide its input dimension {inp}"
            if out % PACK or inp % PACK:
                return f"4-bit values are packed {PACK} to an int32: its shape ({out}, {inp}) is not a multiple of {PACK}"
        if self.name == "nvfp4" and inp % 16:
            return f"NVFP4 scales blocks of 16 inputs: its input dimension {inp} is not a multiple of 16"
        return None


FORMATS = {f.name: f for f in (Format("bf16", 16, None, False), Format("fp8", 8, None, False),
                               Format("int8", 8, None, False), Format("int4-awq", 4, 128, True),
                               Format("int4-gptq", 4, 128, True), Format("nvfp4", 4, 16, False))}


# --8<-- [start:quantize]
def pack4(q: torch.Tensor) -> torch.Tensor:
    """Eight 4-bit numbers (0..15) along the last dimension into one int32: (..., n) -> (..., n / 8)."""
    shifts = torch.arange(0, 32, 4, device=q.device)
    packed = (q.to(torch.int64).unflatten(-1, (-1, PACK)) << shifts).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # the int32's own bits


def unpack4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack4`: (..., n / 8) int32 -> (..., n) int64 in 0..15."""
    shifts = torch.arange(0, 32, 4, device=packed.device)
    return ((packed.to(torch.int64)[..., None] & 0xFFFFFFFF) >> shifts & 15).flatten(-2)


def quantize_int4(w: torch.Tensor, group: int = 128) -> dict[str, torch.Tensor]:
    """Group-wise asymmetric int4: per (group, output) an fp16 scale and a 4-bit zero point, packed.
    Returns ``qweight`` (out, in / 8) int32 (packed along the input, as GPTQ; AWQ packs along the output:
    the same bytes), ``qzeros`` (in / group, out / 8) int32 and ``scales`` (in / group, out) fp16."""
    out, inp = w.shape
    g = w.float().unflatten(1, (inp // group, group))  # (out, groups, group)
    lo, hi = g.amin(-1).clamp_max(0), g.amax(-1).clamp_min(0)  # the range includes 0, so 0 is exact
    scale = ((hi - lo) / 15).clamp_min(1e-8).to(torch.float16)  # (1)!
    zero = (-lo / scale.float()).round().clamp(0, 15)
    q = ((g / scale.float()[..., None]).round() + zero[..., None]).clamp(0, 15)
    return {"qweight": pack4(q.flatten(1)), "qzeros": pack4(zero.T.contiguous()), "scales": scale.T.contiguous()}


def dequantize_int4(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """(q - z) s for every weight: the float32 matrix the int4 tensors stand for."""
    scales = t["scales"].float().T  # (out, groups)
    zeros = unpack4(t["qzeros"]).T  # (out, groups)
    q = unpack4(t["qweight"]).unflatten(1, (scales.shape[1], -1))  # (out, groups, group)
    return ((q - zeros[..., None]) * scales[..., None]).flatten(1)


def quantize_int8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Symmetric int8 with one fp32 scale per output row (the largest magnitude maps to 127)."""
    scale = (w.float().abs().amax(1, keepdim=True) / 127).clamp_min(1e-12)
    return {"weight": (w.float() / scale).round().clamp(-127, 127).to(torch.int8), "weight_scale": scale}


def dequantize_int8(t: dict[str, torch.Tensor]) -> torch.Tensor:
    return t["weight"].float() * t["weight_scale"]


def linear(x: torch.Tensor, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """``x @ W.T`` from the quantized tensors, group by group as a fused kernel does (it dequantizes in
    registers): each group's integers times its inputs, scaled; the whole float matrix never exists."""
    if "weight_scale" in t:  # int8: one scale per output, applied after the integer product
        return (x.float() @ t["weight"].float().T) * t["weight_scale"].T
    scales, zeros = t["scales"].float(), unpack4(t["qzeros"])  # (groups, out) each
    q = unpack4(t["qweight"])  # (out, in)
    size = q.shape[1] // scales.shape[0]
    y = x.new_zeros(*x.shape[:-1], q.shape[0], dtype=torch.float32)
    for i in range(scales.shape[0]):  # (2)!
        cols = slice(i * size, (i + 1) * size)
        y += (x[..., cols].float() @ (q[:, cols] - zeros[i][:, None]).float().T) * scales[i]
    return y
# --8<-- [end:quantize]


QUANTIZERS = {"int4-awq": (quantize_int4, dequantize_int4), "int4-gptq": (quantize_int4, dequantize_int4),
              "int8": (quantize_int8, dequantize_int8)}


def quantize(w: torch.Tensor, fmt: str, group: int | None = None) -> dict[str, torch.Tensor]:
    """The stored tensors of ``w`` in an implemented format (int4-awq, int4-gptq, int8); a GPTQ matrix
    also keeps ``g_idx``, the group of each input."""
    if fmt.startswith("int4"):
        group = group or FORMATS[fmt].group
        out = quantize_int4(w, group)
        if fmt == "int4-gptq":
            out["g_idx"] = torch.arange(w.shape[1], dtype=torch.int32, device=w.device) // group
        return out
    return quantize_int8(w)


def is_quantized(name: str, module: torch.nn.Module) -> bool:
    """vLLM's rule for a weight-only checkpoint: every matmul of the decoder blocks is quantized; the
    token embedding, the output head (``head``) and a mixture of experts' router stay in the model's dtype."""
    return isinstance(module, torch.nn.Linear) and not name.endswith(("router", "head"))


def quantized_linears(model: torch.nn.Module, keep=None) -> list[tuple[str, int, int]]:
    """(name, out, in) of every matrix :func:`is_quantized` picks (``keep(name)``: a checkpoint's own rule
    for the matrices it leaves in bf16)."""
    return [(n, m.out_features, m.in_features) for n, m in model.named_modules()
            if is_quantized(n, m) and not (keep and keep(n))]


def check_model(model: torch.nn.Module, fmt: str, group: int | None = None) -> str | None:
    """The first matrix of ``model`` that cannot take ``fmt`` and why (None: every one can)."""
    for name, out, inp in quantized_linears(model):
        why = FORMATS[fmt].check(out, inp, group)
        if why:
            return f"{name} ({out} x {inp}): {why}"
    return None


def model_bytes(model: torch.nn.Module, fmt: str, group: int | None = None, block: int | None = None,
                keep=None) -> int:
    """Bytes of ``model``'s weights with its quantizable matrices in ``fmt`` and the rest in bf16."""
    picked = quantized_linears(model, keep)
    names = {n + ".weight" for n, *_ in picked}
    rest = sum(-(-2 * p.numel() // block) * block if block else 2 * p.numel()
               for n, p in model.named_parameters() if n not in names)
    return rest + sum(FORMATS[fmt].nbytes(out, inp, group, block) for _, out, inp in picked)


def error_bound(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """Half a step per weight, (out, in): the most rounding to the nearest level can lose."""
    if "weight_scale" in t:
        return (t["weight_scale"] / 2).expand(t["weight"].shape)
    scales = t["scales"].float().T  # (out, groups)
    size = unpack4(t["qweight"]).shape[1] // scales.shape[1]
    return (scales / 2).repeat_interleave(size, dim=1)


def check_linear(w: torch.Tensor, x: torch.Tensor, fmt: str, group: int | None = None) -> dict:
    """Quantize ``w``, and measure: the largest error against half a step, the group-wise product against
    ``F.linear`` on the dequantized matrix, and the stored bytes against the format's."""
    t = quantize(w, fmt, group)
    deq = QUANTIZERS[fmt][1](t)
    ref = F.linear(x.float(), deq)
    return {"format": fmt, "bytes": sum(v.nbytes for v in t.values()),
            "format_bytes": FORMATS[fmt].nbytes(*w.shape, group),
            "worst_error_over_half_step": float(((w.float() - deq).abs() / error_bound(t)).max()),
            "output_difference": float((linear(x, t) - ref).abs().max() / ref.abs().max())}
