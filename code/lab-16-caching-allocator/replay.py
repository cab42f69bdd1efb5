"""Lab 16 - a memory ledger replayed through the allocator model: reserved bytes, from a trace.

The ledger (``labkit.ledger.Ledger``) recorded every storage's birth and death on the device, its
size as the CUDA allocator rounds it, the stream it was allocated on and the other streams that
used it (``labkit.marks``). That is all a caching allocator sees, so replaying those events in order
through ``allocator_model.CachingAllocator`` gives the reserved bytes the run would have had, from
a real run or a trace on fake tensors alike.

    replay(ledger, options, ...)   the events, in order; ``repeat`` runs the step again on a warm cache
    export(ledger) / load(path)    a ledger as a JSON file (``--ledger``), and back

What a replay assumes, said once: the storages that existed before the first phase (weights,
optimizer state) are allocated first, one by one, in the order the ledger saw them, into an empty
cache; a storage resized in place (FSDP2's ``resize_``) gets a new block of the new size before the
old one goes, as CUDA's ``resize_`` copies; a block used on another stream is free again at the next
``malloc`` (the GPU has caught up: ``sync="malloc"``), at the next phase boundary (``sync="phase"``),
or only when the allocator synchronizes, before it gives up (``sync="never"``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from labkit.config import UsageError
from allocator_model import DEFAULTS, CachingAllocator, Options, OutOfMemory

FORMAT = "infralab-ledger/1"
DEFAULT = "default"  # the stream a storage without a stream mark was allocated on


@dataclass
class Storage:
    nbytes: int
    stream: str = DEFAULT
    uses: tuple = ()
    category: str = "other"


@dataclass
class Events:
    """What a replay needs from a ledger: device storages and the alloc/free/resize events."""

    storages: dict[int, Storage]
    events: list[tuple]  # ("alloc", sid, nbytes) | ("free", sid) | ("resize", sid, old, new)
    boundaries: set[int] = field(default_factory=set)  # event indices where a phase starts or ends
    first_phase: int = 0  # index of the first event inside a phase: the step starts there
    initial: list[int] = field(default_factory=list)  # storages registered before any event


def events_of(ledger) -> Events:
    """The device storages of ``ledger`` (a ``labkit.ledger.Ledger``) and their events."""
    n = len(ledger.events) if ledger._active_until is None else ledger._active_until
    storages = {r.sid: Storage(r.nbytes, r.stream or DEFAULT, tuple(sorted(r.uses)), ledger.category_of(r))
                for r in ledger.records if ledger.scope_of(r) == "device"}
    events, kept = [], []  # kept[i]: device events before the ledger's event i
    for e in ledger.events[:n]:
        kept.append(len(events))
        if e[1] in storages:
            events.append(e)
    kept.append(len(events))
    boundaries = {kept[min(at, n)] for *_, at in ledger._phase_marks}  # phase marks count all events
    return Events(storages, events, boundaries, min(boundaries, default=0),
                  [sid for sid in ledger._initial if sid in storages])


# --8<-- [start:replay]
@dataclass
class Replay:
    """What the model did with a ledger's events."""

    options: Options
    allocated: list[int]  # the allocator's allocated bytes after each event
    reserved: list[int]  # reserved bytes after each event
    traced: list[int]  # the ledger's live bytes after each event (what the tensors asked for, rounded)
    peak_reserved: int
    peak_allocated: int
    peak_traced: int
    by_stream: dict[str, int]  # reserved bytes per stream's pool at the end
    retries: int
    oom: OutOfMemory | None  # the error a real run would have raised, and where
    oom_at: int | None
    allocator: CachingAllocator  # its state at the end (or where it ran out of memory)
    labels: dict = field(default_factory=dict)  # id(live block) -> the category of its storage

    def segments(self) -> list[list[tuple[int, str | None]]]:
        """The segments now, block by block: ``(bytes, category)`` of a live tensor's block, ``(bytes,
        "waiting")`` of one freed but used on another stream, ``(bytes, None)`` of a cached one
        (``labkit.plot.plot_segments`` draws them)."""
        return [[(b.size, self.labels.get(id(b), "other") if b.allocated else "waiting" if b.event_count else None)
                 for b in run] for run in self.allocator.blocks()]


