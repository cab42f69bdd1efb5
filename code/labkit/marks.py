"""Ambient marks: what a lesson says about itself, at no cost unless an instrument is watching.

A lab marks the moments that matter in its own words and passes nothing around::

    from labkit import marks

    with marks.phase("forward", step):
        loss = model(x, y)[1]

When nothing watches, ``marks.phase`` is an empty ``with`` block, as
``torch.profiler.record_function`` is when no profiler runs. When a :class:`labkit.ledger.Ledger`
is entered, it watches: the phase becomes a band in its timeline. A
:class:`labkit.schedule.Recorder` watches the same marks for a residency schedule. So an offload
engine or a training step never takes a ``ledger``, ``phase`` or ``recorder`` argument.

The marks:

* ``phase(name, step=None)``: a block of work (``forward``, ``backward``, ``optimizer``,
  ``transfer``, ``encode``, ...);
* ``category(name)``: storages allocated inside the block belong to ``name`` (a device buffer an
  offload engine fills with weights is ``parameters``);
* ``event(kind, unit, lane, nbytes, stream)``: a point of a residency schedule (a prefetch starts,
  a copy lands, a block computes, a block is evicted);
* ``stream(name)``: storages allocated inside the block are allocated on CUDA stream ``name`` (the
  code inside runs under ``torch.cuda.stream(s)`` on a GPU; a CPU has no streams, so the mark says
  which one); ``on_stream(tensors, name)`` says it of storages made already (an instrument that
  sees a collective's output after the op, as ``labkit.traffic`` does for FSDP2);
* ``record_stream(tensors, name)``: ``tensor.record_stream(s)``, explicit or done by a library
  (NCCL does it for every collective's tensors): once freed, the storage is not reused before the
  work queued on stream ``name`` has finished.

Lab 16 replays the ledger through a model of the CUDA caching allocator, which keeps one pool of
free blocks per stream: these two marks are what it needs to know, and all it needs to know.

Who is watching is process-wide, not a context variable: autograd runs backward on its own threads
on a GPU, and a mark made from a backward hook there must reach the ledger entered on the main
thread. Instruments add themselves with :func:`watch` when entered and leave with :func:`unwatch`.
"""

from __future__ import annotations

import contextlib
import threading

_watching: list = []
_lock = threading.Lock()
_NOTHING = contextlib.nullcontext()


def watch(instrument) -> None:
    """Start sending marks to ``instrument`` (a Ledger or Recorder calls this when entered)."""
    with _lock:
        _watching.append(instrument)


def unwatch(instrument) -> None:
    with _lock:
        if instrument in _watching:
            _watching.remove(instrument)


def watching() -> list:
    """The instruments that receive marks right now (a copy)."""
    with _lock:
        return list(_watching)


def phase(name: str, step: int | None = None):
    """A phase of the work, for every instrument that watches phases."""
    return _each("phase", name, step)


def category(name: str):
    """Storages allocated inside this block belong to category ``name``."""
    return _each("category", name)


def stream(name: str):
    """Storages allocated inside this block are allocated on CUDA stream ``name``."""
    return _each("stream", name)


def on_stream(tensors, name: str) -> None:
    """The storages of ``tensors`` (a tensor or any nest of them) were allocated on stream ``name``."""
    _tell("on_stream", tensors, name)


def record_stream(tensors, name: str) -> None:
    """The storages of ``tensors`` are used on stream ``name`` too (``tensor.record_stream``)."""
    _tell("record_stream", tensors, name)


def _tell(method: str, *args) -> None:
    for instrument in watching():
        call = getattr(instrument, method, None)
        if call is not None:
            call(*args)


def event(kind: str, unit: str, lane: str = "compute", nbytes: int = 0, stream=None) -> None:
    """A point of a residency schedule: ``kind`` happened to ``unit`` on ``lane`` (a stream)."""
    for instrument in watching():
        mark = getattr(instrument, "mark", None)
        if mark is not None:
            mark(kind, unit, lane, nbytes, stream)


def _each(method: str, *args):
    instruments = [i for i in watching() if hasattr(i, method)]
    return _Marked(instruments, method, args) if instruments else _NOTHING


class _Marked:
    """Enters ``method(*args)`` of each watching instrument, and leaves them in reverse order."""

    def __init__(self, instruments: list, method: str, args: tuple) -> None:
        self.instruments, self.method, self.args = instruments, method, args
        self.stack = contextlib.ExitStack()

    def __enter__(self):
        for instrument in self.instruments:
            self.stack.enter_context(getattr(instrument, self.method)(*self.args))
        return self

    def __exit__(self, *exc):
        return self.stack.__exit__(*exc)
