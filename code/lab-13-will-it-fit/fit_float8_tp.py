"""Lab 13 - float8 linears under tensor parallelism (``--float8 tensorwise --tp N [--sp]``), as torchao's float8
tensor-parallel styles run them.

torchao (``torchao/float8/float8_tensor_parallel.py`` at commit 36027d82d1ad9949597ea16002ff4940374b1b94) gives
three styles, which torchtitan's Llama plan uses in place of DTensor's for tensorwise float8
(``apply_tp`` in ``torchtitan/models/llama3/parallelize.py`` at commit bd6aec6195cbe86838c03a567f0638b5900528a9):

    PrepareFloat8ModuleInput   on the attention and the MLP: their input cast to e4m3 once, **before** the
                               all-gather of --sp, so the gather sends 1 byte per element and q, k, v (gate,
                               up) share one float8 input; also without --sp (a cast, no gather)
    Float8ColwiseParallel      q, k, v, gate, up: the input arrives in float8; the output's gradient is cast
                               to e5m2 in backward (``NoopFwToFloat8BwDynamic``)
    Float8RowwiseParallel      o, down: the input (this rank's slice of the heads or of the MLP) cast to e4m3;
                               the partial output reduce-scattered (--sp) or all-reduced; in backward its
                               gradient cast to e5m2 **before** --sp's all-gather of it

Every scale is the whole tensor's: a shard's largest magnitude all-reduced (MAX) over the TP ranks. A float8
linear saves its input as it received it (``ctx.save_for_backward(input_hp, ...)``), and here that input is
already float8: the blocks' linears save 1 byte per element of their inputs, not 2. The weights stay
split by DTensor (each rank its columns or rows); each rank casts its local slice with the whole weight's
scale, in forward and again in backward. Written in plain PyTorch on functional collectives (as DTensor's); the float8 tensors
that cross module boundaries are ``fit_float8_gather.Float8Weight`` (bits and an inverse scale standing for
a bf16 tensor).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor.parallel.style import distribute_module

from fit_float8 import E4M3, E5M2, float8_of
from fit_float8_gather import Float8Weight


# --8<-- [start:styles]
def cast(x: torch.Tensor, dtype: torch.dtype, group) -> Float8Weight:
    """``x`` (a rank's shard) in float8 with the whole tensor's scale: its largest magnitude, all-reduced."""
    bits, inverse = float8_of(x, dtype, group)
    return Float8Weight(bits.view(x.shape), inverse, x.dtype)


def gather(bits: torch.Tensor, group) -> torch.Tensor:
    """The sequence shards (dim 1) of the ranks, all-gathered in float8: (b, s/t, h) -> (b, s, h). (Functional
    collectives, as DTensor's redistribute runs them.)"""
    return funcol.wait_tensor(funcol.all_gather_single(bits.view(torch.uint8), 1, group)).view(bits.dtype)


class CastInput(torch.autograd.Function):
    """Forward: ``x`` cast to e4m3 (with --sp, then all-gathered in float8); backward: the gradient summed over
    the ranks (each holds a partial one: its columns' share), reduce-scattered back to the sequence shard."""

    @staticmethod
    def forward(ctx, x, group, sp: bool):
        ctx.group, ctx.sp = group, sp
        x8 = cast(x, E4M3, group)
        return Float8Weight(gather(x8.bits, group), x8.inverse, x.dtype) if sp else x8

    @staticmethod
    def backward(ctx, grad):
        if not ctx.sp:
            return None if grad is None else _reduce(grad, ctx.group, False), None, None
        return _reduce(grad, ctx.group, True), None, None


class CastRowInput(torch.autograd.Function):
    """A row-parallel linear's input (this rank's heads or MLP slice) cast to e4m3; its gradient passes through."""

    @staticmethod
    def forward(ctx, x, group):
        return cast(x, E4M3, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GradToFloat8(torch.autograd.Function):
    """Forward: nothing (a view); backward: the output's gradient cast to e5m2 (torchao's NoopFwToFloat8BwDynamic)."""

    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return cast(grad, E5M2, ctx.group), None


class ReduceOutput(torch.autograd.Function):
    """A row-parallel linear's partial output summed over the ranks: reduce-scattered along the sequence (--sp) or
    all-reduced; in backward the gradient cast to e5m2 first, then (--sp) all-gathered in float8."""

    @staticmethod
    def forward(ctx, y, group, sp: bool):
        ctx.group, ctx.sp = group, sp
        return _reduce(y, group, sp)

    @staticmethod
    def backward(ctx, grad):
        g8 = cast(grad, E5M2, ctx.group)
        return (Float8Weight(gather(g8.bits, ctx.group), g8.inverse, grad.dtype) if ctx.sp else g8), None, None


def _reduce(y: torch.Tensor, group, sp: bool) -> torch.Tensor:
    """Sum ``y`` over the ranks: all-reduced, or (``sp``) reduce-scattered along dim 1."""
    out = funcol.reduce_scatter_single(y, "sum", 1, group) if sp else funcol.all_reduce(y, "sum", group)
    return funcol.wait_tensor(out)


class PrepareFloat8Input(ParallelStyle):
    """torchao's ``PrepareFloat8ModuleInput`` for a sublayer: its input cast to float8 once (gathered with --sp)."""

    def __init__(self, sp: bool) -> None:
        self.sp = sp

    def _apply(self, module, mesh):
        group = mesh.get_group()

        def prepare(mod, inputs):
            x = inputs[0].to_local() if isinstance(inputs[0], DTensor) else inputs[0]  # --sp: the norm's shard
            if torch.is_autocast_enabled(x.device.type):
                x = x.to(torch.get_autocast_dtype(x.device.type))  # as the float8 linear would cast it
            return (CastInput.apply(x, group, self.sp), *inputs[1:])
        module.register_forward_pre_hook(prepare)
        return module


class Float8Colwise(ColwiseParallel):
    """torchao's ``Float8ColwiseParallel``: the weight split by columns; the input arrives in float8."""

    def _apply(self, module, mesh):
        module.tp_group = mesh.get_group()
        return distribute_module(module, mesh, self._partition_linear_fn,
                                 output_fn=lambda mod, y, mesh: GradToFloat8.apply(y, mod.tp_group))


class Float8Rowwise(RowwiseParallel):
    """torchao's ``Float8RowwiseParallel``: the weight split by rows; the input cast, the output summed."""

    def __init__(self, sp: bool) -> None:
        super().__init__()
        self.sp = sp

    def _apply(self, module, mesh):
        module.tp_group = mesh.get_group()
        return distribute_module(module, mesh, self._partition_linear_fn,
                                 lambda mod, inputs, mesh: (CastRowInput.apply(inputs[0], mod.tp_group),),
                                 lambda mod, y, mesh: ReduceOutput.apply(y, mod.tp_group, self.sp))


def block_plan(sp: bool) -> dict:
    """torchtitan's block plan for tensorwise float8: the float8 styles in place of DTensor's."""
    return {"attn": PrepareFloat8Input(sp), "mlp": PrepareFloat8Input(sp),
            **{f"attn.{p}_proj": Float8Colwise() for p in "qkv"}, "attn.o_proj": Float8Rowwise(sp),
            "mlp.gate_proj": Float8Colwise(), "mlp.up_proj": Float8Colwise(), "mlp.down_proj": Float8Rowwise(sp)}
# --8<-- [end:styles]
