"""Lab 07 - optimizer offload on one device (ZeRO-Offload): AdamW state on the host, not the GPU.

    none        device AdamW: parameters, gradients and both moments on the device (with bf16
                weights, ``--precision bf16``, also the fp32 master copy AdamW updates)
    optimizer   fp32 master parameters and AdamW state on the host (Lab 08's HostMaster, pinned on
                CUDA). Each gradient goes to the host as soon as backward has accumulated it, AdamW
                steps there, the updated parameters come back: 8 bytes per parameter off the device
                in fp32, 12 with bf16 weights (whose gradients and weights cross the bus in bf16).
    gradients   the same, and each device gradient is released once copied: 4 (or 2) bytes more.

Every mode is checked against device AdamW: equal parameters after N steps, bit for bit on CPU when
both sides run the same AdamW implementation (``--impl``). ``--model llama-3-8b --fake`` runs the
same three modes on a real architecture, traced on fake tensors (bytes, no values, no time).

Run it:
    .venv/bin/python code/lab-07-optimizer-offload/optimizer_offload.py --device cpu
    .venv/bin/python code/lab-07-optimizer-offload/optimizer_offload.py --offload gradients --impl forloop --json
    .venv/bin/python code/lab-07-optimizer-offload/optimizer_offload.py --model llama-3-8b --fake --precision bf16 --seq-len 4096 --batch-size 1 --steps 2
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn as nn
from offload_accounting import BusCopies
from torch._subclasses.fake_tensor import DataDependentOutputException
from training_harness import Result, Run, report, require_memory, token_source

from labkit import cli, labs, marks
from labkit.config import MAX_BATCH, MAX_LR, MAX_STEPS, LabConfig, UsageError, option
from labkit.cuda import allocator_stats, record_snapshot, reset_peak
from labkit.ledger import Ledger
from labkit.models import TinyGPT, TinyGPTShape
from labkit.scale import RealScale

HostMaster = labs.load(8, "offload_engines").HostMaster  # Lab 08's flat host buffer, a view per parameter
lab02 = labs.load(2)  # its train_step: zero_grad, forward, backward, step, each a marked phase

MODES = ("none", "optimizer", "gradients")
IMPLS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "forloop": {"foreach": False}}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# --8<-- [start:master]
class Float32Master(HostMaster):
    """Lab 08's HostMaster kept in float32 whatever the parameters' dtype: the weights AdamW updates."""

    @staticmethod
    def plan(params: list[torch.Tensor]) -> tuple[list, int]:
        # each parameter's shape in float32, on the meta device: a layout, no memory
        return HostMaster.plan([torch.empty(p.shape, dtype=torch.float32, device="meta") for p in params])
# --8<-- [end:master]


# --8<-- [start:engine]
class OptimizerOffload:
    """AdamW with fp32 master parameters and both moments on the host (ZeRO-Offload on one device).

    One backward per step: the hooks copy (not add) each gradient into its host buffer; then one
    AdamW step over every host parameter that received a gradient. Device weights in bf16 cross the
    bus in bf16 (a staging buffer on the host) and are widened to fp32 there. With
    ``offload_grads`` on a copy stream, a released device gradient is kept until its copy's event has
    completed; past ``in_flight`` such gradients the compute stream waits for the oldest copy.
    """

    def __init__(self, params, lr: float, weight_decay: float, impl: str = "fused",
                 offload_grads: bool = False, overlap: bool = True, in_flight: int = 4) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.device = self.params[0].device
        cuda = self.device.type == "cuda"
        self.offload_grads = offload_grads
        self.master = Float32Master(self.params, pinned=cuda)  # (1)!
        self.grad_flat = torch.zeros(self.master.nbytes, dtype=torch.uint8, pin_memory=cuda)  # (2)!
        self.host, self.host_grads = self.master.views(self.master.flat), self.master.views(self.grad_flat)
        narrow = self.params[0].dtype != torch.float32
        self.staging = HostMaster(self.params, pinned=cuda) if narrow else None  # (3)!
        self.landing = self.staging.views(self.staging.flat) if narrow else self.host_grads
        self.optimizer = torch.optim.AdamW(self.host, lr=lr, weight_decay=weight_decay, **IMPLS[impl])  # (4)!
        self.stream = torch.cuda.Stream(self.device) if cuda and overlap else None  # (5)!
        self.landed = None  # CUDA event: "every gradient copy queued so far is on the host"
        self.arrived: list[int] = []  # parameter indices, in the order backward finished them
        self.in_flight: deque[tuple[torch.Tensor, torch.cuda.Event]] = deque()  # released, copy maybe not run
        self.max_in_flight = in_flight
        self.hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, i))
                      for i, p in enumerate(self.params)]  # (6)!
    # --8<-- [end:engine]

    # --8<-- [start:hook]
    def _grad_ready(self, i: int, param: torch.Tensor) -> None:
        host_grad = self.landing[i]  # the fp32 gradient buffer, or the staging buffer in bf16
        if self.stream is None:  # CPU, or --overlap off: the copy happens now and the host waits
            host_grad.copy_(param.grad)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # (1)!
            with torch.cuda.stream(self.stream):
                host_grad.copy_(param.grad, non_blocking=True)  # (2)!
            self.landed = self.stream.record_event()  # (3)!
            if self.offload_grads:
                self.in_flight.append((param.grad, self.landed))  # (4)!
                self._release(self.max_in_flight)
        if self.offload_grads:
            param.grad = None  # (5)!
        self.host[i].grad = self.host_grads[i]  # (6)!
        self.arrived.append(i)

    def _release(self, limit: int) -> None:
        """Let go of device gradients whose copy has run; past ``limit`` outstanding, the compute
        stream first waits (on the GPU) for the oldest copy, so its memory's next user runs after it."""
        while self.in_flight:
            _, copied = self.in_flight[0]
            if len(self.in_flight) <= limit and not copied.query():
                return
            torch.cuda.current_stream(self.device).wait_event(copied)
            self.in_flight.popleft()  # the last reference: the allocator may reuse the block now
    # --8<-- [end:hook]

    # --8<-- [start:step]
    def step(self) -> None:
        if self.stream is not None:
            # The copies up overwrite device parameters. The copy stream last waited for the compute
            # stream in the last gradient hook; a kernel queued since may still read a parameter.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # (1)!
        if self.landed is not None:
            self.landed.synchronize()  # (2)!
        self.in_flight.clear()  # every copy down has run: the kept device gradients can go
        if self.staging is not None:
            for i in self.arrived:
                self.host_grads[i].copy_(self.landing[i])  # (3)!
        with marks.category("host_copies"):
            self.optimizer.step()  # (4)!
        self.optimizer.zero_grad()  # (5)!
        for i in self.arrived:
            param, host = self.params[i].detach(), self.host[i]
            if self.staging is not None:
                host = self.landing[i].copy_(host)  # (6)!
            with torch.cuda.stream(self.stream):  # no-op without one
                param.copy_(host, non_blocking=self.stream is not None)  # (7)!
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)  # (8)!
        self.arrived.clear()
        self.landed = None
    # --8<-- [end:step]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None  # the host gradients are overwritten by the next backward's copies

    def host_buffers(self) -> list[torch.Tensor]:
        """The flat host buffers (master, gradients, bf16 staging); AdamW's moments are born inside ``step``."""
        return [self.master.flat, self.grad_flat] + ([self.staging.flat] if self.staging else [])

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()


