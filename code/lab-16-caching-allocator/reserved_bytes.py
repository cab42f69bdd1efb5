"""Lab 16 - what a trace cannot see, and a trace in reserved bytes: the part Lab 13's verdict uses.

The caching allocator holds more than tensors: cuBLAS takes its workspaces through it, and outside it
every CUDA process holds a context. Both are cited constants here, each with its source. ``simulate``
replays a ledger's events (``replay.py``) with the workspaces first; ``reserved`` turns a Lab 13 trace
into what a GPU must hold for it, the number Lab 13's verdict holds against the GPU's total.
"""

from __future__ import annotations

import replay
from allocator_blocks import DEFAULTS, MiB, Options
from replay import Events, Replay

# --8<-- [start:constants]
#: Held outside the caching allocator by every CUDA process: the context, measured by nvidia-smi with
#: PyTorch 2.10 and CUDA 13 (lazy module loading) at 426 MiB (unsloth-zoo PR #1053); "around 400MB"
#: for CUDA >= 11.7 (PyTorch issue #109888). Kernels loaded later, on first use, come on top.
CUDA_CONTEXT = 426 * MiB
CUDA_CONTEXT_SOURCE = ("426 MiB measured by nvidia-smi (PyTorch 2.10, CUDA 13): https://github.com/unslothai/"
                       "unsloth-zoo/pull/1053; 'around 400MB' with lazy loading: https://github.com/pytorch/pytorch/"
                       "issues/109888")
#: cuBLAS takes a workspace per handle and stream at its first matmul, through the caching allocator
#: (PyTorch PR #83461): CUBLAS_WORKSPACE_CONFIG's default :4096:2:16:8, 8,519,680 B, as a public snapshot
#: shows it (discuss.pytorch.org/t/178671). A training step has two handles: forward's thread and
#: autograd's backward thread (labkit.cuda.warm_up).
CUBLAS_WORKSPACE = 2 * 4096 * 1024 + 8 * 16 * 1024
CUBLAS_WORKSPACE_SOURCE = ("https://github.com/pytorch/pytorch/pull/83461 (through the caching allocator); "
                           "https://discuss.pytorch.org/t/178671 (8,519,680 B in a snapshot); "
                           "https://docs.pytorch.org/docs/2.13/notes/cuda.html#cublas-workspaces")
# --8<-- [end:constants]


# --8<-- [start:simulate]
def simulate(ev: Events, options: Options, capacity: int | None, workspaces: int = 0, repeat: int = 1) -> Replay:
    """The events through the model: the GPU's ``capacity`` less the CUDA context; first, cuBLAS's
    ``workspaces`` (one per handle: a training step has two), as its first matmuls take them."""
    return replay.replay(ev, options, capacity, outside=CUDA_CONTEXT if capacity else 0, repeat=repeat,
                         extra=[CUBLAS_WORKSPACE] * workspaces)
# --8<-- [end:simulate]


# --8<-- [start:verdict]
def reserved(trace, options: Options = DEFAULTS) -> dict:
    """A Lab 13 trace in reserved bytes, for its verdict: the step replayed twice (the second meets the
    cache the first left) with PyTorch's default allocator, plus what Lab 13 derives beside the trace
    (a KV cache, DDP's buckets), plus the CUDA context: what the GPU's total must hold."""
    train = trace.config.task == "train"
    r = simulate(replay.events_of(trace.ledger), options, None, workspaces=2 if train else 1, repeat=2 if train else 1)
    derived = trace.per_rank_peak_bytes - r.peak_traced  # Lab 13's derived additions (or removals, offload)
    return {"traced_bytes": r.peak_traced, "allocated_bytes": r.peak_allocated, "reserved_bytes": r.peak_reserved,
            "derived_bytes": derived, "cuda_context_bytes": CUDA_CONTEXT, "by_stream": r.by_stream,
            "need_bytes": r.peak_reserved + derived + CUDA_CONTEXT}
# --8<-- [end:verdict]
