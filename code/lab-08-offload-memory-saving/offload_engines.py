"""Lab 08 - three offload engines for inference: what moves to the device, and when.

* ``ModelOffload``: a whole component (text encoder, denoiser, decoder) moves in when its forward
  starts; the previous one is dropped then.
* ``SequentialOffload``: every module that owns parameters loads them right before its forward and
  drops them right after. Minimal memory, no overlap: the slow baseline.
* ``LayerwiseOffload``: blocks stream through the device. A copy stream prefetches the next ``k``
  while one computes, so ``k + 1`` are resident; the GPU waits on events, the CPU never waits.

Each keeps the master copy of the weights on the host (``HostMaster``, a region of a
``PinnedArena``) and releases device weights by pointing parameters at an empty placeholder:
inference never writes its weights, so nothing is copied back. Copies are marked for whoever
watches (``labkit.marks``). Every engine is a handle whose ``remove()`` restores the model exactly.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from pinned_arena import PinnedArena
from torch.utils.weak import WeakIdKeyDictionary

from labkit import marks

ALIGN = 64  # bytes; every parameter starts on a 64-byte boundary inside a flat buffer
OWNER: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> the engine that moves it


# --8<-- [start:host-master]
class HostMaster:
    """The host copy of some parameters: ONE flat buffer, each parameter a view."""

    def __init__(self, params: list[nn.Parameter], pinned: bool, flat: torch.Tensor | None = None) -> None:
        self.params = params
        self.layout, self.nbytes = self.plan(params)
        if flat is None:  # a buffer of its own, exactly this size
            flat = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pinned)
        self.flat = flat  # (1)!
        for view, p in zip(self.views(self.flat), params):
            view.copy_(p.data)

    @classmethod
    def packed(cls, units: list[list[nn.Parameter]], pinned: bool):
        """One master per unit, all of them views into one arena of power-of-two chunks."""
        arena = PinnedArena([cls.plan(params)[1] for params in units], pinned)  # (2)!
        return arena, [cls(params, pinned, flat) for params, flat in zip(units, arena.regions)]

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
        return [flat[o:o + n].view(dtype).view(shape) for o, n, dtype, shape, _ in self.layout]

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


class Offload:
    """What the engines share: host masters packed in one arena, the copy in, and ``remove()``."""

    def __init__(self, device, pinned: bool) -> None:
        self.device = torch.device(device)
        self.pinned = pinned and torch.cuda.is_available()  # pinning needs a CUDA driver
        self.hooks: list = []
        self.masters: list[HostMaster] = []
        self.arena: PinnedArena | None = None  # where the masters live

    def claim(self, params: list[nn.Parameter]) -> None:
        """One engine per parameter: a second one would take the first one's placeholders for the
        weights, and its remove() would leave them empty. Refused, in one line."""
        taken = {type(OWNER[p]).__name__ for p in params if p in OWNER}
        if taken:
            raise ValueError(f"these modules already have an offload engine ({', '.join(sorted(taken))}); "
                             "remove() it before installing another")
        for p in params:
            OWNER[p] = self

    def release(self) -> None:
        for p in [p for p, owner in OWNER.items() if owner is self]:
            del OWNER[p]

    def pack(self, units: list[list[nn.Parameter]]) -> list[HostMaster]:
        """Host masters for ``units`` in one arena; each unit's parameters released at once."""
        self.claim([p for params in units for p in params])
        self.arena, masters = HostMaster.packed(units, self.pinned)
        for master in masters:
            master.detach()
        self.masters += masters
        return masters

    # --8<-- [start:copy-in]
    def copy_in(self, master: HostMaster) -> torch.Tensor:
        """A device buffer for ``master``, filled on the current stream."""
        with marks.phase("transfer"), marks.category("parameters"):
            buf = torch.empty(master.nbytes, dtype=torch.uint8, device=self.device)
            buf.copy_(master.flat, non_blocking=self.pinned)
        return buf
    # --8<-- [end:copy-in]

    def host_buffers(self) -> list[torch.Tensor]:
        """The host memory this engine holds: its arena's chunks."""
        return list(self.arena.chunks) if self.arena else []

    def drop_prefetched(self) -> None:
        """Drop what was loaded ahead for work that will not come (see LayerwiseOffload)."""

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()
        for master in self.masters:
            master.restore()
        self.masters.clear()
        self.arena = None  # the chunks go back to the (pinned) allocator
        self.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


class Resident(Offload):
    """No offload: these modules live on the device for the whole run."""

    def __init__(self, modules: dict[str, nn.Module], device) -> None:
        super().__init__(device, pinned=False)
        self.names = list(modules)
        self.homes = [(p, p.device) for m in modules.values() for p in m.parameters()]
        self.claim([p for p, _ in self.homes])
        with marks.category("parameters"):
            for p, _ in self.homes:
                p.data = p.data.to(self.device)

    def remove(self) -> None:
        for p, device in self.homes:
            p.data = p.data.to(device)
        self.homes.clear()
        self.release()


def pieces(module: nn.Module) -> list[list[nn.Parameter]]:
    """A component cut at its seams: its own parameters, each child, each element of a ModuleList
    or Sequential. Smaller units pack tightly into the arena; the component still moves as a whole."""
    out = [list(module.parameters(recurse=False))]
    for child in module.children():
        out += pieces(child) if isinstance(child, (nn.ModuleList, nn.Sequential)) else [list(child.parameters())]
    return [params for params in out if params]