# --8<-- [start:device-master]
class MasterAdamW:
    """Device AdamW for bf16 weights: an fp32 master copy of every parameter and AdamW's moments, on
    the device (mixed-precision training's 16 bytes per parameter: 2 + 2 + 4 + 8)."""

    def __init__(self, params, lr: float, weight_decay: float, impl: str = "fused") -> None:
        self.params = [p for p in params if p.requires_grad]
        self.master = [p.detach().float() for p in self.params]  # (1)!
        self.optimizer = torch.optim.AdamW(self.master, lr=lr, weight_decay=weight_decay, **IMPLS[impl])

    def step(self) -> None:
        for p, master in zip(self.params, self.master):
            master.grad = None if p.grad is None else p.grad.float()  # (2)!
        self.optimizer.step()
        for p, master in zip(self.params, self.master):
            p.detach().copy_(master)  # (3)!
            master.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
# --8<-- [end:device-master]


# --8<-- [start:install]
def install(mode: str, model: nn.Module, *, lr: float, weight_decay: float, impl: str = "fused", overlap: bool = True):
    """Device AdamW (``mode`` none) or AdamW offloaded to the host (optimizer, gradients) for
    ``model``'s parameters; both have ``zero_grad`` and ``step``. ``lr``, ``weight_decay``: AdamW's;
    ``impl``: fused, foreach or forloop, on either side; ``overlap``: CUDA, a copy stream and events."""
    if mode == "none" and next(model.parameters()).dtype == torch.float32:
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, **IMPLS[impl])  # (1)!
    if mode == "none":
        return MasterAdamW(model.parameters(), lr, weight_decay, impl)  # (2)!
    return OptimizerOffload(model.parameters(), lr, weight_decay, impl, offload_grads=mode == "gradients",
                            overlap=overlap)  # (3)!
# --8<-- [end:install]


@functools.cache
def fused_cpu_adamw_available() -> bool:
    """``AdamW(fused=True)`` on CPU tensors arrived in torch 2.4; older versions refuse it."""
    try:
        torch.optim.AdamW([torch.zeros(1, requires_grad=True)], fused=True)
    except (RuntimeError, TypeError, ValueError):
        return False
    return True


