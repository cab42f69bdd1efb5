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
``frozen_weights``        labelled so by a fine-tuning lab (``ledger.track(weights, "frozen_weights")``):
                          weights no gradient reaches, a LoRA's base, its NF4 codes
``quant_constants``       labelled so likewise: what a quantized weight needs to be read back
``gradients``             became ``param.grad`` (post-accumulate-grad hook)
``optimizer_state``       found in ``optimizer.state`` after a ``step()`` (step post-hook)
``activations``           born in a ``forward`` phase and still alive when that phase ended,
                          i.e. kept for backward
``dequantized``           born inside ``marks.category("dequantized")``: a quantized weight read back
                          for one matmul
``temporaries``           born inside any phase and not one of the above
``host_copies``           labelled so from outside (``ledger.track(engine.host_tensors(),
                          "host_copies")``), or born inside ``marks.category("host_copies")``
``kv_cache``              labelled so by a serving lab (``ledger.track(pool, "kv_cache")`` or
                          ``marks.category("kv_cache")``): the preallocated keys and values
``communication``         labelled so by an instrument (``labkit.traffic``): gradient buckets,
                          all-gather and reduce-scatter buffers of data-parallel training
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
Streams (:func:`labkit.marks.stream`, ``on_stream``, ``record_stream``): each storage remembers the
CUDA stream it was allocated on (``None``: the default stream) and the other streams it was used
on, for Lab 16's model of the caching allocator, which keeps a pool per stream.
With ``stacks=True`` every storage also remembers the line of code that allocated it and, when
that line is in labkit's own model code, the lab line that called the model
(:mod:`labkit.stacks`, whose ``live_by_origin`` lists what is alive by category and by both).

The ledger is the recorder only. What it records is read as a :class:`labkit.timeline.Timeline`
(torch-free: peaks, windows, step peaks). Phases and categories come from the lab's ambient marks
(:mod:`labkit.marks`): while entered, the ledger watches them, so the code it measures passes no
ledger around.

Fake tensors (:mod:`labkit.fake`): a ledger entered inside ``fake.tensors()`` counts the fake
storages of that fake mode as it counts real ones (rounded to the block ``fake.tensors`` names), so
a lab's own step traced at real size gives the timeline the real step would give.

Not seen: memory allocated outside the dispatcher (CUDA context, cuBLAS workspaces, NCCL
buffers), and tensors created before the ledger was entered unless you register them
(``track_module``, ``track_optimizer``, ``track``).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from labkit import fake, marks, stacks
from labkit.timeline import (  # noqa: F401  (the categories are re-exported for the labs)
    ACTIVATIONS, CATEGORIES, COMMUNICATION, DEQUANTIZED, FROZEN_WEIGHTS, GRADIENTS, HOST_COPIES, KV_CACHE, OPTIMIZER_STATE,
    OTHER, PARAMETERS, PHASES, QUANT_CONSTANTS, TEMPORARIES, PhaseSpan, Timeline)

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
    stream: str | None = None  # the CUDA stream it was allocated on (None: the default stream)
    uses: frozenset = frozenset()  # other streams it was used on (record_stream)


