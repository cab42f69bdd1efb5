"""Lab 13 - float8 training of the blocks' linears, as torchao's ``Float8Linear`` does it (``--float8``).

torchao (https://github.com/pytorch/ao, read at commit 36027d82d1ad9949597ea16002ff4940374b1b94:
``torchao/float8/float8_linear.py``, ``config.py``, ``float8_utils.py``, ``fsdp_utils.py``) trains a
linear layer's three matmuls in float8 and keeps everything else as it was: the weights stay bf16 or
fp32 masters, the optimizer is unchanged, and only the matmuls' operands are cast, just before each
matmul, with one scale per tensor computed from that tensor's largest magnitude (dynamic tensorwise
scaling, its default recipe):

    forward     input and weight cast to float8_e4m3fn (3 mantissa bits, range 448)
    backward    the output's gradient cast to float8_e5m2 (2 mantissa bits, range 57,344); the saved
                input and weight cast to e4m3 again, for the two gradient matmuls

What backward keeps: torchao's default saves the **high-precision** input and weight
(``ctx.save_for_backward(input_hp, weight_hp_t)``) and casts them again in backward, so a float8
linear keeps the same bf16 input a plain one keeps. Under torch AMP it keeps no bf16 copy of the
weight: autocast does not cast it (the weight goes to float8 from fp32), so the copies autocast
caches for every linear are gone. Each cast here makes, for an instant, its tensor's magnitudes (for the
scale) and one fp32 copy (eager mode, as torchao's eager casts do; under torch.compile the cast is one
fused kernel and neither exists). ``torch._scaled_mm`` multiplies
the float8 operands (it runs on a CPU in torch 2.13, and has a fake-tensor kernel) with a row-major
first operand and a column-major second, so backward copies the float8 operands it needs
transposed, as torchao's ``preprocess_addmm`` does. The layers converted are the blocks' linears
whose dimensions are multiples of 16 (torchao's rule for ``_scaled_mm``; torchtitan also leaves the
head in bf16).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn

from labkit.config import UsageError

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12  # torchao's floor on the largest magnitude (float8_utils.EPS): an all-zero tensor gets a finite scale


# --8<-- [start:float8]
def to_float8(x: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in float8 ``dtype`` with one scale for the whole tensor: its largest magnitude (or ``amax``, a whole
    weight's when ``x`` is a shard of it) lands on the format's largest value. Returns the float8 bits and the
    inverse scale (x ≈ bits × inverse)."""
    amax = (x.abs().max() if amax is None else amax).double().clamp(min=EPS)
    scale = (torch.finfo(dtype).max / amax).float()  # in float64 first, as torchao
    bits = x.to(torch.float32, copy=True).mul_(scale).to(dtype)  # one fp32 copy for an instant; saturates
    return bits, scale.reciprocal()


