"""CUDA-only instruments: the allocator's memory-history snapshot and peak counters.

``record_snapshot(path)`` wraps a block in ``torch.cuda.memory._record_memory_history`` and
writes the pickle that https://pytorch.org/memory_viz opens. These are private PyTorch APIs (the
ones the "Understanding CUDA Memory Usage" page documents), so every call is guarded: on a CPU
run, or a torch without them, the block runs and no file is written.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch


def snapshot_supported() -> bool:
    mem = getattr(torch.cuda, "memory", None)
    return (
        torch.cuda.is_available()
        and mem is not None
        and hasattr(mem, "_record_memory_history")
        and hasattr(mem, "_dump_snapshot")
    )


@contextlib.contextmanager
def record_snapshot(path: str | os.PathLike | None, max_entries: int = 20_000) -> Iterator[Path | None]:
    """Record allocator history inside the block and dump it to ``path`` (CUDA only).

    Only Python frames are kept with each event (``stacks="python"``): C++ frames make the pickle
    several times larger and are symbolized when it is dumped, which can take minutes. The history
    keeps the last ``max_entries`` events, enough for a few training steps of the labs' models and
    small enough for a file readers download and drop on memory_viz.
    """
    if path is None or not snapshot_supported():
        yield None
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        yield path
    finally:
        try:
            torch.cuda.memory._dump_snapshot(str(path))
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def allocator_stats(device: torch.device) -> dict[str, int] | None:
    """``max_memory_allocated`` and friends for a CUDA device; None on CPU."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return {
        "memory_allocated": torch.cuda.memory_allocated(device),
        "max_memory_allocated": torch.cuda.max_memory_allocated(device),
        "memory_reserved": torch.cuda.memory_reserved(device),
        "max_memory_reserved": torch.cuda.max_memory_reserved(device),
    }