@dataclass
class Config(RealScale, TinyGPTShape, LabConfig):
    """Train a toy GPT (or, with --model, a real one) with AdamW on the device, or offloaded to the host."""

    offload: Literal["none", "optimizer", "gradients", "all"] = option(
        "all", "none: device AdamW; optimizer: AdamW state on the host; gradients: and the gradients")
    precision: Literal["fp32", "bf16"] = option(
        "fp32", "the device weights and gradients; bf16: with an fp32 master and fp32 AdamW state where AdamW runs")
    impl: Literal["fused", "foreach", "forloop"] = option("fused", "the AdamW implementation, both sides")
    overlap: Literal["on", "off"] = option(
        "on", "CUDA: copy stream and events (on) or blocking copies on the compute stream (off)")
    steps: int = option(4, "training steps per mode", min=1, max=MAX_STEPS)
    lr: float = option(3e-3, "AdamW learning rate, both sides", above=0, max=MAX_LR)
    weight_decay: float = option(0.01, "AdamW weight decay, both sides", min=0, max=MAX_LR)
    batch_size: int = option(8, "sequences per step", min=1, max=MAX_BATCH)
    dropout: float = option(0.1, "dropout probability", min=0, below=1)
    snapshot: Path | None = option(None, "CUDA only: write a memory_viz history pickle here", path="write")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.impl == "fused" and not fused_cpu_adamw_available():
            raise UsageError(f"torch {torch.__version__} has no fused CPU AdamW (torch >= 2.4): use --impl foreach")


def run(config: Config) -> Result:
    device = torch.device("cpu") if config.fake else cli.pick_device(config.device)  # a trace: CPU dispatch
    if config.snapshot and device.type != "cuda":
        raise UsageError("--snapshot needs a CUDA device (memory history is a CUDA allocator feature)")
    require_memory(config, device)  # too big for the machine: refused (a --fake run allocates nothing)
    modes = MODES if config.offload == "all" else dict.fromkeys(("none", config.offload))  # none: the reference
    with record_snapshot(config.snapshot):
        runs = [run_mode(mode, config, device) for mode in modes]
    return Result(config, device, runs)


def run_mode(mode: str, config: Config, device, measured: bool = True) -> Run:
    """Train ``config.steps`` steps in ``mode`` from the same seed. ``measured``: under the memory
    ledger and a copy counter (both cost time per op); otherwise a plain run, for the step time.
    With ``config.fake`` the whole run is traced on fake tensors: bytes, no values, no time."""
    torch.manual_seed(config.seed)
    with config.tensors():
        model = config.build_model(functools.partial(tiny_model, config), dtype=DTYPES[config.precision])
        model = model if config.fake else model.to(device)  # a fake model lives on the fake cpu device already
        data = token_source(config)
        ledger = Ledger(device).track_module(model) if measured else None
        reset_peak(device)
        losses, step_s, t0 = [], [], time.perf_counter()
        with ledger or contextlib.nullcontext(), contextlib.ExitStack() as watching:
            with marks.phase("install"):  # inside the ledger: its gradient hooks run before the engine's
                optimizer = install(mode, model, lr=config.lr, weight_decay=config.weight_decay, impl=config.impl,
                                    overlap=config.overlap == "on")
            offload = optimizer if isinstance(optimizer, OptimizerOffload) else None
            copies = None
            if ledger and offload:
                ledger.track(offload.host_buffers(), "host_copies")  # labelled from outside
                copies = watching.enter_context(BusCopies(offload.host_buffers()))
            elif ledger and isinstance(optimizer, MasterAdamW):
                ledger.track(optimizer.master, "optimizer_state")  # the fp32 master: AdamW's alone
                ledger.track_optimizer(optimizer.optimizer)
            elif ledger:
                ledger.track_optimizer(optimizer)
            for step in cli.progress(range(config.steps), total=config.steps, desc=mode):
                x, y = data.batch(step, config.batch_size, device)
                t = time.perf_counter()
                if config.fake:  # Lab 02's step ends by reading the loss: a fake tensor has no value to read
                    with contextlib.suppress(DataDependentOutputException):
                        lab02.train_step(model, optimizer, x, y, step)
                    continue
                losses.append(lab02.train_step(model, optimizer, x, y, step))  # .item() waits for the device
                step_s.append(time.perf_counter() - t)
        cuda = allocator_stats(device)
        if offload:
            offload.remove()
        if not config.fake:
            model.cpu()  # frees the device: the next mode's allocator peak is its own
    return Run(mode, model, offload, ledger, copies, losses, step_s, cuda, time.perf_counter() - t0)


def tiny_model(config: Config) -> TinyGPT:
    """The lab's own TinyGPT, from the shape flags, in ``--precision``'s dtype."""
    return TinyGPT(config.model_config()).to(DTYPES[config.precision])


if __name__ == "__main__":
    cli.main(Config, run, report)
