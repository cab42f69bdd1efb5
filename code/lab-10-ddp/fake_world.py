"""One rank of an N-rank data-parallel job, in this process: PyTorch's fake process group.

Harness, not lesson (Labs 10 and 11 use it: ``labs.load(10, "fake_world")``). Under torchrun every
rank is a process and its collectives move bytes. To ask what ONE rank of 8 or 64 holds, only that
rank has to run: PyTorch's *fake* process group (``torch.testing._internal.distributed.fake_pg``,
the one torchtitan's memory estimator uses) answers every collective at once and moves nothing.
The buffers a collective needs (DDP's buckets, FSDP's all-gather and reduce-scatter buffers) are
still allocated, through the dispatcher, so the memory ledger counts them as in a real job; with
fake tensors (:mod:`labkit.fake`) the model can be any size.

Three things DDP does at that boundary need help, and :func:`fake_world` gives it, nothing more:

* DDP's built-in all-reduce takes its result from the collective's ``Work``; the fake group's work
  carries none. Here the work of ``c10d.allreduce_`` carries its own buffers as the result: the
  all-reduce is in place, so the bucket IS the result (what a real backend returns too).
* After the first backward DDP rebuilds its buckets and agrees on their layout with the other
  ranks: it writes the bucket indices into an ``int32`` tensor through a raw pointer and broadcasts
  it. A fake tensor has no pointer, so ``int32`` ``empty`` tensors are made real (a few bytes each;
  the model makes none), and every op on such tensors alone (their copies, their broadcast) runs
  outside the fake mode, which would otherwise turn them into fake tensors, new storages a real
  run does not allocate.
* At construction DDP checks, by an all-gather whose values it reads, that every rank has the same
  parameter shapes. Under the fake group there are no other ranks and nothing is gathered: the
  check (``torch.nn.parallel.distributed._verify_param_shape_across_processes``) is skipped.

The ledger misses what a backend allocates outside the dispatcher (NCCL's own buffers and
channels, gloo's staging copies), in a real job as here.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from unittest import mock

import torch
import torch.nn.parallel.distributed as ddp_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from labkit import dist as dist_kit
from labkit import fake
from labkit.config import MAX_RANKS, UsageError, option


@dataclasses.dataclass
class OneRankOfMany(dist_kit.Ranks):
    """Mix into a torchrun lab's ``Config`` (Labs 10 and 11): ``--world-size N`` plays rank 0 of an
    N-rank job in this process, under :func:`fake_world`, instead of starting ranks."""

    world_size: int | None = option(None, "run ONE rank (rank 0) of a job of this many ranks, in this process, under "
                                          "PyTorch's fake process group (collectives move no data; no torchrun)",
                                          min=1, max=MAX_RANKS)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.world_size is not None and self.nproc_per_node is not None:
            raise UsageError("--world-size plays one rank in this process; --nproc-per-node starts ranks: give one")
        if getattr(self, "fake", False) and self.world_size is None:
            raise UsageError("--fake traces one rank in this process: give --world-size N, the ranks of the job")

    def starts_ranks(self) -> bool:
        return super().starts_ranks() and self.world_size is None  # --world-size: one rank, here

class _DDPAtTheBoundary(TorchDispatchMode):
    """DDP's two reads of values at the fake group's boundary (see the module docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        new_index = func is torch.ops.aten.empty.memory_format and kwargs.get("dtype") == torch.int32
        on_index = tensors and all(t.dtype == torch.int32 and not fake.is_fake(t) for t in tensors)
        if new_index or on_index:
            with fake.outside():  # DDP's bucket indices, and what it does with them, stay real
                out = func(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        if func is torch.ops.c10d.allreduce_.default:
            tensors, _ = out
            done = torch.futures.Future()
            done.set_result(tensors)
            return tensors, torch._C._distributed_c10d._create_work_from_future(done).boxed()
        return out


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """This process is rank ``rank`` of ``world_size`` for the block, under the fake process group.

    ``world_size``: the ranks of the job being traced (only this one runs); ``rank``: which one this
    is. Collectives return at once and move no data; the block leaves the group at its end. Enter it
    outside a :class:`labkit.ledger.Ledger`: its dispatch mode must sit below the ledger's.
    """
    with dist_kit.fake_group(world_size, rank=rank), \
            mock.patch.object(ddp_module, "_verify_param_shape_across_processes", lambda *a, **k: None), \
            _DDPAtTheBoundary():
        yield
