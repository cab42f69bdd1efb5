"""The ledger's read model: live bytes by category over time, and the questions asked of them.

This module does not import torch. A :class:`Timeline` is what :class:`labkit.ledger.Ledger`
produces and what everything else reads: plots, notebooks, the rank reports of Labs 10 and 11
(a timeline travels between processes as ``to_dict()`` JSON), and the site.

A timeline has one row per ledger event (an allocation, a free, a resize). Row ``i`` holds the live
bytes of every category just after event ``i``, on the compute device (``device``) and on the host
(``host``), and, when the run was on CUDA, the allocator's own counters sampled at that event.
Phase spans say which rows happened inside which phase (``forward``, ``backward``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PARAMETERS = "parameters"
FROZEN_WEIGHTS = "frozen_weights"  # weights no gradient reaches: a LoRA's base, quantized or not (Lab 15)
QUANT_CONSTANTS = "quant_constants"  # what a quantized weight needs to be read back: absmax, scales (Lab 15)
GRADIENTS = "gradients"
OPTIMIZER_STATE = "optimizer_state"
KV_CACHE = "kv_cache"  # a serving engine's pool of keys and values (labelled by the lab that owns it)
ACTIVATIONS = "activations"
DEQUANTIZED = "dequantized"  # a quantized weight read back for one matmul, freed after it (Lab 15)
TEMPORARIES = "temporaries"
HOST_COPIES = "host_copies"
COMMUNICATION = "communication"
OTHER = "other"

#: Plot and table order: long-lived state first, short-lived last.
CATEGORIES = (PARAMETERS, FROZEN_WEIGHTS, QUANT_CONSTANTS, GRADIENTS, OPTIMIZER_STATE, KV_CACHE, ACTIVATIONS, DEQUANTIZED,
              TEMPORARIES, HOST_COPIES, COMMUNICATION, OTHER)

#: The phase names the labs use; any other name is allowed too.
PHASES = ("forward", "backward", "optimizer", "transfer")

_ROW_LISTS = ("index", "time_s", "phase", "step", "cuda_allocated", "cuda_reserved")


@dataclass
class PhaseSpan:
    name: str
    step: int | None
    start: int  # first row inside the phase
    end: int  # one past the last row inside the phase


@dataclass
class Timeline:
    """Rows of a ledger replayed with final categories: one row per allocation, free or resize."""

    categories: tuple[str, ...] = CATEGORIES
    index: list[int] = field(default_factory=list)
    time_s: list[float] = field(default_factory=list)
    phase: list[str | None] = field(default_factory=list)
    step: list[int | None] = field(default_factory=list)
    device: dict[str, list[int]] = field(default_factory=dict)
    host: dict[str, list[int]] = field(default_factory=dict)
    cuda_allocated: list[int] = field(default_factory=list)
    cuda_reserved: list[int] = field(default_factory=list)
    spans: list[PhaseSpan] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.index)

    # ------------------------------------------------------------------ rows
    def device_total(self) -> list[int]:
        return [sum(col[i] for col in self.device.values()) for i in range(len(self))]

    def host_total(self) -> list[int]:
        return [sum(col[i] for col in self.host.values()) for i in range(len(self))]

    def row(self, i: int, scope: str = "device") -> dict[str, int]:
        """Bytes by category after event ``i`` (``scope``: ``device`` or ``host``)."""
        columns = self.device if scope == "device" else self.host
        return {c: columns[c][i] for c in self.categories}

    def rows(self, lo: int, hi: int) -> Timeline:
        """Rows ``lo:hi`` as a timeline of their own, with the phases that lie inside them."""
        out = Timeline(categories=self.categories)
        for name in _ROW_LISTS:
            setattr(out, name, getattr(self, name)[lo:hi])
        out.device = {c: v[lo:hi] for c, v in self.device.items()}
        out.host = {c: v[lo:hi] for c, v in self.host.items()}
        out.spans = [PhaseSpan(s.name, s.step, s.start - lo, s.end - lo) for s in self.spans
                     if s.start >= lo and s.end <= hi]
        return out

    def window(self, *phases: str) -> Timeline:
        """The rows from the first span of any of ``phases`` to the end of the last one."""
        spans = [s for s in self.spans if s.name in phases]
        if not spans:
            raise ValueError(f"no phase named {', '.join(phases)} in this timeline")
        return self.rows(min(s.start for s in spans), max(s.end for s in spans))

    def step_window(self, step: int) -> Timeline:
        """The rows of every phase of one step."""
        spans = [s for s in self.spans if s.step == step]
        if not spans:
            raise ValueError(f"no phase of step {step} in this timeline")
        return self.rows(min(s.start for s in spans), max(s.end for s in spans))

    # ------------------------------------------------------------------ peaks
    def peak(self) -> dict[str, int]:
        """Device bytes by category at the highest moment, plus ``total``."""
        if not len(self):
            return {c: 0 for c in self.categories} | {"total": 0}
        total = self.device_total()
        i = max(range(len(total)), key=total.__getitem__)
        return self.row(i) | {"total": total[i]}

    def peaks_by_phase(self) -> dict[str, dict[str, int]]:
        """For each phase name: the device bytes by category at that phase's highest moment.

        Row ``i`` is the state after event ``i``, so a phase also sees the state it was entered in
        (the row before its first)."""
        total = self.device_total()
        best: dict[str, int] = {}
        for span in self.spans:
            for i in range(max(span.start - 1, 0), min(span.end, len(total))):
                if span.name not in best or total[i] > total[best[span.name]]:
                    best[span.name] = i
        return {name: self.row(i) for name, i in best.items()}

    def step_peaks(self) -> dict[int, dict[str, int]]:
        """For each step: device bytes by category at its highest row, plus ``total``."""
        total = self.device_total()
        best: dict[int, int] = {}
        for i, s in enumerate(self.step):
            if s is not None and (s not in best or total[i] > total[best[s]]):
                best[s] = i
        return {s: self.row(i) | {"total": total[i]} for s, i in best.items()}

    def at_end(self) -> dict[str, int]:
        """Device bytes by category on the last row."""
        return self.row(len(self) - 1) if len(self) else {c: 0 for c in self.categories}

    def first_seen(self, category: str) -> dict | None:
        """The phase and step in which ``category`` first held device bytes (None: never)."""
        for i, value in enumerate(self.device[category]):
            if value:
                return {"phase": self.phase[i], "step": self.step[i], "event": i}
        return None

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        return {
            "categories": list(self.categories),
            "index": self.index,
            "time_s": [round(t, 6) for t in self.time_s],
            "phase": self.phase,
            "step": self.step,
            "device": self.device,
            "host": self.host,
            "cuda_allocated": self.cuda_allocated,
            "cuda_reserved": self.cuda_reserved,
            "spans": [s.__dict__ for s in self.spans],
        }

    @classmethod
    def from_dict(cls, d: dict) -> Timeline:
        """The inverse of :meth:`to_dict` (a timeline another process wrote as JSON)."""
        tl = cls(categories=tuple(d["categories"]))
        for name in _ROW_LISTS:
            setattr(tl, name, list(d[name]))
        tl.device, tl.host = dict(d["device"]), dict(d["host"])
        tl.spans = [PhaseSpan(**s) for s in d["spans"]]
        return tl