def replay(ev: Events, options: Options = DEFAULTS, capacity: int | None = None, outside: int = 0,
           repeat: int = 1, sync: str = "malloc", until: int | None = None, extra: list[int] = ()) -> Replay:
    """Replay ``ev`` through a fresh allocator; ``repeat`` runs the step (from the first phase on)
    that many times, its storages new each time; ``until``: stop after that many events; ``extra``:
    blocks a library takes first and keeps (cuBLAS's workspaces), on the default stream."""
    a = CachingAllocator(options, capacity, outside)
    live: dict = {}
    allocated, reserved, traced, now = [], [], [], [0]

    def alloc(key, sid, nbytes):
        s = ev.storages[sid]
        if sync == "malloc":
            a.complete_events()  # (1)!
        live[key] = (a.malloc(nbytes, s.stream), nbytes)
        now[0] += nbytes

    def release(block, nbytes, sid):
        for stream in ev.storages[sid].uses:
            a.record_stream(block, stream)  # L2299: its other-stream uses wait for their events
        a.free(block)
        now[0] -= nbytes

    def step(events, start: int, rep: int) -> None:
        """The events in order; a step's own storages get keys of their own in every repeat."""
        for i, e in enumerate(events):
            if until is not None and len(allocated) >= until:
                return
            if sync == "phase" and start + i in ev.boundaries:
                a.complete_events()
            kind, sid = e[0], e[1]
            key = (sid, rep if born.get(sid, -1) >= ev.first_phase else 0)  # (2)!
            if kind == "alloc":
                alloc(key, sid, e[2])
            elif kind == "resize" and e[3] > 0:  # (3)!
                old = live.pop(key, None)
                alloc(key, sid, e[3])
                if old is not None:
                    release(*old, sid)
            elif key in live:  # a free, or a resize to nothing (a storage of the first step: once)
                release(*live.pop(key), sid)
            allocated.append(a.allocated)
            reserved.append(a.reserved)
            traced.append(now[0])

    born = {}
    for i, e in enumerate(ev.events):
        if e[0] == "alloc":
            born.setdefault(e[1], i)
    oom = oom_at = None
    try:
        for nbytes in extra:
            a.malloc(nbytes, DEFAULT)
        for sid in ev.initial:
            alloc((sid, 0), sid, ev.storages[sid].nbytes)
        step(ev.events[:ev.first_phase], 0, 0)
        for rep in range(repeat):
            step(ev.events[ev.first_phase:], ev.first_phase, rep)
            for key in [k for k in live if rep + 1 < repeat and born.get(k[0], -1) >= ev.first_phase]:
                release(*live.pop(key), key[0])  # a step's leftovers go before the next step starts
    except OutOfMemory as err:
        oom, oom_at = err, len(allocated)
    labels = {id(block): ev.storages[key[0]].category for key, (block, _) in live.items()}
    return Replay(options, allocated, reserved, traced, a.peak_reserved, a.peak_allocated, max(traced, default=0),
                  a.reserved_by_stream(), a.retries, oom, oom_at, a, labels)
# --8<-- [end:replay]


def peak_at(r: Replay) -> int:
    """The event after which the allocator held the most in live blocks (the moment to picture)."""
    return max(range(len(r.allocated)), key=r.allocated.__getitem__) + 1 if r.allocated else 0


# ---------------------------------------------------------------------- a ledger as a file
def export_events(ev: Events) -> dict:
    """A ledger's device events as JSON (``events_of(ledger)``): what ``--ledger`` reads."""
    return {"format": FORMAT, "events": [list(e) for e in ev.events], "first_phase": ev.first_phase,
            "boundaries": sorted(ev.boundaries), "initial": ev.initial,
            "storages": {str(sid): {"nbytes": s.nbytes, "stream": s.stream, "uses": list(s.uses),
                                    "category": s.category} for sid, s in ev.storages.items()}}


def load(path: Path) -> Events:
    """A ledger file written by :func:`export`; anything else is refused in one line."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UsageError(f"--ledger {path}: not a ledger file ({type(err).__name__}: {err})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UsageError(f"--ledger {path}: not a ledger file (no \"format\": \"{FORMAT}\" in it)")
    try:
        storages = {int(k): Storage(int(v["nbytes"]), str(v["stream"]), tuple(map(str, v["uses"])),
                                    str(v["category"])) for k, v in data["storages"].items()}
        events = [tuple(e) for e in data["events"]]
        for e in events:
            sizes = e[2:]
            if (e[0] not in ("alloc", "free", "resize") or e[1] not in storages
                    or len(sizes) != {"alloc": 1, "free": 0, "resize": 2}[e[0]]
                    or any(not isinstance(x, int) or isinstance(x, bool) or x < 0 for x in sizes)):
                raise ValueError(f"bad event {list(e)}")
        if any(s.nbytes < 0 for s in storages.values()):
            raise ValueError("a storage of negative size")
        return Events(storages, events, set(map(int, data["boundaries"])), int(data["first_phase"]),
                      [int(x) for x in data["initial"]])
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise UsageError(f"--ledger {path}: a ledger file, but not a valid one ({err})") from None