def scaled_mm(a, a_inv, b, b_inv, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` of float8 operands, accumulated in fp32, returned in ``out_dtype``: torch._scaled_mm, which
    wants ``a`` row-major and ``b`` column-major (a transposed operand is copied, one byte per element)."""
    a = a if a.is_contiguous() else a.contiguous()
    b = b if b.t().is_contiguous() else b.t().contiguous().t()
    return torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype)


class Float8Matmul(torch.autograd.Function):
    """``x @ weight.T`` with all three matmuls in float8 (torchao's ``matmul_with_hp_or_float8_args``)."""

    @staticmethod
    def forward(ctx, x, weight, group=None):
        ctx.save_for_backward(x, weight)  # torchao's default: the input and weight as received (high precision)
        ctx.group = group  # --tp: the ranks whose largest magnitudes make each weight's and gradient's scale
        x8, x_inv = float8_of(x, E4M3)
        w8, w_inv = float8_of(weight, E4M3, group)
        return scaled_mm(x8, x_inv, w8.t(), w_inv, x.dtype).view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g8, g_inv = float8_of(grad, E5M2, ctx.group)  # gradients need range more than precision
        w8, w_inv = float8_of(weight, E4M3, ctx.group)
        grad_x = scaled_mm(g8, g_inv, w8, w_inv, grad.dtype).view_as(x)
        del w8
        x8, x_inv = float8_of(x, E4M3)
        grad_w = scaled_mm(g8.t(), g_inv, x8, x_inv, grad.dtype)  # g8.t() and x8 both copied to the layouts wanted
        return grad_x, grad_w, None


def float8_of(t: torch.Tensor, dtype: torch.dtype, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` as a matrix in float8 ``dtype`` and its inverse scale: cast here (with ``group``, a shard cast with the
    whole tensor's scale), or as already delivered in float8 (``fit_float8_gather.Float8Weight``: FSDP2's float8
    all-gather, or ``fit_float8_tp``'s casts under --tp), used as it is."""
    if hasattr(t, "bits"):
        return t.bits.reshape(-1, t.size(-1)), t.inverse
    amax = None if group is None else funcol.wait_tensor(funcol.all_reduce(t.abs().max(), "max", group))
    return to_float8(t.reshape(-1, t.size(-1)), dtype, amax)


class Float8Linear(nn.Linear):
    """An ``nn.Linear`` (no bias) whose matmuls run in float8; its weight is the original one, unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type) and not hasattr(x, "bits"):  # autocast's cast, as torchao repeats it
            x = x.to(torch.get_autocast_dtype(x.device.type))
        group = getattr(self, "tp_group", None)  # --tp (fit_float8_tp.py): this rank's slice of a split weight
        weight = self.weight.to_local() if group is not None else self.weight
        with torch.autocast(x.device.type, enabled=False):
            return Float8Matmul.apply(x, weight, group)
# --8<-- [end:float8]


def convertible(module: nn.Module) -> bool:
    """torchao's rule for a float8 linear: no bias here, and both dimensions multiples of 16."""
    return type(module) is nn.Linear and module.bias is None and not module.in_features % 16 \
        and not module.out_features % 16


def convert(model: nn.Module, recipe: str = "tensorwise") -> int:
    """Swap every convertible linear of ``model.blocks`` for a :class:`Float8Linear` sharing its weight (as
    torchao's ``convert_to_float8_training``; the head stays as it is). Returns how many were swapped. With
    ``tensorwise-all-gather`` each weight is then one whose FSDP2 all-gather sends float8 (``fit_float8_gather``)."""
    swapped = 0
    for parent in model.blocks.modules():
        for name, child in parent.named_children():
            if convertible(child):
                new = Float8Linear(child.in_features, child.out_features, bias=False, device="meta")
                new.weight = child.weight
                setattr(parent, name, new)
                swapped += 1
    if recipe == "tensorwise-all-gather":
        from fit_float8_gather import wrap_weights  # (it imports this file)
        wrap_weights(model)
    return swapped


# --8<-- [start:all-gather]
def fsdp_float8_all_gather(spec, dp: int) -> dict:
    """Derived, not traced: what torchao's ``enable_fsdp_float8_all_gather`` changes on each of ``dp`` FSDP2 ranks
    that gather bf16 weights (MixedPrecisionPolicy(param_dtype=bf16)). Each rank casts its shard of a float8
    linear's weight to e4m3 before the all-gather (one scale per weight, its largest magnitude all-reduced over
    the ranks), so the gathered weight is 1 byte per element instead of 2, with one fp32 scale; the norms are
    gathered in bf16 as before. A float8 linear then uses that weight as it is: no cast in forward or backward.

    Returns, for one block of ``spec``: its gathered bytes both ways, and the bytes each rank receives in a step
    in which every block is gathered twice (forward, and again in backward after resharding)."""
    with torch.device("meta"):
        block = spec.build().blocks[0]
    linears = [m.weight.numel() for m in block.modules() if convertible(m)]
    everything = sum(p.numel() for p in block.parameters())
    bf16 = 2 * everything
    float8 = 1 * sum(linears) + 2 * (everything - sum(linears)) + 4 * len(linears)  # bits, norms in bf16, scales
    gathers = 2 * spec.layers  # per step; each rank receives all but its own shard
    return {"linears": sum(linears), "block": everything, "scales": len(linears), "block_bf16": bf16,
            "block_float8": float8, "received_bf16": gathers * bf16 * (dp - 1) // dp,
            "received_float8": gathers * float8 * (dp - 1) // dp}
# --8<-- [end:all-gather]


def check(config) -> None:
    """``--float8``'s refusal for a model whose block linears are not a dense zoo Llama's (Lab 13's Config calls it)."""
    if config.float8 != "none" and config.spec.family != "llama":
        raise UsageError(f"--float8 converts a dense zoo Llama's block linears (--model llama-3-8b, ...), not {config.model}'s")
