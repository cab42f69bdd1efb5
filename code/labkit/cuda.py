"""CUDA-only instruments: the allocator's memory-history snapshot and peak counters.

``record_snapshot(path)`` wraps a block in ``torch.cuda.memory._record_memory_history`` and
writes the pickle that https://pytorch.org/memory_viz opens. These are private PyTorch APIs (the
ones the "Understanding CUDA Memory Usage" page documents), so every call is guarded: on a CPU
run, or a torch without them, the block runs and no file is written.

``reset_peak`` starts a measurement window (after ``warm_up`` has made cuBLAS take its
workspaces); ``ledger_vs_allocator`` then holds the ledger's peak against
``torch.cuda.max_memory_allocated`` over that window, leaving out what the allocator held unseen
by the ledger when the window began.
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


_warmed: set[torch.device] = set()


def warm_up(device: torch.device) -> int:
    """CUDA: one tiny forward and backward, once per device; then the bytes allocated. 0 on CPU.

    PyTorch gives each cuBLAS (and cuBLASLt) handle and stream a workspace the first time it runs a
    matmul, and keeps it (https://docs.pytorch.org/docs/2.13/notes/cuda.html#cublas-workspaces). A
    workspace is no tensor, so the ledger cannot see it; backward runs on autograd's own thread,
    with its own handle. Taken here, before a measurement starts, the workspaces are part of what
    the allocator held when the window began, which the comparisons with the ledger set aside.

    A :class:`labkit.ledger.Ledger` calls it when first entered (before it records anything) and
    :func:`reset_peak` when a measurement window opens; so these tensors are never in a
    measurement. Choosing a device, or joining a process group, launches nothing.
    """
    if device.type != "cuda":
        return 0
    if device not in _warmed:
        with torch.enable_grad():  # a caller inside no_grad still needs the backward handle warmed
            layer = torch.nn.Linear(64, 64, device=device)  # addmm with a bias: the cuBLASLt path
            x = torch.randn(8, 64, device=device, requires_grad=True)
            (layer(x) @ x.T).sum().backward()  # a plain matmul too, and both again in backward
        del layer, x
        _warmed.add(device)
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def reset_peak(device: torch.device) -> None:
    """Start a measurement window: cuBLAS workspaces taken (once per device), the allocator's peak
    reset. Nothing on CPU."""
    if device.type == "cuda":
        warm_up(device)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def allocator_stats(device: torch.device) -> dict[str, int] | None:
    """``max_memory_allocated`` and friends for a CUDA device; None on CPU. ``max_requested_bytes``
    (``memory_stats()["requested_bytes.all.peak"]``) is the peak of what tensors asked for, before the
    allocator's 512-byte rounding: the ledger rounds as the allocator does, so its twin is
    ``max_memory_allocated``, and the gap between the two counters is the rounding."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return {
        "memory_allocated": torch.cuda.memory_allocated(device),
        "max_memory_allocated": torch.cuda.max_memory_allocated(device),
        "memory_reserved": torch.cuda.memory_reserved(device),
        "max_memory_reserved": torch.cuda.max_memory_reserved(device),
        # what the tensors asked for, before the allocator rounded each request up to 512 bytes
        "max_requested_bytes": torch.cuda.memory_stats(device).get("requested_bytes.all.peak"),
    }


def ledger_vs_allocator(timeline, stats: dict | None, start: int = 0, hidden: int = 0) -> dict | None:
    """The ledger's peak against the allocator's over the same window: timeline rows ``start:``.

    ``stats`` are :func:`allocator_stats` read after the window, with the allocator's peak reset
    (:func:`reset_peak`) just before it. The allocator also holds bytes the ledger never sees:
    memory a library allocates inside a call and keeps, such as the workspace cuBLAS takes for each
    handle and stream at its first matmul (several MiB; up to 32 MiB on Hopper). What it held
    beyond the ledger when the window began (``cuda_allocated`` minus the ledger's device bytes on
    the row before ``start``, or on row 0) is set aside; ``hidden`` is memory a backend allocates
    inside the window and the ledger cannot see (a collective's copies, say). None on CPU.
    """
    if stats is None or not timeline.cuda_allocated:
        return None
    before = max(start - 1, 0)
    unseen = timeline.cuda_allocated[before] - sum(col[before] for col in timeline.device.values())
    peak = max(timeline.device_total()[start:])
    allocator = max(stats["max_memory_allocated"] - unseen, 1)
    return stats | {"ledger_peak": peak, "unseen_before_window": unseen, "hidden_in_backend": hidden,
                    "ledger_over_allocator": peak / allocator,
                    "ledger_and_hidden_over_allocator": (peak + hidden) / allocator}
