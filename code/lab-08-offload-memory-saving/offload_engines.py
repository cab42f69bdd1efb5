"""Lab 08 - three offload engines for inference, each a handle that installs hooks and removes them.

* ``ModelOffload``: whole components (text encoder, denoiser, decoder) move to the device when
  their forward starts; the previous component is dropped when the next one begins (chained hooks).
* ``SequentialOffload``: every module that owns parameters loads them right before its forward and
  drops them right after. Minimal memory, no overlap: the slow baseline.
* ``LayerwiseOffload``: the blocks of a ModuleList stream through the device. A copy stream
  prefetches the next ``k`` blocks while the current one computes; at most ``k + 1`` blocks are
  resident; the GPU waits on events, the CPU never waits inside the block loop.

All three keep the weights' master copy on the host (``HostMaster``: one flat buffer per unit, a
view into the engine's ``PinnedArena``, which asks the pinned allocator only for power-of-two
chunks) and *release* device weights by pointing parameters at an empty placeholder: inference
weights never change, so nothing is ever copied back (zero device-to-host bytes).

``tag(category)`` tells the memory ledger which side a buffer is on (on a CPU-only machine both
sides are RAM), ``phase("transfer")`` marks each copy in the ledger's timeline, and
``recorder.mark(...)`` logs each transfer and compute for the residency schedule. Every handle
works as a context manager; ``remove()`` restores the model exactly as it was.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn
from pinned_arena import PinnedArena

ALIGN = 64  # bytes; every parameter starts on a 64-byte boundary inside a flat buffer


def _no_tag(category: str):
    return contextlib.nullcontext()


_no_phase = _no_tag  # phase("transfer") without a ledger: nothing to mark


# --8<-- [start:host-master]
class HostMaster:
    """The host copy of some parameters: ONE flat buffer, each parameter a view."""

    def __init__(self, params: list[nn.Parameter], pinned: bool, tag=_no_tag, flat=None) -> None:
        self.params = params
        self.layout, self.nbytes = self.plan(params)
        if flat is None:  # a buffer of its own, exactly this size
            with tag("host_copies"):
                flat = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pinned)
        self.flat = flat  # (1)!
        for view, p in zip(self.views(self.flat), params):
            view.copy_(p.data)

    @classmethod
    def packed(cls, units: list[list[nn.Parameter]], pinned: bool, tag=_no_tag):
        """One master per unit, all of them views into one arena of power-of-two chunks."""
        arena = PinnedArena([cls.plan(params)[1] for params in units], pinned, tag)  # (2)!
        return arena, [cls(params, pinned, tag, flat) for params, flat in zip(units, arena.regions)]

    @staticmethod
    def plan(params: list[nn.Parameter]) -> tuple[list, int]:
        """Where each parameter goes in the flat buffer, and the buffer's size."""
        layout, offset = [], 0
        for p in params:
            nbytes = p.numel() * p.element_size()
            layout.append((offset, nbytes, p.dtype, p.shape, p.device))
            offset += -(-nbytes // ALIGN) * ALIGN
        return layout, offset

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Typed, shaped views of a flat byte buffer (host or device), in order."""
        return [flat[o:o + n].view(dtype).view(shape) for o, n, dtype, shape, _ in
                self.layout]

    def attach(self, flat: torch.Tensor) -> None:
        for p, view in zip(self.params, self.views(flat)):
            p.data = view  # (3)!

    def detach(self) -> None:
        for p in self.params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)  # (4)!

    def restore(self) -> None:
        """Give every parameter its own storage again, where it lived before offload."""
        for p, view, (*_, device) in zip(self.params, self.views(self.flat), self.layout):
            p.data = torch.empty(view.shape, dtype=view.dtype, device=device).copy_(view)
# --8<-- [end:host-master]


class OffloadHandle:
    """Base of the engines: bookkeeping, the copy in, and a clean ``remove()``."""

    def __init__(self, device, pinned: bool, tag=_no_tag, recorder=None, phase=_no_phase) -> None:
        self.device = torch.device(device)
        self.pinned = pinned and torch.cuda.is_available()  # pinning needs a CUDA driver
        self.tag, self.recorder, self.phase = tag, recorder, phase
        self.hooks: list = []
        self.masters: list[HostMaster] = []
        self.arena: PinnedArena | None = None  # where the masters live
        self.h2d_bytes = 0
        self.d2h_bytes = 0  # stays 0: frozen weights are never copied back

    def _pack(self, units: list[list[nn.Parameter]]) -> list[HostMaster]:
        """Host masters for ``units`` in one arena; each unit's parameters released at once."""
        self.arena, masters = HostMaster.packed(units, self.pinned, self.tag)
        for master in masters:
            master.detach()
        self.masters += masters
        return masters

    def _mark(self, kind: str, unit: str, lane: str = "compute", nbytes: int = 0, stream=None) -> None:
        if self.recorder is not None:
            self.recorder.mark(kind, unit, lane, nbytes, stream)

    def _copy_in(self, master: HostMaster) -> torch.Tensor:
        """Allocate the device buffer and copy the host master into it, on the current stream."""
        with self.phase("transfer"), self.tag("parameters"):
            buf = torch.empty(master.nbytes, dtype=torch.uint8, device=self.device)
            buf.copy_(master.flat, non_blocking=self.pinned)
        self.h2d_bytes += master.nbytes
        return buf

    def settle(self) -> None:
        """Drop what was loaded ahead for work that will not come (see LayerwiseOffload)."""

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()
        for master in self.masters:
            master.restore()
        self.masters.clear()
        self.arena = None  # the chunks go back to the (pinned) allocator

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


class Resident(OffloadHandle):
    """No offload: these modules live on the device for the whole run."""

    def __init__(self, modules: dict[str, nn.Module], device, tag=_no_tag) -> None:
        super().__init__(device, pinned=False, tag=tag)
        self.names = list(modules)
        self.modules = [(m, [(p, p.device) for p in m.parameters()]) for m in modules.values()]
        with tag("parameters"):
            for m, _ in self.modules:
                m.to(self.device)

    def remove(self) -> None:
        for _, params in self.modules:
            for p, device in params:
                p.data = p.data.to(device)
        self.modules.clear()


def pieces(module: nn.Module) -> list[list[nn.Parameter]]:
    """A component cut at its seams: its own parameters, each child, each element of a ModuleList
    or Sequential. Smaller units pack tightly into the arena; the component still moves as a whole."""
    out = [list(module.parameters(recurse=False))]
    for child in module.children():
        out += pieces(child) if isinstance(child, (nn.ModuleList, nn.Sequential)) else [list(child.parameters())]
    return [params for params in out if params]


# --8<-- [start:model]
class ModelOffload(OffloadHandle):
    """Whole components move in when their forward starts; the previous one is dropped."""

    def __init__(self, components: dict[str, nn.Module], device, pinned=True, skip=(),
                 tag=_no_tag, recorder=None, phase=_no_phase) -> None:
        super().__init__(device, pinned, tag, recorder, phase)
        managed_elsewhere = {id(p) for m in skip for p in m.parameters()}
        units = {name: [kept for kept in ([p for p in params if id(p) not in managed_elsewhere]
                                          for params in pieces(module)) if kept]
                 for name, module in components.items()}
        masters = iter(self._pack([params for name in units for params in units[name]]))
        self.units = {name: [next(masters) for _ in units[name]] for name in units}
        for name, module in components.items():
            pre = functools.partial(self._pre, name)
            self.hooks.append(module.register_forward_pre_hook(pre))
        self.active: str | None = None

    def _pre(self, name: str, module, args) -> None:
        if self.active == name:
            return  # already on the device (the denoiser, from its second step on)
        if self.active is not None:
            for master in self.units[self.active]:
                master.detach()  # (1)!
            self._mark("evict", self.active)
        masters = self.units[name]
        self._mark("transfer_start", name, nbytes=sum(m.nbytes for m in masters))
        for master in masters:
            master.attach(self._copy_in(master))  # (2)!
        self._mark("transfer_end", name)
        self.active = name
# --8<-- [end:model]


# --8<-- [start:sequential]
class SequentialOffload(OffloadHandle):
    """Each module that owns parameters loads them right before its forward."""

    def __init__(self, root: nn.Module, device, pinned=False, tag=_no_tag, recorder=None, phase=_no_phase):
        super().__init__(device, pinned, tag, recorder, phase)
        owners = [(name, module) for name, module in root.named_modules() if list(module.parameters(recurse=False))]
        masters = self._pack([list(module.parameters(recurse=False)) for _, module in owners])
        for (name, module), master in zip(owners, masters):
            load = functools.partial(self._load, name, master)
            drop = functools.partial(self._drop, name, master)
            self.hooks.append(module.register_forward_pre_hook(load))
            self.hooks.append(module.register_forward_hook(drop, always_call=True))

    def _load(self, name: str, master: HostMaster, module, args) -> None:
        self._mark("transfer_start", name, nbytes=master.nbytes)
        master.attach(self._copy_in(master))  # (1)!
        self._mark("transfer_end", name)

    def _drop(self, name: str, master: HostMaster, module, args, output) -> None:
        master.detach()
        self._mark("evict", name)
# --8<-- [end:sequential]


class LayerwiseOffload(OffloadHandle):
    """Blocks stream through the device: block i computes while blocks i+1..i+k are copied in."""

    def __init__(self, blocks: nn.ModuleList, device, prefetch_depth: int = 1, pinned=True, tag=_no_tag,
                 recorder=None, name: str = "block", phase=_no_phase) -> None:
        if not 0 <= prefetch_depth < len(blocks):  # k = n-1 already keeps every block resident
            raise ValueError(f"prefetch depth must be 0 to {len(blocks) - 1} for {len(blocks)} blocks, "
                             f"got {prefetch_depth}")
        super().__init__(device, pinned, tag, recorder, phase)
        self.n, self.k = len(blocks), prefetch_depth
        self.names = [f"{name}.{i}" for i in range(self.n)]
        self._pack([list(b.parameters()) for b in blocks])  # one flat region per block
        self.buffers: list[torch.Tensor | None] = [None] * self.n
        self.ready: list = [None] * self.n  # CUDA events: "block j's copy has landed"
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.max_resident = 0
        for i, block in enumerate(blocks):
            self.hooks.append(block.register_forward_pre_hook(functools.partial(self._pre, i)))
            self.hooks.append(block.register_forward_hook(functools.partial(self._post, i), always_call=True))

    # --8<-- [start:prefetch]
    def _prefetch(self, j: int) -> None:
        if self.buffers[j] is not None:
            return  # resident already, or its copy is on the way
        master = self.masters[j]
        if self.copy_stream is None:  # CPU: no second stream, the copy happens now
            self._mark("prefetch_start", self.names[j], "copy", master.nbytes)
            self.buffers[j] = self._copy_in(master)
            self._mark("ready", self.names[j], "copy")
        else:
            with self.phase("transfer"), self.tag("parameters"):
                buf = torch.empty(master.nbytes, dtype=torch.uint8, device=self.device)  # (1)!
            copy = self.copy_stream
            copy.wait_stream(torch.cuda.current_stream(self.device))  # (2)!
            with torch.cuda.stream(copy):
                self._mark("prefetch_start", self.names[j], "copy", master.nbytes, copy)
                buf.copy_(master.flat, non_blocking=self.pinned)  # (3)!
                self._mark("ready", self.names[j], "copy", stream=copy)
                self.ready[j] = torch.cuda.Event()
                self.ready[j].record(copy)
            self.buffers[j] = buf
            self.h2d_bytes += master.nbytes
        self.max_resident = max(self.max_resident, self.resident())
    # --8<-- [end:prefetch]
    # --8<-- [start:hooks]
    def _pre(self, i: int, module, args) -> None:
        self._prefetch(i)  # a no-op when block i was prefetched
        if self.ready[i] is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready[i])  # (1)!
        self.masters[i].attach(self.buffers[i])
        for ahead in range(1, self.k + 1):
            self._prefetch((i + ahead) % self.n)  # (2)!
        self._mark("compute_start", self.names[i])

    def _post(self, i: int, module, args, output) -> None:
        self._mark("compute_end", self.names[i])
        self.masters[i].detach()  # (3)!
        self.buffers[i] = self.ready[i] = None
        self._mark("evict", self.names[i])
    # --8<-- [end:hooks]

    def settle(self) -> None:
        for j, buf in enumerate(self.buffers):
            if buf is not None:
                if self.ready[j] is not None:  # let an in-flight copy land before the memory is reused
                    torch.cuda.current_stream(self.device).wait_event(self.ready[j])
                self.buffers[j] = self.ready[j] = None
                self._mark("evict", self.names[j])

    def resident(self) -> int:
        return sum(b is not None for b in self.buffers)

    def remove(self) -> None:
        self.settle()
        super().remove()
