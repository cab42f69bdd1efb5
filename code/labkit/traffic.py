"""Traffic: the bytes every collective moves, and the buffers that exist only to be communicated.

Instrument, not lesson. The code it measures (DDP, ``ZeroRedundancyOptimizer``, FSDP2) runs as
it is and passes nothing to it; it watches from outside::

    with Ledger(device) as ledger, Traffic() as traffic:
        train()
    traffic.summary()["collectives"]["_allgather_base_"]["out_bytes"]

How it sees them: collectives go through PyTorch's dispatcher as ops in the ``c10d`` namespace,
and FSDP2's copy-in and copy-out around its all-gather as ops in the ``fsdp`` namespace, so a
``TorchDispatchMode`` meets every one of them. Per collective it counts calls, output bytes and
input bytes; it also counts host-to-device copies (a GPU run with shards offloaded to the host).

The buffers a collective fills only to communicate (the all-gather's output, the all-reduce's
bucket, the reduce-scatter's input, what FSDP2's copy-in and copy-out write) are labelled
``communication`` in every :class:`labkit.ledger.Ledger` that is watching (:mod:`labkit.marks`),
so enter ``Traffic`` inside the ledger. Not labelled: a reduce-scatter's output (it becomes the
sharded gradient) and a broadcast's buffer (``ZeroRedundancyOptimizer`` broadcasts into the
parameters themselves).

Streams, for Lab 16's model of the caching allocator (:func:`labkit.marks.on_stream`): on a GPU,
FSDP2 allocates each all-gather's output inside ``torch.cuda.stream(all_gather_copy_in_stream)`` in
forward and pre-backward (``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``
``foreach_all_gather``, with ``_fsdp_param_group.py`` ``get_all_gather_streams``) and each
reduce-scatter's output, which becomes the sharded gradient, inside
``torch.cuda.stream(reduce_scatter_stream)`` (``foreach_reduce``): those storages are marked as on
the streams ``fsdp_all_gather`` and ``fsdp_reduce_scatter``. And NCCL records every collective's
tensors on its own stream (``record_stream``; ``ProcessGroupNCCL.hpp``: unless
``TORCH_NCCL_AVOID_RECORD_STREAMS`` is set): marked as used on ``nccl``.

Not seen: what a backend allocates on its own, outside the dispatcher (gloo's copies, NCCL's
buffers).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from labkit import marks
from labkit.ledger import dtensor_type


#: which argument of a collective is a buffer that exists only to be communicated
BUFFER_ARG = {"_allgather_base_": 0, "allreduce_": 0, "_reduce_scatter_base_": 1}
COMMUNICATION = "communication"
ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM, NCCL_STREAM = "fsdp_all_gather", "fsdp_reduce_scatter", "nccl"


def nbytes(tensors) -> int:
    """Bytes of every tensor in ``tensors`` (a tensor or any nest of them)."""
    flat, _ = tree_flatten(tensors)
    return sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))


# --8<-- [start:traffic]
class Traffic(TorchDispatchMode):
    """Counts every collective's bytes and labels the buffers it fills as ``communication``."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, dict[str, int]] = defaultdict(
            lambda: {"calls": 0, "out_bytes": 0, "in_bytes": 0, "largest_in_bytes": 0})
        self.h2d_bytes = 0  # host-to-device copies (CPU offload on a GPU)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        dtensor = dtensor_type()  # the ledger's: DTensor once something imported it
        if dtensor is not None and any(issubclass(t, dtensor) for t in types):
            return NotImplemented  # DTensor runs local ops; those come back through here
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.namespace == "c10d":  # a collective; its output is argument 0, its input argument 1
            row = self.ops[name]
            row["calls"] += 1
            row["out_bytes"] += nbytes(args[0])
            sent = nbytes(args[1]) if len(args) > 1 and isinstance(args[1], torch.Tensor) else 0
            row["in_bytes"], row["largest_in_bytes"] = row["in_bytes"] + sent, max(row["largest_in_bytes"], sent)
            if name in BUFFER_ARG:
                label(args[BUFFER_ARG[name]])  # (1)!
            if name == "_reduce_scatter_base_":
                marks.on_stream(args[0], REDUCE_SCATTER_STREAM)
            marks.record_stream(args[:2], NCCL_STREAM)
        elif func.namespace == "fsdp":  # FSDP2's copy-in / copy-out around its collectives
            label((out, kwargs.get("out")))  # (2)!
            if name == "all_gather_copy_in":
                marks.on_stream(out, ALL_GATHER_STREAM)
        elif name in ("_to_copy", "copy_") and _host_to_device(name, args, out):
            self.h2d_bytes += nbytes(out if name == "_to_copy" else args[0])
        return out

    def summary(self) -> dict:
        return {"collectives": {k: dict(v) for k, v in sorted(self.ops.items())}, "h2d_bytes": self.h2d_bytes}

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # under torch.compile: off while it compiles, on for the compiled code (as Ledger)


def label(tensors) -> None:
    """``tensors`` are communication buffers, for every ledger that is watching."""
    for instrument in marks.watching():
        track = getattr(instrument, "track", None)
        if track is not None:
            track(tensors, COMMUNICATION)
# --8<-- [end:traffic]


def _host_to_device(name: str, args, out) -> bool:
    src, dst = (args[0], out) if name == "_to_copy" else (args[1], args[0])
    return (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)
            and src.device.type == "cpu" and dst.device.type != "cpu")
