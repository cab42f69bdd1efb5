"""Lab 13 - FSDP2's float8 all-gather (``--float8 tensorwise-all-gather``): each rank casts its shard of a float8
linear's weight to float8 before the all-gather, so the gathered weight is 1 byte per element and one scale.

FSDP2 lets a parameter's local shard choose what is all-gathered: a tensor subclass with two methods
(torch 2.13's ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``, ``all_gather_inputs`` and
``init_unsharded_param``):

    fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy) -> (inputs, metadata)
        what this rank sends, and what it keeps for after the gather
    fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None) -> (weight, inner tensors)
        the unsharded weight made of the gathered outputs (with ``out``: refilled in place, after the
        first step), and the tensors FSDP2 frees when it reshards

torchao's ``WeightWithDynamicFloat8CastTensor`` (``torchao/float8/fsdp_utils.py`` at commit 36027d8) uses them
so: the scale is the whole weight's (each shard's largest magnitude, all-reduced with MAX over the ranks), each
rank sends its shard's float8 bits, and the gathered weight is float8 bits with that scale, which the float8
linear multiplies as they are (no cast of the weight in forward or backward). Written here in plain PyTorch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from fit_float8 import E4M3, to_float8

aten = torch.ops.aten
#: ops whose results stay weights of the same kind: FSDP2's sharding of them, their views and in-place copies
KEEP = {aten.detach, aten.new_zeros, aten.split, aten.split_with_sizes, aten.slice, aten.view, aten.as_strided,
        aten.copy_, aten.alias}  # (not empty_like or zeros_like: the optimizer's state is plain tensors)


# --8<-- [start:gather]
class Float8GatherWeight(torch.Tensor):
    """A float8 linear's high-precision weight (its shard, under FSDP2) whose all-gather sends float8."""

    @staticmethod
    def __new__(cls, hp: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, hp.shape, strides=hp.stride(), storage_offset=hp.storage_offset(),
                                                   dtype=hp.dtype, device=hp.device, requires_grad=hp.requires_grad)

    def __init__(self, hp: torch.Tensor) -> None:
        self.hp = hp

    def __tensor_flatten__(self):
        return ["hp"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Float8GatherWeight(inner["hp"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs or {}))  # every op on the weight itself
        if func.overloadpacket in KEEP:
            return tree_map(lambda t: cls(t) if isinstance(t, torch.Tensor) else t, out)
        return out

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        amax = self.hp.abs().max().to(torch.float64)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())  # the whole weight's largest magnitude
        bits, inverse = to_float8(self.hp, E4M3, amax)  # this rank's shard, 1 byte each, with the whole weight's scale
        return (bits,), (inverse,)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (bits,), (inverse,) = outputs, metadata
        if out is not None:  # the same storage, gathered again: only the scale is new
            out.inverse.copy_(inverse)
            return None
        return Float8Weight(bits, inverse, param_dtype), (bits,)


class Float8Weight(torch.Tensor):
    """The gathered weight: float8 bits and their inverse scale, standing for a ``dtype`` weight of their shape."""

    @staticmethod
    def __new__(cls, bits: torch.Tensor, inverse: torch.Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, bits.shape, strides=bits.stride(), dtype=dtype,
                                                   device=bits.device, requires_grad=False)

    def __init__(self, bits: torch.Tensor, inverse: torch.Tensor, dtype: torch.dtype) -> None:
        self.bits, self.inverse = bits, inverse

    def __tensor_flatten__(self):
        return ["bits", "inverse"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return Float8Weight(inner["bits"], inner["inverse"], dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func.overloadpacket in (aten.detach, aten.as_strided, aten.view, aten.alias):  # FSDP2's view of it
            self = args[0]
            return cls(func(self.bits, *args[1:], **(kwargs or {})), self.inverse, self.dtype)
        raise NotImplementedError(f"a gathered float8 weight is read by Float8Matmul only, not by {func}")
# --8<-- [end:gather]


def _unwrap(t):
    return t.hp if isinstance(t, Float8GatherWeight) else t


def wrap_weights(model) -> int:
    """Each float8 linear's weight (``fit_float8.Float8Linear``) as a :class:`Float8GatherWeight`, before FSDP2
    shards it; returns how many."""
    from fit_float8 import Float8Linear
    linears = [m for m in model.modules() if isinstance(m, Float8Linear)]
    for m in linears:
        m.weight = torch.nn.Parameter(Float8GatherWeight(m.weight.detach()), requires_grad=m.weight.requires_grad)
    return len(linears)
