"""Lab 11's bench for torchrun: see the communication, gather what each rank measured.

This is instrument, not lesson (the lessons are ``zero_fsdp.py`` and ``fsdp_inference.py``).
Joining the process group and speaking with one voice (``start``, ``ranked``) are in
``labkit.dist``, shared with Lab 10.

* ``Traffic`` is a dispatch mode entered inside the memory ledger. Collectives (``c10d::``) and
  FSDP2's copy-in/copy-out ops (``fsdp::``) pass through PyTorch's dispatcher like any other op, so
  it can count their bytes and label the buffers they fill as ``communication``.
* ``gather`` collects one object from every rank (``all_gather_object``): rank 0 prints for all.
"""

from __future__ import annotations

import warnings
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from labkit.ledger import PhaseSpan, Timeline

# DTensor's sharding propagation runs each op it has not seen before once on fake tensors (no data).
# labkit's ledger registers those and reads their data pointer, which warns. They only appear the
# first time an op is seen (step 0 of a sharded run), and this lab reads the last step and the end.
warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")


def gather(obj) -> list:
    """``obj`` from every rank, in rank order (a collective: every rank must call it)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# --8<-- [start:traffic]
def _nbytes(x) -> int:
    flat, _ = tree_flatten(x)
    return sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))


#: which argument of a collective is a buffer that exists only to be communicated
BUFFER_ARG = {"_allgather_base_": 0, "allreduce_": 0, "_reduce_scatter_base_": 1}


class Traffic(TorchDispatchMode):
    """Counts every collective's bytes and labels the buffers it fills as ``communication``."""

    def __init__(self, ledger) -> None:
        super().__init__()
        self.ledger = ledger
        self.ops: dict[str, dict[str, int]] = defaultdict(
            lambda: {"calls": 0, "out_bytes": 0, "in_bytes": 0, "largest_in_bytes": 0})
        self.h2d_bytes = 0  # host-to-device copies (CPU offload on a GPU)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs local ops; those come back through here
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.namespace == "c10d":  # a collective; its output is argument 0, its input argument 1
            row = self.ops[name]
            row["calls"] += 1
            row["out_bytes"] += _nbytes(args[0])
            sent = _nbytes(args[1]) if len(args) > 1 and isinstance(args[1], torch.Tensor) else 0
            row["in_bytes"], row["largest_in_bytes"] = row["in_bytes"] + sent, max(row["largest_in_bytes"], sent)
            if name in BUFFER_ARG:
                self.ledger.track(args[BUFFER_ARG[name]], "communication")  # (1)!
        elif func.namespace == "fsdp":  # FSDP2's copy-in / copy-out around its collectives
            self.ledger.track((out, kwargs.get("out")), "communication")  # (2)!
        elif name in ("_to_copy", "copy_") and self._host_to_device(name, args, out):
            self.h2d_bytes += _nbytes(out if name == "_to_copy" else args[0])
        return out

    @staticmethod
    def _host_to_device(name, args, out) -> bool:
        src, dst = (args[0], out) if name == "_to_copy" else (args[1], args[0])
        return (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)
                and src.device.type == "cpu" and dst.device.type != "cpu")

    def summary(self) -> dict:
        return {"collectives": {k: dict(v) for k, v in sorted(self.ops.items())}, "h2d_bytes": self.h2d_bytes}
# --8<-- [end:traffic]


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of a tensor this rank holds: a DTensor's local shard, or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def cut(tl: Timeline, lo: int, hi: int) -> Timeline:
    """Rows ``lo:hi`` of a timeline (e.g. one training step), phases shifted to match."""
    out = Timeline(categories=tl.categories)
    for name in ("index", "time_s", "phase", "step", "cuda_allocated", "cuda_reserved"):
        setattr(out, name, getattr(tl, name)[lo:hi])
    out.device = {c: v[lo:hi] for c, v in tl.device.items()}
    out.host = {c: v[lo:hi] for c, v in tl.host.items()}
    out.spans = [PhaseSpan(s.name, s.step, s.start - lo, s.end - lo) for s in tl.spans if s.start >= lo and s.end <= hi]
    return out


def timeline_from_dict(d: dict) -> Timeline:
    """Undo ``Timeline.to_dict()`` (a rank's timeline travels to the notebook as JSON)."""
    tl = Timeline(categories=tuple(d["categories"]))
    for name in ("index", "time_s", "phase", "step", "device", "host", "cuda_allocated", "cuda_reserved"):
        setattr(tl, name, d[name])
    tl.spans = [PhaseSpan(**s) for s in d["spans"]]
    return tl