class Ledger(TorchDispatchMode):
    """Records live tensor bytes by category while entered.

    >>> ledger = Ledger("cpu")
    >>> ledger.track_module(model); ledger.track_optimizer(opt)
    >>> with ledger:
    ...     with marks.phase("forward", step=0):  # the lab's own mark: the ledger watches it
    ...         loss = model(x).sum()
    >>> ledger.timeline().peaks_by_phase()["forward"]["activations"]

    ``device``: the compute device; storages elsewhere count as host memory. ``sample_cuda``: also
    read ``torch.cuda.memory_allocated``/``memory_reserved`` at every event. ``stacks``: remember
    the line that allocated each storage (slower; see :mod:`labkit.stacks`).
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
        self._stream_stack: list[str] = []
        self._modules: list[weakref.ref] = []  # weak: a ledger must not keep a model alive
        self._optimizers: list[weakref.ref] = []
        self._handles: list = []
        self._observers: dict = {}  # op -> callbacks (observe)
        self._depth = 0
        self._active_until: int | None = None
        self._t0 = time.perf_counter()
        self._fake = fake.active()  # the labkit.fake trace this ledger counts, if made inside one

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

    def observe(self, func, callback) -> None:
        """Call ``callback(args, out)`` after every ``func`` (an op overload) the ledger counts, the
        storages it made already given their ids: an instrument that needs one op's inputs and output
        without a dispatch mode of its own, which every op of a step would pass through."""
        self._observers.setdefault(func, []).append(callback)

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
        """Storages allocated inside this block get category ``name`` (``marks.category`` calls it)."""
        self._check_category(name)
        self._category_stack.append(name)
        try:
            yield
        finally:
            self._category_stack.pop()

    @contextlib.contextmanager
    def stream(self, name: str) -> Iterator[None]:
        """Storages allocated inside this block are on stream ``name`` (``marks.stream`` calls it)."""
        self._stream_stack.append(name)
        try:
            yield
        finally:
            self._stream_stack.pop()

    def on_stream(self, tensors, name: str) -> None:
        """The storages of ``tensors`` were allocated on stream ``name`` (``marks.on_stream``)."""
        for rec in self._records_of(tensors):
            rec.stream = name

    def record_stream(self, tensors, name: str) -> None:
        """The storages of ``tensors`` are used on stream ``name`` too (``marks.record_stream``)."""
        for rec in self._records_of(tensors):
            if name != (rec.stream or "default"):
                rec.uses = rec.uses | {name}

    def _records_of(self, tensors) -> list[StorageRecord]:
        flat, _ = tree_flatten(tensors)
        sids = {self.storage_id(t._local_tensor if _is_dtensor(t) else t)
                for t in flat if isinstance(t, torch.Tensor)}
        return [self.records[sid] for sid in sorted(s for s in sids if s is not None)]

    @contextlib.contextmanager
    def phase(self, name: str, step: int | None = None) -> Iterator[None]:
        """Mark a phase (``marks.phase`` calls it for every ledger that is entered)."""
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
    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Under ``torch.compile`` the ledger is off while Dynamo and AOTAutograd trace and compile, and on
        again for the compiled code (``torch.utils._python_dispatch``): it counts what the compiled step
        runs, not the compiler's own tensors. Without this, Dynamo runs every frame eager under a mode."""
        return True

    def __enter__(self):
        if self._depth == 0:
            from labkit.cuda import warm_up

            self._fake = self._fake or fake.active()
            _watch_propagation()  # DTensor's shape propagation, if DTensor is in use: not the step's
            if self._fake is None:
                warm_up(self.device)  # cuBLAS takes its workspaces now, before anything is recorded
            self._patch_resize()
            for m in _alive(self._modules):
                self._install_hooks_for(m)
            for opt in _alive(self._optimizers):
                self._handles.append(opt.register_step_post_hook(self._after_step))
            self._active_until = None
            marks.watch(self)
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            marks.unwatch(self)
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
        dtensor = dtensor_type()
        if dtensor is not None and any(t is dtensor for t in types):
            return NotImplemented  # let DTensor turn itself into local ops, then count those
        if _PROPAGATING.depth:  # DTensor learning an output's shape on fake tensors: no storage of the step
            return func(*args, **(kwargs or {}))
        if func is _WAIT_TENSOR and self._counts_fake(args[0]):
            return args[0]  # a collective's wait returns its input (the fake kernel would make a new tensor)
        out = func(*args, **(kwargs or {}))
        if func is _LIFT_FRESH:
            # torch.tensor(data) builds its storage outside the dispatcher and hands it over through
            # lift_fresh: a real run never sees that storage born, and a fake trace (where lift_fresh
            # makes a new fake storage) must not either, or the two would differ by Adam's step counters.
            return out
        inputs_ptrs = None
        for t in _tensors(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            if st.device.type == "meta" and not self._counts_fake(t):
                continue  # a fake tensor not of our trace (e.g. DTensor's sharding propagation)
            sid = self._sid_of.get(st)
            nbytes = st.nbytes()
            if sid is not None:
                rec = self.records[sid]
                new = self._counted(nbytes, rec.device)
                if new != rec.nbytes and rec.alive:
                    self._event(("resize", sid, rec.nbytes, new))
                    rec.nbytes = new
                continue
            if nbytes == 0:
                continue
            if inputs_ptrs is None:
                inputs_ptrs = _storage_ptrs((args, kwargs))
            if _storage_key(t, st) in inputs_ptrs:
                continue  # a view or alias of an input we were not asked to track
            self._new_storage(st, t.device, str(func.overloadpacket.__name__))
        for callback in self._observers.get(func, ()):
            callback(args, out)
        return out

    # ------------------------------------------------------------------ internals
    def _check_category(self, name: str) -> None:
        if name not in CATEGORIES:
            raise ValueError(f"unknown category {name!r}; choose one of {', '.join(CATEGORIES)}")

    def _counts_fake(self, t: torch.Tensor) -> bool:
        """A fake tensor of the trace this ledger was entered in: counted as if it were real."""
        return self._fake is not None and getattr(t, "fake_mode", None) is self._fake.mode

    def _counted(self, nbytes: int, device: torch.device) -> int:
        if self._fake is not None and self._fake.block and nbytes > 0:
            return -(-nbytes // self._fake.block) * self._fake.block
        return counted_bytes(nbytes, device)

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
                nbytes=self._counted(st.nbytes(), device),
                device=device,
                born=len(self.events),
                phase=phase,
                phase_id=pid,
                op=op,
                label=label,
                explicit=label is not None,
                stream=self._stream_stack[-1] if self._stream_stack else None,
                **(stacks.origin() if self.stacks else {}),
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
        if _is_dtensor(t):
            t = t._local_tensor  # this rank's shard is what occupies its memory
        if type(t) not in _PLAIN and hasattr(type(t), "__tensor_flatten__"):  # a wrapper: its (first) inner tensor
            t = getattr(t, t.__tensor_flatten__()[0][0])
        if t.device.type == "meta" or t.untyped_storage().device.type == "meta" and not self._counts_fake(t):
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
                    new = ledger._counted(storage.nbytes(), rec.device)
                    if new != rec.nbytes and rec.alive:
                        ledger._event(("resize", sid, rec.nbytes, new))
                        rec.nbytes = new
                elif storage.nbytes() > 0 and (storage.device.type != "meta" or ledger._fake is not None):
                    # a fake storage knows no device of its own: it is on the trace's compute device
                    ledger._new_storage(storage, storage.device if storage.device.type != "meta" else ledger.device,
                                        "resize_")
            return result

        self._original_resize = original
        torch.UntypedStorage.resize_ = resize_

    def _unpatch_resize(self) -> None:
        if self._original_resize is not None:
            torch.UntypedStorage.resize_ = self._original_resize
            self._original_resize = None

    # ------------------------------------------------------------------ reading
    def storage_id(self, t: torch.Tensor) -> int | None:
        """The id this ledger gave ``t``'s storage (the ``sid`` of its records), or None if it has not seen it."""
        return self._sid_of.get(t.untyped_storage())

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
            phase_marks = list(self._phase_marks)
            initial = list(self._initial)
            initial_sizes = self._initial_sizes(initial, events)
        tl = Timeline(categories=CATEGORIES)
        tl.device = {c: [] for c in CATEGORIES}
        tl.host = {c: [] for c in CATEGORIES}

        # Phase spans in rows: a phase covers the events recorded between its start and end marks.
        starts = {pid: (name, step, at) for kind, pid, name, step, at in phase_marks if kind == "start"}
        ends = {pid: at for kind, pid, _name, _step, at in phase_marks if kind == "end"}
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

    def _initial_sizes(self, initial: list[int], events: list[tuple]) -> dict[int, int]:
        """What each storage registered before the run held when the run began: its first resize
        event knows the size it started from; otherwise its size now. One pass over the events."""
        wanted, sizes = set(initial), {}
        for ev in events:
            if ev[0] == "resize" and ev[1] in wanted and ev[1] not in sizes:
                sizes[ev[1]] = ev[2]
        return {sid: sizes.get(sid, self.records[sid].nbytes) for sid in initial}

    def peaks_by_phase(self) -> dict[str, dict[str, int]]:
        """Shorthand for ``timeline().peaks_by_phase()``."""
        return self.timeline().peaks_by_phase()

    def peak(self) -> dict[str, int]:
        """Shorthand for ``timeline().peak()``."""
        return self.timeline().peak()

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


def _alive(refs: list[weakref.ref]) -> list:
    return [obj for obj in (r() for r in refs) if obj is not None]


_AUTO_RANK = {
    PARAMETERS: 0,
    FROZEN_WEIGHTS: 0,
    QUANT_CONSTANTS: 0,
    OPTIMIZER_STATE: 1,
    GRADIENTS: 2,
    HOST_COPIES: 3,
    KV_CACHE: 3,
    COMMUNICATION: 4,
    ACTIVATIONS: 5,
    DEQUANTIZED: 6,
    TEMPORARIES: 6,
    OTHER: 7,
}


def dtensor_type():
    """DTensor's class once ``torch.distributed.tensor`` is imported (public from torch 2.5), else None:
    no DTensor exists before that import, and a command line that needs none skips its cost (about
    half a second: sympy and DTensor's op tables)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def _is_dtensor(t) -> bool:
    cls = dtensor_type()
    return cls is not None and isinstance(t, cls)


_LIFT_FRESH = torch.ops.aten.lift_fresh.default


class _Propagation:
    """DTensor's sharding propagation runs an op on fake tensors of the fake mode in force to learn its
    output's shape (``ShardingPropagator._propagate_tensor_meta_non_cached``, under its ``_fake_mode_lock``).
    Under a fake trace those would be the trace's own storages: while it runs, a ledger counts nothing."""

    def __init__(self) -> None:
        self.lock, self.depth = contextlib.nullcontext(), 0

    def __enter__(self):
        self.lock.__enter__()
        self.depth += 1

    def __exit__(self, *exc):
        self.depth -= 1
        return self.lock.__exit__(*exc)


_PROPAGATING = _Propagation()


def _watch_propagation() -> None:
    """Once DTensor is imported (a ledger never imports it): its sharding propagation enters ``_PROPAGATING``."""
    propagator = getattr(sys.modules.get("torch.distributed.tensor._sharding_prop"), "ShardingPropagator", None)
    if propagator is not None and propagator._fake_mode_lock is not _PROPAGATING:
        _PROPAGATING.lock, propagator._fake_mode_lock = propagator._fake_mode_lock, _PROPAGATING


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_WAIT_TENSOR = getattr(getattr(torch.ops._c10d_functional, "wait_tensor", None), "default", None)  # (C++ op)


def _storage_key(t: torch.Tensor, st: torch.UntypedStorage) -> tuple:
    """Where a storage's bytes are: its address for a real one; a fake one has none, so its identity."""
    if st.device.type == "meta":
        return ("fake", st._cdata)
    return (t.device, st.data_ptr())


def _tensors(tree, out: list | None = None) -> list:
    """The tensors in an op's arguments or result, in order: an aten op takes and returns tensors
    alone or inside tuples (named ones too), lists and dicts, which is all this walks; it is
    ``tree_flatten``'s answer for them at a fraction of its cost, paid on every op the ledger sees."""
    out = [] if out is None else out
    if isinstance(tree, torch.Tensor):
        if type(tree) not in _PLAIN and hasattr(type(tree), "__tensor_flatten__"):  # a wrapper (a functional
            for name in tree.__tensor_flatten__()[0]:  # collective's AsyncCollectiveTensor): its inner tensors
                _tensors(getattr(tree, name), out)
        else:
            out.append(tree)
    elif isinstance(tree, (tuple, list)):
        for leaf in tree:
            _tensors(leaf, out)
    elif isinstance(tree, dict):
        for leaf in tree.values():
            _tensors(leaf, out)
    return out


def _storage_ptrs(tree) -> set[tuple]:
    return {_storage_key(t, t.untyped_storage()) for t in _tensors(tree) if t.device.type != "meta"}
