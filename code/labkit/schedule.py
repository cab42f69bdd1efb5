"""Residency schedules: a recorder of transfer and compute events, per stream.

An offload engine marks each moment that matters with ``labkit.marks.event(kind, unit, lane)``: a
prefetch starts, its copy is ready, a block's compute starts and ends, a block is evicted. Those
marks cost nothing unless a :class:`Recorder` is entered (``with Recorder(device) as rec:``); then
each one becomes a :class:`Mark`, filed under the *stage* it happened in: the outermost
``marks.phase`` open at the time (``encode``, ``denoise``, ``decode``). On CUDA
every mark also records a ``torch.cuda.Event`` on the stream where the work is queued, so the
times are *GPU* times (when the stream reached that point), read back once at the end with no
synchronisation in between. On CPU the times are host clock times.

From the marks: ``intervals()`` pairs them into bars (``transfer`` and ``compute``) for a Gantt
chart of the compute stream against the copy stream (:func:`labkit.plot.plot_gantt`),
``stage_summary()`` gives per pipeline stage the bytes moved and the time spent moving them, and
``stage_ms(name)`` the time spent inside a stage (the recorder marks where each outermost phase
begins and ends, on the compute stream), so the code it watches needs no clock of its own.

:class:`Copies` counts from outside what the marks only claim: the bytes copied out of and into
given host buffers (an offload engine's host masters) while it is entered.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from labkit import marks

PAIRS = {"prefetch_start": "ready", "transfer_start": "transfer_end", "compute_start": "compute_end"}
BAR_KIND = {"prefetch_start": "transfer", "transfer_start": "transfer", "compute_start": "compute"}


@dataclass
class Mark:
    kind: str  # prefetch_start | ready | transfer_start | transfer_end | compute_start | compute_end | evict
    #            | stage_start | stage_end (the recorder's own: an outermost phase begins or ends)
    unit: str  # what moved or ran: "denoiser.blocks.3", "text_encoder", ...
    lane: str  # "compute" or "copy": the stream the work was queued on
    nbytes: int
    stage: str | None
    host_s: float
    event: object | None = None  # a torch.cuda.Event on CUDA
    t_ms: float | None = None  # filled by finish()


@dataclass
class Bar:
    kind: str  # "transfer" or "compute"
    unit: str
    lane: str
    stage: str | None
    start_ms: float
    end_ms: float
    nbytes: int

    @property
    def ms(self) -> float:
        return self.end_ms - self.start_ms


class Recorder:
    """Collects the schedule marks made while it is entered; then read bars and summaries."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.marks: list[Mark] = []
        self._phases: list[str] = []
        self._t0 = time.perf_counter()
        self._origin = None
        if self.cuda:
            self._origin = torch.cuda.Event(enable_timing=True)
            self._origin.record(torch.cuda.current_stream(self.device))

    def __enter__(self) -> Recorder:
        marks.watch(self)
        return self

    def __exit__(self, *exc) -> None:
        marks.unwatch(self)
        self.finish()

    @contextlib.contextmanager
    def phase(self, name: str, step: int | None = None) -> Iterator[None]:
        """``marks.phase`` while entered: the outermost open phase names the stage."""
        outermost = not self._phases
        self._phases.append(name)
        if outermost:
            self.mark("stage_start", name)
        try:
            yield
        finally:
            if outermost:
                self.mark("stage_end", name)
            self._phases.pop()

    def mark(self, kind: str, unit: str, lane: str = "compute", nbytes: int = 0, stream=None) -> None:
        """``marks.event`` while entered."""
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        stage = self._phases[0] if self._phases else None
        self.marks.append(Mark(kind, unit, lane, int(nbytes), stage, time.perf_counter(), event))

    def finish(self) -> Recorder:
        """Resolve every mark to milliseconds since the recorder started (one sync on CUDA)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        for m in self.marks:
            if m.t_ms is None:
                m.t_ms = self._origin.elapsed_time(m.event) if m.event is not None else (m.host_s - self._t0) * 1e3
        return self

    def stage_ms(self, name: str) -> float:
        """Milliseconds spent inside stage ``name``: the sum of its spans (one per ``marks.phase``
        block, e.g. one per denoising step). On CUDA, GPU time on the compute stream."""
        return sum(self.stage_spans(name))

    def stage_spans(self, name: str) -> list[float]:
        """Milliseconds of each span of stage ``name``, in order (one per denoising step, say)."""
        if any(m.t_ms is None for m in self.marks):
            self.finish()
        starts = [m.t_ms for m in self.marks if m.kind == "stage_start" and m.unit == name]
        ends = [m.t_ms for m in self.marks if m.kind == "stage_end" and m.unit == name]
        return [end - start for start, end in zip(starts, ends)]

    def intervals(self) -> list[Bar]:
        """Pair start and end marks of the same unit and lane into bars, in start order."""
        if any(m.t_ms is None for m in self.marks):
            self.finish()
        open_: dict[tuple[str, str, str], Mark] = {}
        bars: list[Bar] = []
        for m in self.marks:
            if m.kind in PAIRS:
                open_[(PAIRS[m.kind], m.unit, m.lane)] = m
            elif (m.kind, m.unit, m.lane) in open_:
                start = open_.pop((m.kind, m.unit, m.lane))
                bars.append(Bar(BAR_KIND[start.kind], m.unit, m.lane, start.stage, start.t_ms, m.t_ms,
                                start.nbytes))
        return sorted(bars, key=lambda b: b.start_ms)

    def stage_summary(self) -> dict[str, dict[str, float]]:
        """Per stage: bytes transferred, transfer and compute time, the stage's wall span (ms)."""
        out: dict[str, dict[str, float]] = {}
        for bar in self.intervals():
            s = out.setdefault(bar.stage or "-", {"h2d_bytes": 0, "transfer_ms": 0.0, "compute_ms": 0.0,
                                                  "start_ms": bar.start_ms, "end_ms": bar.end_ms})
            if bar.kind == "transfer":
                s["h2d_bytes"] += bar.nbytes
                s["transfer_ms"] += bar.ms
            else:
                s["compute_ms"] += bar.ms
            s["start_ms"] = min(s["start_ms"], bar.start_ms)
            s["end_ms"] = max(s["end_ms"], bar.end_ms)
        return out

    def bar_ms(self, kind: str | None = None, lane: str | None = None) -> float:
        """Total milliseconds of the bars of ``kind`` (transfer, compute) on ``lane`` (copy, compute)."""
        return sum(b.ms for b in self.intervals() if kind in (None, b.kind) and lane in (None, b.lane))

    def overlap_ms(self) -> float:
        """Time during which a copy-lane transfer and a compute-lane bar ran at once."""
        bars = self.intervals()
        copies = [b for b in bars if b.lane == "copy"]
        computes = [b for b in bars if b.lane == "compute" and b.kind == "compute"]
        total = 0.0
        for c in copies:
            for k in computes:
                total += max(0.0, min(c.end_ms, k.end_ms) - max(c.start_ms, k.start_ms))
        return total

    def residency(self, group=lambda unit: unit) -> dict[str, dict]:
        """Per stage: the units that were on the device, in order, and the most at once per group.

        A unit becomes resident at its ``prefetch_start``/``transfer_start`` mark and stops being
        resident at its ``evict`` mark; units resident when a stage begins count for that stage.
        ``group(unit)`` names the group a unit is counted in (e.g. all denoiser blocks together).
        """
        live: dict[str, None] = {}  # insertion-ordered set
        out: dict[str, dict] = {}

        def count(stage: dict) -> None:
            stage["seen"] += [u for u in live if u not in stage["seen"]]
            counts: dict[str, int] = {}
            for u in live:
                counts[group(u)] = counts.get(group(u), 0) + 1
            for g, c in counts.items():
                stage["most_at_once"][g] = max(stage["most_at_once"].get(g, 0), c)

        for m in self.marks:
            if (m.stage or "-") not in out:
                out[m.stage or "-"] = {"seen": [], "most_at_once": {}}
                count(out[m.stage or "-"])  # what was resident as the stage began
            if m.kind in ("prefetch_start", "transfer_start"):
                live[m.unit] = None
            elif m.kind == "evict":
                live.pop(m.unit, None)
            count(out[m.stage or "-"])
        return out


class Copies(TorchDispatchMode):
    """Bytes copied out of (``out_of``: host to device) and into (``into``: device to host) the
    storages of ``buffers`` while entered, whatever code made the copies (every ``copy_`` is seen).
    A dispatch mode costs time on every op: count in a run that is not timed."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        super().__init__()
        self.host = {_where(b) for b in buffers}
        self.out_of = self.into = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            self.out_of += src.nbytes if _where(src) in self.host else 0
            self.into += dst.nbytes if _where(dst) in self.host else 0
        return func(*args, **(kwargs or {}))


def _where(t: torch.Tensor):
    """A storage's address; a fake storage (labkit.fake) has none, so its identity."""
    st = t.untyped_storage()
    return ("fake", st._cdata) if st.device.type == "meta" else st.data_ptr()
