"""The memory ledger: a timeline of live tensor bytes by category, device and phase.

How it works
------------
While a ``Ledger`` is entered it is a ``TorchDispatchMode``: every aten op that runs passes
through it, and every *new storage* an op returns is an allocation event. A weak reference on the
storage object fires when PyTorch frees it: a free event. Nothing is sampled or guessed, so on CPU
the ledger is exact (bytes are ``storage.nbytes()``) and deterministic (the op sequence is).

Each storage gets **one category for its whole life**, resolved when you read the ledger:

========================  ===============================================================
category                  rule
========================  ===============================================================
``parameters``            a parameter of a module given to :meth:`Ledger.track_module`
``gradients``             became ``param.grad`` (post-accumulate-grad hook)
``optimizer_state``       found in ``optimizer.state`` after a ``step()`` (step post-hook)
``activations``           born in a ``forward`` phase and still alive when that phase ended,
                          i.e. kept for backward
``temporaries``           born inside any phase and not one of the above
``host_copies``           labelled so by the lab (offload buffers), or any storage born inside
                          ``with ledger.category("host_copies")``
``communication``         labelled so by the lab: gradient buckets, all-gather and
                          reduce-scatter buffers of data-parallel training
``other``                 born outside every phase (input batches, buffers, ...)
========================  ===============================================================

Labels are resolved lazily because a storage's role is often only known later: the output of a
matmul in backward *becomes* a gradient when autograd accumulates it, Adam's moment tensors are
created inside ``step()``. The timeline is replayed from the event log with the final labels, so
an Adam state tensor is optimizer state from the instant it was allocated.

Scopes: a storage counts as *device* memory when it lives on the ledger's compute device and is
not a host copy; everything else is *host* memory. On a CPU-only run both live in RAM, and the
``host_copies`` label is what keeps an offload lab's host side apart from its "device" side.

On CUDA the counted size of a storage is rounded up to the caching allocator's 512-byte blocks,
and every event also samples ``torch.cuda.memory_allocated`` and ``memory_reserved`` so the two
accounts can be compared on the same run.

Storages resized in place with ``UntypedStorage.resize_`` (FSDP frees and re-allocates unsharded
parameters that way) are followed: the ledger wraps ``resize_`` while it is entered. Tensor
subclasses such as DTensor are looked through: their local tensors are what is counted.
With ``stacks=True`` every storage also remembers the line of code that allocated it and, when
that line is in labkit's own model code (``models.py``, ``diffusion.py``), the lab line that
called the model; :meth:`Ledger.live_by_origin` lists what is alive by category and by both.

Not seen: memory allocated outside the dispatcher (CUDA context, cuBLAS workspaces, NCCL
buffers), and tensors created before the ledger was entered unless you register them
(``track_module``, ``track_optimizer``, ``track``).
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

PARAMETERS = "parameters"
GRADIENTS = "gradients"
OPTIMIZER_STATE = "optimizer_state"
ACTIVATIONS = "activations"
TEMPORARIES = "temporaries"
HOST_COPIES = "host_copies"
COMMUNICATION = "communication"
OTHER = "other"

#: Plot and table order: long-lived state first, short-lived last.
CATEGORIES = (PARAMETERS, GRADIENTS, OPTIMIZER_STATE, ACTIVATIONS, TEMPORARIES, HOST_COPIES, COMMUNICATION,
              OTHER)

#: The phase names labs use; any other name is allowed too.
PHASES = ("forward", "backward", "optimizer", "transfer")

CUDA_BLOCK = 512  # the CUDA caching allocator hands out multiples of 512 bytes


def counted_bytes(nbytes: int, device: torch.device) -> int:
    """Bytes a storage of ``nbytes`` occupies: exact on CPU, rounded to 512-byte blocks on CUDA."""
    if nbytes <= 0:
        return 0
    if device.type == "cuda":
        return -(-nbytes // CUDA_BLOCK) * CUDA_BLOCK
    return nbytes


@dataclass
class StorageRecord:
    sid: int
    nbytes: int
    device: torch.device
    born: int  # index of its alloc event
    phase: str | None  # phase name at birth (None: outside every phase)
    phase_id: int | None  # which phase instance
    op: str  # the aten op that allocated it
    label: str | None = None
    explicit: bool = False  # label given by the lab (overrides automatic labels)
    survived_forward: bool = False
    alive: bool = True
    where: str | None = None  # "file.py:123 in fn: code", with stacks=True
    called_from: str | None = None  # the lab line that called labkit's model code, when ``where`` is in it


@dataclass
class PhaseSpan:
    name: str
    step: int | None
    start: int  # first timeline row inside the phase
    end: int  # one past the last row inside the phase


@dataclass
class Timeline:
    """Rows of the ledger replayed with final categories: one row per allocation or free."""

    categories: tuple[str, ...]
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

    def device_total(self) -> list[int]:
        return [sum(col[i] for col in self.device.values()) for i in range(len(self))]

    def host_total(self) -> list[int]:
        return [sum(col[i] for col in self.host.values()) for i in range(len(self))]

    def row(self, i: int) -> dict[str, int]:
        return {cat: self.device[cat][i] for cat in self.categories}

    def window(self, *phases: str) -> Timeline:
        """The rows from the first span of any of ``phases`` to the end of the last one."""
        spans = [s for s in self.spans if s.name in phases]
        if not spans:
            raise ValueError(f"no phase named {', '.join(phases)} in this timeline")
        lo, hi = min(s.start for s in spans), max(s.end for s in spans)
        out = Timeline(categories=self.categories)
        for name in ("index", "time_s", "phase", "step", "cuda_allocated", "cuda_reserved"):
            setattr(out, name, getattr(self, name)[lo:hi])
        out.device = {c: v[lo:hi] for c, v in self.device.items()}
        out.host = {c: v[lo:hi] for c, v in self.host.items()}
        out.spans = [PhaseSpan(s.name, s.step, s.start - lo, s.end - lo) for s in self.spans
                     if s.start >= lo and s.end <= hi]
        return out

    @classmethod
    def from_dict(cls, d: dict) -> Timeline:
        """The inverse of :meth:`to_dict` (e.g. a timeline another process wrote as JSON)."""
        tl = cls(categories=tuple(d["categories"]))
        for name in ("index", "time_s", "phase", "step", "cuda_allocated", "cuda_reserved"):
            setattr(tl, name, list(d[name]))
        tl.device, tl.host = dict(d["device"]), dict(d["host"])
        tl.spans = [PhaseSpan(**s) for s in d["spans"]]
        return tl

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


class Ledger(TorchDispatchMode):
    """Records live tensor bytes by category while entered.

    >>> ledger = Ledger("cpu")
    >>> ledger.track_module(model); ledger.track_optimizer(opt)
    >>> with ledger:
    ...     with ledger.phase("forward", step=0):
    ...         loss = model(x).sum()
    >>> ledger.peaks_by_phase()["forward"]["activations"]
    """

    def __init__(self, device: str | torch.device = "cpu", sample_cuda: bool = True,
                 stacks: bool = False) -> None:
        super().__init__()
        self.stacks = stacks
        self._original_resize = None
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.sample_cuda = sample_cuda and self.device.type == "cuda"
        self.records: list[StorageRecord] = []
        self._initial: list[int] = []  # storages registered before the first event
        self.events: list[tuple] = []  # ("alloc", sid, bytes) | ("free", sid) | ("resize", sid, old, new)
        self.event_time: list[float] = []
        self.event_cuda: list[tuple[int, int]] = []
        self._phase_marks: list[tuple[str, int, str, int | None, int]] = []  # (kind, pid, name, step, at)
        self._sid_of = WeakIdKeyDictionary()  # storage -> sid
        self._refs: dict[int, weakref.ref] = {}
        self._lock = threading.RLock()
        self._phase: tuple[str, int] | None = None
        self._phase_count = 0
        self._step: int | None = None
        self._category_stack: list[str] = []
        self._modules: list[weakref.ref] = []  # weak: a ledger must not keep a model alive
        self._optimizers: list[weakref.ref] = []
        self._handles: list = []
        self._depth = 0
        self._active_until: int | None = None
        self._t0 = time.perf_counter()

    # ------------------------------------------------------------------ registration
    def track_module(self, module: torch.nn.Module) -> Ledger:
        """Count a module's parameters (and buffers, as ``other``); label its gradients."""
        self._modules.append(weakref.ref(module))
        for p in module.parameters():
            self._label_tensor(p, PARAMETERS, explicit=False, adopt=True)
            if p.grad is not None:
                self._label_tensor(p.grad, GRADIENTS, explicit=False, adopt=True)
        for b in module.buffers():
            self._label_tensor(b, OTHER, explicit=False, adopt=True)
        if self._depth:
            self._install_hooks_for(module)
        return self

    def track_optimizer(self, optimizer: torch.optim.Optimizer) -> Ledger:
        """Count an optimizer's state tensors, now and after every ``step()``."""
        self._optimizers.append(weakref.ref(optimizer))
        self._label_optimizer_state(optimizer, adopt=True)
        if self._depth:
            self._handles.append(optimizer.register_step_post_hook(self._after_step))
        return self

    def track(self, tensors, category: str) -> None:
        """Label the storages of ``tensors`` (a tensor or any nest of them) with ``category``.

        A tensor that was created before the ledger was entered is adopted: it appears in the
        timeline from this moment on.
        """
        self._check_category(category)
        flat, _ = tree_flatten(tensors)
        for t in flat:
            if isinstance(t, torch.Tensor):
                self._label_tensor(t, category, explicit=True, adopt=True)

    @contextlib.contextmanager
    def category(self, name: str) -> Iterator[None]:
        """Storages allocated inside this block get category ``name`` (e.g. ``host_copies``)."""
        self._check_category(name)
        self._category_stack.append(name)
        try:
            yield
        finally:
            self._category_stack.pop()

    @contextlib.contextmanager
    def phase(self, name: str, step: int | None = None) -> Iterator[None]:
        """Mark a phase (``forward``, ``backward``, ``optimizer``, ``transfer`` or your own)."""
        with self._lock:
            if step is not None:
                self._step = step
            outer = self._phase
            self._phase_count += 1
            pid = self._phase_count
            self._phase = (name, pid)
            self._phase_marks.append(("start", pid, name, self._step, len(self.events)))
        try:
            yield
        finally:
            with self._lock:
                if name == "forward":
                    for rec in self.records:
                        if rec.alive and rec.phase_id == pid:
                            rec.survived_forward = True
                self._phase_marks.append(("end", pid, name, self._step, len(self.events)))
                self._phase = outer

    # ------------------------------------------------------------------ mode plumbing
    def __enter__(self):
        if self._depth == 0:
            self._patch_resize()
            for m in _alive(self._modules):
                self._install_hooks_for(m)
            for opt in _alive(self._optimizers):
                self._handles.append(opt.register_step_post_hook(self._after_step))
            self._active_until = None
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            for h in self._handles:
                h.remove()
            self._handles.clear()
            # Labels known at the end (gradients alive now, optimizer state) are applied once more.
            for m in _alive(self._modules):
                for p in m.parameters():
                    if p.grad is not None:
                        self._label_tensor(p.grad, GRADIENTS, explicit=False, adopt=False)
            for opt in _alive(self._optimizers):
                self._label_optimizer_state(opt, adopt=False)
            self._active_until = len(self.events)
            self._unpatch_resize()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _DTensor is not None and any(t is _DTensor for t in types):
            return NotImplemented  # let DTensor turn itself into local ops, then count those
        out = func(*args, **(kwargs or {}))
        flat_out, _ = tree_flatten(out)
        inputs_ptrs = None
        for t in flat_out:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            if st.device.type == "meta":
                continue  # a fake tensor (e.g. DTensor's sharding propagation): it owns no memory
            sid = self._sid_of.get(st)
            nbytes = st.nbytes()
            if sid is not None:
                rec = self.records[sid]
                new = counted_bytes(nbytes, rec.device)
                if new != rec.nbytes and rec.alive:
                    self._event(("resize", sid, rec.nbytes, new))
                    rec.nbytes = new
                continue
            if nbytes == 0:
                continue
            if inputs_ptrs is None:
                inputs_ptrs = _storage_ptrs((args, kwargs))
            if (t.device, st.data_ptr()) in inputs_ptrs:
                continue  # a view or alias of an input we were not asked to track
            self._new_storage(st, t.device, str(func.overloadpacket.__name__))
        return out

    # ------------------------------------------------------------------ internals
    def _check_category(self, name: str) -> None:
        if name not in CATEGORIES:
            raise ValueError(f"unknown category {name!r}; choose one of {', '.join(CATEGORIES)}")

    def _event(self, ev: tuple) -> None:
        self.events.append(ev)
        self.event_time.append(time.perf_counter() - self._t0)
        if self.sample_cuda:
            self.event_cuda.append(
                (torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device))
            )

    def _new_storage(self, st: torch.UntypedStorage, device: torch.device, op: str) -> StorageRecord:
        with self._lock:
            sid = len(self.records)
            phase, pid = self._phase if self._phase else (None, None)
            label = self._category_stack[-1] if self._category_stack else None
            rec = StorageRecord(
                sid=sid,
                nbytes=counted_bytes(st.nbytes(), device),
                device=device,
                born=len(self.events),
                phase=phase,
                phase_id=pid,
                op=op,
                label=label,
                explicit=label is not None,
                **(_origin() if self.stacks else {}),
            )
            self.records.append(rec)
            self._sid_of[st] = sid
            self._refs[sid] = weakref.ref(st, self._freed_callback(sid))
            if self._depth == 0 and not self.events:
                self._initial.append(sid)  # registered before the run: the timeline starts with it
            else:
                self._event(("alloc", sid, rec.nbytes))
            return rec

    def _freed_callback(self, sid: int):
        def freed(_ref) -> None:
            with self._lock:
                rec = self.records[sid]
                if rec.alive:
                    rec.alive = False
                    self._event(("free", sid))
                self._refs.pop(sid, None)

        return freed

    def _label_tensor(self, t: torch.Tensor, category: str, explicit: bool, adopt: bool) -> None:
        if _DTensor is not None and isinstance(t, _DTensor):
            t = t._local_tensor  # this rank's shard is what occupies its memory
        if t.device.type == "meta" or t.untyped_storage().device.type == "meta":
            return
        st = t.untyped_storage()
        sid = self._sid_of.get(st)
        if sid is None:
            if not adopt or st.nbytes() == 0:
                return
            rec = self._new_storage(st, t.device, "adopted")
        else:
            rec = self.records[sid]
        if explicit or rec.label is None or not rec.explicit and _AUTO_RANK[category] < _AUTO_RANK.get(rec.label, 99):
            rec.label = category
            rec.explicit = rec.explicit or explicit

    def _label_optimizer_state(self, optimizer: torch.optim.Optimizer, adopt: bool) -> None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self._label_tensor(value, OPTIMIZER_STATE, explicit=False, adopt=adopt)

    def _after_step(self, optimizer, args, kwargs) -> None:
        self._label_optimizer_state(optimizer, adopt=True)

    def _install_hooks_for(self, module: torch.nn.Module) -> None:
        for p in module.parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_hook))

    def _grad_hook(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            self._label_tensor(param.grad, GRADIENTS, explicit=False, adopt=True)

    def _patch_resize(self) -> None:
        """Follow ``UntypedStorage.resize_`` (it bypasses the dispatcher) while the ledger is entered."""
        original = torch.UntypedStorage.resize_
        ledger = self

        def resize_(storage, size):
            result = original(storage, size)
            with ledger._lock:
                sid = ledger._sid_of.get(storage)
                if sid is not None:
                    rec = ledger.records[sid]
                    new = counted_bytes(storage.nbytes(), rec.device)
                    if new != rec.nbytes and rec.alive:
                        ledger._event(("resize", sid, rec.nbytes, new))
                        rec.nbytes = new
                elif storage.nbytes() > 0 and storage.device.type != "meta":
                    ledger._new_storage(storage, storage.device, "resize_")
            return result

        self._original_resize = original
        torch.UntypedStorage.resize_ = resize_

    def _unpatch_resize(self) -> None:
        if self._original_resize is not None:
            torch.UntypedStorage.resize_ = self._original_resize
            self._original_resize = None

    # ------------------------------------------------------------------ reading
    def category_of(self, rec: StorageRecord) -> str:
        if rec.label is not None:
            return rec.label
        if rec.phase == "forward" and rec.survived_forward:
            return ACTIVATIONS
        if rec.phase is not None:
            return TEMPORARIES
        return OTHER

    def scope_of(self, rec: StorageRecord) -> str:
        if rec.label == HOST_COPIES or rec.device != self.device:
            return "host"
        return "device"

    def timeline(self) -> Timeline:
        """Replay the events with final categories (one row per event)."""
        with self._lock:
            n_events = len(self.events) if self._active_until is None else self._active_until
            events = self.events[:n_events]
            cats = [self.category_of(r) for r in self.records]
            scopes = [self.scope_of(r) for r in self.records]
            marks = list(self._phase_marks)
            initial = list(self._initial)
            initial_sizes = {sid: self._initial_size(sid) for sid in initial}
        tl = Timeline(categories=CATEGORIES)
        tl.device = {c: [] for c in CATEGORIES}
        tl.host = {c: [] for c in CATEGORIES}

        # Phase spans in rows: a phase covers the events recorded between its start and end marks.
        starts = {pid: (name, step, at) for kind, pid, name, step, at in marks if kind == "start"}
        ends = {pid: at for kind, pid, _name, _step, at in marks if kind == "end"}
        phase_at: list[tuple[str | None, int | None]] = [(None, None)] * n_events
        for pid in sorted(starts, key=lambda p: (starts[p][2], p)):  # outer phases first
            name, step, start = starts[pid]
            end = min(ends.get(pid, n_events), n_events)
            start = min(start, n_events)
            tl.spans.append(PhaseSpan(name, step, start, end))
            for i in range(start, end):
                phase_at[i] = (name, step)

        live = {(s, c): 0 for s in ("device", "host") for c in CATEGORIES}
        sizes: dict[int, int] = {}
        for sid in initial:
            sizes[sid] = initial_sizes[sid]
            live[(scopes[sid], cats[sid])] += sizes[sid]
        for i, ev in enumerate(events):
            kind, sid = ev[0], ev[1]
            key = (scopes[sid], cats[sid])
            if kind == "alloc":
                sizes[sid] = ev[2]
                live[key] += ev[2]
            elif kind == "free":
                live[key] -= sizes.pop(sid, 0)
            else:  # resize
                live[key] += ev[3] - sizes.get(sid, ev[2])
                sizes[sid] = ev[3]
            tl.index.append(i)
            tl.time_s.append(self.event_time[i])
            tl.phase.append(phase_at[i][0])
            tl.step.append(phase_at[i][1])
            for c in CATEGORIES:
                tl.device[c].append(live[("device", c)])
                tl.host[c].append(live[("host", c)])
            if self.sample_cuda:
                alloc, reserved = self.event_cuda[i]
                tl.cuda_allocated.append(alloc)
                tl.cuda_reserved.append(reserved)
        return tl

    def _initial_size(self, sid: int) -> int:
        for ev in self.events:  # a later resize event knows the size it started from
            if ev[0] == "resize" and ev[1] == sid:
                return ev[2]
        return self.records[sid].nbytes

    def peaks_by_phase(self, timeline: Timeline | None = None) -> dict[str, dict[str, int]]:
        """For each phase name: the device bytes by category at that phase's highest moment."""
        tl = timeline or self.timeline()
        total = tl.device_total()
        best: dict[str, int] = {}
        for span in tl.spans:
            # row i is the state after event i: a phase sees its entry state (row start-1) too
            for i in range(max(span.start - 1, 0), min(span.end, len(total))):
                if span.name not in best or total[i] > total[best[span.name]]:
                    best[span.name] = i
        return {name: tl.row(i) for name, i in best.items()}

    def peak(self, timeline: Timeline | None = None) -> dict[str, int]:
        """Device bytes by category at the highest moment of the whole run, plus ``total``."""
        tl = timeline or self.timeline()
        if not len(tl):
            return {c: 0 for c in CATEGORIES} | {"total": 0}
        total = tl.device_total()
        i = max(range(len(total)), key=total.__getitem__)
        return tl.row(i) | {"total": total[i]}

    def at_end(self, timeline: Timeline | None = None) -> dict[str, int]:
        """Device bytes by category when the ledger was last exited (frees after that not counted)."""
        tl = timeline or self.timeline()
        return tl.row(len(tl) - 1) if len(tl) else {c: 0 for c in CATEGORIES}

    def current(self) -> dict[str, int]:
        """Device bytes by category right now (what is still alive, whenever you ask)."""
        out = {c: 0 for c in CATEGORIES}
        with self._lock:
            for rec in self.records:
                if rec.alive and self.scope_of(rec) == "device":
                    out[self.category_of(rec)] += rec.nbytes
        return out

    def live_records(self) -> Iterable[StorageRecord]:
        with self._lock:
            return [r for r in self.records if r.alive]

    def live_by_origin(self) -> list[dict]:
        """What is alive now, grouped by category, by the line that allocated it and by the lab line
        that called it there (``called_from``, None when that line is the lab's own), largest first.

        Needs ``Ledger(..., stacks=True)``; without it every origin reads "unknown".
        """
        groups: dict[tuple, dict] = {}
        for rec in self.live_records():
            key = (self.scope_of(rec), self.category_of(rec), rec.where or "unknown", rec.called_from)
            g = groups.setdefault(key, {"scope": key[0], "category": key[1], "where": key[2],
                                        "called_from": key[3], "bytes": 0, "tensors": 0})
            g["bytes"] += rec.nbytes
            g["tensors"] += 1
        return sorted(groups.values(), key=lambda g: -g["bytes"])


def _alive(refs: list[weakref.ref]) -> list:
    return [obj for obj in (r() for r in refs) if obj is not None]


_AUTO_RANK = {
    PARAMETERS: 0,
    OPTIMIZER_STATE: 1,
    GRADIENTS: 2,
    HOST_COPIES: 3,
    COMMUNICATION: 4,
    ACTIVATIONS: 5,
    TEMPORARIES: 6,
    OTHER: 7,
}


# labkit's model code: a tensor born there is named by that line and by the lab line that called
# it. Every other labkit module is an instrument, never where a tensor comes from.
_MODEL_CODE = frozenset({"models.py", "diffusion.py"})


def _origin() -> dict[str, str | None]:
    """``where``: the innermost frame outside torch, the standard library and labkit's instruments
    (labkit's model code counts); ``called_from``: when that frame is labkit's model code, the first
    frame outside labkit.

    Walks the live frames and reads a source line only for the frames it returns: with
    ``stacks=True`` this runs on every allocation, so it must stay cheap.
    """
    import sys

    where = None
    frame = sys._getframe(1)
    while frame is not None:
        f = frame.f_code.co_filename.replace("\\", "/")
        library = "/torch/" in f or "/lib/python3" in f or f.startswith("<frozen")
        if not library and "/labkit/" not in f:  # the lab's own code (or a test's)
            line = _frame_line(frame)
            return {"where": where or line, "called_from": line if where else None}
        if not library and where is None and f.rsplit("/", 1)[-1] in _MODEL_CODE:
            where = _frame_line(frame)  # labkit's model code: walk on to the lab line that called it
        frame = frame.f_back
    return {"where": where, "called_from": None}


def _frame_line(frame) -> str:
    import linecache

    name = frame.f_code.co_filename.replace("\\", "/").rsplit("/", 1)[-1]
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return f"{name}:{frame.f_lineno} in {frame.f_code.co_name}: {line}"


try:  # DTensor is public from torch 2.5; a build without it has none to look through
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # pragma: no cover
    _DTensor = None


def _storage_ptrs(tree) -> set[tuple[torch.device, int]]:
    flat, _ = tree_flatten(tree)
    out = set()
    for t in flat:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            out.add((t.device, t.untyped_storage().data_ptr()))
    return out


class NullLedger:
    """The Ledger's interface doing nothing: for timing runs, where a dispatch mode would cost time."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)

    def track_module(self, module) -> NullLedger:
        return self

    def track_optimizer(self, optimizer) -> NullLedger:
        return self

    def track(self, tensors, category: str) -> None:
        pass

    def category(self, name: str):
        return contextlib.nullcontext()

    def phase(self, name: str, step: int | None = None):
        return contextlib.nullcontext()

    def __enter__(self) -> NullLedger:
        return self

    def __exit__(self, *exc) -> None:
        return None