# --8<-- [start:model]
class ModelOffload(Offload):
    """Whole components move in when their forward starts; the previous one is dropped."""

    def __init__(self, components: dict[str, nn.Module], device, pinned=True, skip=()) -> None:
        super().__init__(device, pinned)
        elsewhere = {id(p) for m in skip for p in m.parameters()}  # moved by another engine
        units = {name: [kept for kept in ([p for p in params if id(p) not in elsewhere]
                                          for params in pieces(module)) if kept]
                 for name, module in components.items()}
        masters = iter(self.pack([params for name in units for params in units[name]]))
        self.units = {name: [next(masters) for _ in units[name]] for name in units}
        for name, module in components.items():
            self.hooks.append(module.register_forward_pre_hook(functools.partial(self._pre, name)))
        self.active: str | None = None

    def _pre(self, name: str, module, args) -> None:
        if self.active == name:
            return  # already on the device (the denoiser, from its second step on)
        if self.active is not None:
            for master in self.units[self.active]:
                master.detach()  # (1)!
            marks.event("evict", self.active)
        masters = self.units[name]
        marks.event("transfer_start", name, nbytes=sum(m.nbytes for m in masters))
        for master in masters:
            master.attach(self.copy_in(master))  # (2)!
        marks.event("transfer_end", name)
        self.active = name
# --8<-- [end:model]


# --8<-- [start:sequential]
class SequentialOffload(Offload):
    """Each module that owns parameters loads them right before its forward."""

    def __init__(self, root: nn.Module, device, pinned=False) -> None:
        super().__init__(device, pinned)
        owners = [(name, m) for name, m in root.named_modules() if list(m.parameters(recurse=False))]
        masters = self.pack([list(m.parameters(recurse=False)) for _, m in owners])
        for (name, module), master in zip(owners, masters):
            self.hooks.append(module.register_forward_pre_hook(functools.partial(self._load, name, master)))
            self.hooks.append(module.register_forward_hook(functools.partial(self._drop, name, master),
                                                           always_call=True))

    def _load(self, name: str, master: HostMaster, module, args) -> None:
        marks.event("transfer_start", name, nbytes=master.nbytes)
        master.attach(self.copy_in(master))  # (1)!
        marks.event("transfer_end", name)

    def _drop(self, name: str, master: HostMaster, module, args, output) -> None:
        master.detach()
        marks.event("evict", name)
# --8<-- [end:sequential]


class LayerwiseOffload(Offload):
    """Blocks stream through the device: block i computes while blocks i+1..i+k are copied in."""

    def __init__(self, blocks: nn.ModuleList, device, prefetch_depth: int = 1, pinned=True,
                 name: str = "block") -> None:
        if not 0 <= prefetch_depth < len(blocks):  # k = n-1 already keeps every block resident
            raise ValueError(f"prefetch depth must be 0 to {len(blocks) - 1} for {len(blocks)} blocks, "
                             f"got {prefetch_depth}")
        super().__init__(device, pinned)
        self.n, self.k = len(blocks), prefetch_depth
        self.names = [f"{name}.{i}" for i in range(self.n)]
        self.pack([list(b.parameters()) for b in blocks])  # one flat region per block
        self.buffers: list[torch.Tensor | None] = [None] * self.n  # on the device, or on its way
        self.ready: list = [None] * self.n  # CUDA events: "block j's copy has landed"
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        for i, block in enumerate(blocks):
            self.hooks.append(block.register_forward_pre_hook(functools.partial(self._pre, i)))
            self.hooks.append(block.register_forward_hook(functools.partial(self._post, i), always_call=True))

    # --8<-- [start:prefetch]
    def _prefetch(self, j: int) -> None:
        if self.buffers[j] is not None:
            return  # resident already, or its copy is on the way
        master, copy = self.masters[j], self.copy_stream  # a CPU has no copy stream: the copy happens now
        with marks.phase("transfer"), marks.category("parameters"):
            buf = torch.empty(master.nbytes, dtype=torch.uint8, device=self.device)  # (1)!
        if copy is not None:
            copy.wait_stream(torch.cuda.current_stream(self.device))  # (2)!
        with torch.cuda.stream(copy), marks.stream("copy"):  # no-op without one; buf is the compute stream's
            marks.event("prefetch_start", self.names[j], "copy", master.nbytes, copy)
            buf.copy_(master.flat, non_blocking=self.pinned)  # (3)!
            marks.event("ready", self.names[j], "copy", stream=copy)
            self.ready[j] = copy.record_event() if copy is not None else None
        self.buffers[j] = buf
    # --8<-- [end:prefetch]

    # --8<-- [start:hooks]
    def _pre(self, i: int, module, args) -> None:
        self._prefetch(i)  # a no-op when block i was prefetched
        if self.ready[i] is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready[i])  # (1)!
        self.masters[i].attach(self.buffers[i])
        for ahead in range(1, self.k + 1):
            self._prefetch((i + ahead) % self.n)  # (2)!
        marks.event("compute_start", self.names[i])

    def _post(self, i: int, module, args, output) -> None:
        marks.event("compute_end", self.names[i])
        self.masters[i].detach()  # (3)!
        self.buffers[i] = self.ready[i] = None
        marks.event("evict", self.names[i])
    # --8<-- [end:hooks]

    def drop_prefetched(self) -> None:
        for j, buf in enumerate(self.buffers):
            if buf is not None:
                if self.ready[j] is not None:  # let an in-flight copy land before the memory is reused
                    torch.cuda.current_stream(self.device).wait_event(self.ready[j])
                self.buffers[j] = self.ready[j] = None
                marks.event("evict", self.names[j])

    def resident(self) -> int:
        """Blocks on the device now: the one computing and those prefetched."""
        return sum(b is not None for b in self.buffers)

    def remove(self) -> None:
        self.drop_prefetched()
        super().remove()
