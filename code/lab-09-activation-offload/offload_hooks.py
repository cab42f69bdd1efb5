"""Saved-tensor hooks that keep activations on the host: PyTorch's save_on_cpu, and a streamed one.

``StreamedOffload`` is a ``torch.autograd.graph.saved_tensors_hooks``: autograd calls ``pack`` in
forward each time an op saves a tensor for backward, and ``unpack`` in backward when the op's
gradient needs it back. ``pack`` copies the tensor to a (pinned) host buffer on a copy stream and
lets the device copy go once it has landed; ``unpack`` hands back a device copy that was fetched
ahead. Tiny tensors, tensors that live on the device anyway (parameters, the batch) and the last
few saved tensors stay on the device.

``LabelledSaveOnCpu`` runs PyTorch's own ``save_on_cpu`` hooks.

Both allocate their host buffers inside ``marks.category("host_copies")``: when a memory ledger
watches, those buffers, and nothing else, are host copies; when none does, the mark costs nothing.
"""

from __future__ import annotations

import weakref
from collections import deque

import torch
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks

from labkit import marks


def storage_of(t: torch.Tensor) -> int:
    """Which storage ``t`` is a view of: the same number for every view of it. (``data_ptr`` says the
    same of a real tensor, but every fake tensor's is 0.)"""
    return t.untyped_storage()._cdata


class Saved:
    """One saved tensor: on the device, on its way out, on the host, or on its way back."""

    __slots__ = ("index", "device", "host", "copied", "fetched", "ready", "__weakref__")

    def __init__(self, t: torch.Tensor, index: int | None = None) -> None:
        self.index, self.device, self.host = index, t, None
        self.copied = self.fetched = self.ready = None  # CUDA events, the fetched copy

    def offloaded(self) -> bool:
        """Off the device and not read yet: on the host, or on its way back."""
        return self.device is None and (self.host is not None or self.fetched is not None)


# --8<-- [start:streamed]
class StreamedOffload(saved_tensors_hooks):
    """Saved tensors wait in pinned host memory and come back ahead of need."""

    def __init__(self, device, keep_last=2, min_bytes=4096, prefetch=2, resident=(), in_flight=4):
        """Hooks for one step on ``device``: the last ``keep_last`` offloadable saved tensors and those
        under ``min_bytes`` stay, ``prefetch`` come back ahead of need, the storages of ``resident``
        (parameters, the batch) never move, at most ``in_flight`` copies out are outstanding."""
        super().__init__(self.pack, self.unpack)
        self.device = device
        self.keep_last, self.min_bytes = keep_last, min_bytes
        self.prefetch, self.max_in_flight = prefetch, in_flight
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None  # (1)!
        self.resident = {storage_of(t) for t in resident}
        self.queue: list[weakref.ref] = []  # offloadable tensors, forward order
        self.in_flight: deque[Saved] = deque()  # copies out, maybe not landed
        self.d2h_bytes = self.h2d_bytes = 0
        self.moved = self.stayed = self.on_demand = 0

    def pack(self, t: torch.Tensor) -> Saved:
        nbytes = t.numel() * t.element_size()
        elsewhere = t.device != self.device or storage_of(t) in self.resident
        if nbytes < max(self.min_bytes, 1) or elsewhere:
            self.stayed += nbytes > 0
            return Saved(t.detach())  # (2)!
        saved = Saved(t.detach(), index=len(self.queue))
        self.queue.append(weakref.ref(saved))
        if len(self.queue) > self.keep_last:  # (3)!
            older = self.queue[-1 - self.keep_last]()
            if older is not None:
                self._offload(older)
        return saved

    def unpack(self, saved: Saved) -> torch.Tensor:
        self._drain(self.max_in_flight)
        if saved.device is not None:
            t = saved.device  # kept, or its copy out not landed: no transfer
        else:
            if not saved.offloaded():
                raise RuntimeError("offloaded tensors are read once")
            if saved.fetched is None:
                self._fetch(saved)  # (4)!
                self.on_demand += 1
            if saved.ready is not None:
                self._compute().wait_event(saved.ready)  # (5)!
            t, saved.fetched, saved.ready = saved.fetched, None, None
        ahead, j = 0, (saved.index or 0) - 1
        while ahead < self.prefetch and j >= 0:  # (6)!
            nxt = self.queue[j]()
            if nxt is not None and nxt.offloaded():
                ahead += 1
                if nxt.fetched is None:
                    self._fetch(nxt)
            j -= 1
        return t
# --8<-- [end:streamed]

    def _compute(self):
        return torch.cuda.current_stream(self.device)

    # --8<-- [start:copies]
    def _offload(self, saved: Saved) -> None:
        """Device to host, in forward. The host never waits for it."""
        t, pin = saved.device, self.stream is not None
        with marks.category("host_copies"):
            saved.host = torch.empty_like(t, device="cpu", pin_memory=pin)  # (1)!
        self.d2h_bytes += t.numel() * t.element_size()
        self.moved += 1
        if self.stream is None:
            saved.host.copy_(t)  # CPU: no copy engine, the copy happens now
            saved.device = None
            return
        self.stream.wait_stream(self._compute())  # (2)!
        with torch.cuda.stream(self.stream), marks.stream("copy"):
            saved.host.copy_(t, non_blocking=True)  # (3)!
            saved.copied = self.stream.record_event()
        self.in_flight.append(saved)
        self._drain(self.max_in_flight)

    def _drain(self, limit: int) -> None:
        """Drop device tensors whose copy has landed; past ``limit``, wait."""
        while self.in_flight:
            oldest = self.in_flight[0]
            if len(self.in_flight) <= limit and not oldest.copied.query():  # (4)!
                return
            self._compute().wait_event(oldest.copied)  # (5)!
            oldest.device = None
            self.in_flight.popleft()

    def _fetch(self, saved: Saved) -> None:
        """Host to device, in backward, ahead of need."""
        buf = torch.empty_like(saved.host, device=self.device)  # (6)!
        if self.stream is None:
            buf.copy_(saved.host)
        else:
            self.stream.wait_stream(self._compute())
            with torch.cuda.stream(self.stream), marks.stream("copy"):
                buf.copy_(saved.host, non_blocking=True)
                saved.ready = self.stream.record_event()  # (7)!
        saved.fetched, saved.host = buf, None  # read once: the host copy can go
        self.h2d_bytes += buf.numel() * buf.element_size()
    # --8<-- [end:copies]


# --8<-- [start:save-on-cpu]
class LabelledSaveOnCpu(saved_tensors_hooks):
    """PyTorch's save_on_cpu, its own two hooks, its host copies labelled."""

    def __init__(self, device):
        inner = save_on_cpu(pin_memory=True)  # (1)!
        self.d2h_bytes = self.h2d_bytes = self.moved = 0

        def pack(t):
            with marks.category("host_copies"):  # (2)!
                packed = inner.pack_hook(t)
            self.d2h_bytes += t.numel() * t.element_size()
            self.moved += 1
            return packed

        def unpack(packed):
            t = inner.unpack_hook(packed)
            self.h2d_bytes += t.numel() * t.element_size()
            return t.clone() if device.type == "cpu" else t  # (3)!

        super().__init__(pack, unpack)
# --8<-- [end:save-on-cpu]
