"""Lab 07 - optimizer offload on one device (ZeRO-Offload): AdamW state on the host, not the GPU.

    none        device AdamW: parameters, gradients and both moments on the device
    optimizer   fp32 master parameters and AdamW state on the host (Lab 08's HostMaster, pinned on
                CUDA). Each gradient goes to the host as soon as backward has accumulated it, AdamW
                steps there, the updated parameters come back: 8 bytes per parameter off the device.
    gradients   the same, and each device gradient is released once copied: 4 bytes more.

Every mode is checked against device AdamW: equal parameters after N steps, bit for bit on CPU when
both sides run the same AdamW implementation (``--impl``).

Run it:
    .venv/bin/python code/lab-07-optimizer-offload/optimizer_offload.py --device cpu
    .venv/bin/python code/lab-07-optimizer-offload/optimizer_offload.py --offload gradients --impl forloop --json
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from offload_accounting import MODEL_STATE, after_step, bytes_per_param, checks, largest_difference

from labkit import budget, cli, labs, marks, provenance
from labkit.config import LabConfig, UsageError, option, summary_of
from labkit.cuda import allocator_stats, record_snapshot, reset_peak
from labkit.ledger import Ledger
from labkit.models import SyntheticTokens, TinyGPT, TinyGPTShape
from labkit.schedule import Copies
from labkit.table import Table

HostMaster = labs.load(8, "offload_engines").HostMaster  # Lab 08's flat host buffer, a view per parameter
lab02 = labs.load(2)  # its train_step: zero_grad, forward, backward, step, each a marked phase

MODES = ("none", "optimizer", "gradients")
IMPLS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "forloop": {"foreach": False}}


# --8<-- [start:engine]
class OptimizerOffload:
    """AdamW with fp32 master parameters and both moments on the host (ZeRO-Offload on one device).

    One backward per step: the hooks copy (not add) each gradient into its host buffer; then one
    AdamW step over every host parameter that received a gradient.
    """

    def __init__(self, params, lr: float, weight_decay: float, impl: str = "fused",
                 offload_grads: bool = False, overlap: bool = True) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.device = self.params[0].device
        cuda = self.device.type == "cuda"
        self.offload_grads = offload_grads
        self.master = HostMaster(self.params, pinned=cuda)  # (1)!
        self.grad_flat = torch.zeros(self.master.nbytes, dtype=torch.uint8, pin_memory=cuda)  # (2)!
        self.host, self.host_grads = self.master.views(self.master.flat), self.master.views(self.grad_flat)
        self.optimizer = torch.optim.AdamW(self.host, lr=lr, weight_decay=weight_decay, **IMPLS[impl])  # (3)!
        self.stream = torch.cuda.Stream(self.device) if cuda and overlap else None  # (4)!
        self.landed = None  # CUDA event: "every gradient copy queued so far is on the host"
        self.arrived: list[int] = []  # parameter indices, in the order backward finished them
        self.hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, i))
                      for i, p in enumerate(self.params)]  # (5)!
    # --8<-- [end:engine]

    # --8<-- [start:hook]
    def _grad_ready(self, i: int, param: torch.Tensor) -> None:
        host_grad = self.host_grads[i]
        if self.stream is None:  # CPU, or --overlap off: the copy happens now and the host waits
            host_grad.copy_(param.grad)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # (1)!
            with torch.cuda.stream(self.stream):
                host_grad.copy_(param.grad, non_blocking=True)  # (2)!
            self.landed = self.stream.record_event()  # (3)!
            if self.offload_grads:
                param.grad.record_stream(self.stream)  # (4)!
        if self.offload_grads:
            param.grad = None  # (5)!
        self.host[i].grad = host_grad  # (6)!
        self.arrived.append(i)
    # --8<-- [end:hook]

    # --8<-- [start:step]
    def step(self) -> None:
        if self.stream is not None:
            # The copies up overwrite device parameters. The copy stream last waited for the compute
            # stream in the last gradient hook; a kernel queued since may still read a parameter.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # (1)!
        if self.landed is not None:
            self.landed.synchronize()  # (2)!
        with marks.category("host_copies"):
            self.optimizer.step()  # (3)!
        self.optimizer.zero_grad()  # (4)!
        for i in self.arrived:
            param, host = self.params[i].detach(), self.host[i]
            with torch.cuda.stream(self.stream):  # no-op without one
                param.copy_(host, non_blocking=self.stream is not None)  # (5)!
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)  # (6)!
        self.arrived.clear()
        self.landed = None
    # --8<-- [end:step]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None  # the host gradients are overwritten by the next backward's copies

    def host_buffers(self) -> list[torch.Tensor]:
        """The flat host buffers (master, gradients); AdamW's moments are born inside ``step``."""
        return [self.master.flat, self.grad_flat]

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()


# --8<-- [start:install]
def install(mode: str, model: TinyGPT, *, lr: float, weight_decay: float, impl: str = "fused", overlap: bool = True):
    """Device AdamW (``mode`` none) or AdamW offloaded to the host (optimizer, gradients) for
    ``model``'s parameters; both have ``zero_grad`` and ``step``. ``lr``, ``weight_decay``: AdamW's;
    ``impl``: fused, foreach or forloop, on either side; ``overlap``: CUDA, a copy stream and events."""
    if mode == "none":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, **IMPLS[impl])  # (1)!
    return OptimizerOffload(model.parameters(), lr, weight_decay, impl, offload_grads=mode == "gradients",
                            overlap=overlap)  # (2)!
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
class Config(TinyGPTShape, LabConfig):
    """Train a toy GPT with AdamW on the device, or with AdamW offloaded to the host."""

    offload: Literal["none", "optimizer", "gradients", "all"] = option(
        "all", "none: device AdamW; optimizer: AdamW state on the host; gradients: and the gradients")
    impl: Literal["fused", "foreach", "forloop"] = option("fused", "the AdamW implementation, both sides")
    overlap: Literal["on", "off"] = option(
        "on", "CUDA: copy stream and events (on) or blocking copies on the compute stream (off)")
    steps: int = option(4, "training steps per mode", min=1)
    lr: float = option(3e-3, "AdamW learning rate, both sides", above=0)
    weight_decay: float = option(0.01, "AdamW weight decay, both sides", min=0)
    batch_size: int = option(8, "sequences per step", min=1)
    dropout: float = option(0.1, "dropout probability", min=0, below=1)
    snapshot: Path | None = option(None, "CUDA only: write a memory_viz history pickle here")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.impl == "fused" and not fused_cpu_adamw_available():
            raise UsageError(f"torch {torch.__version__} has no fused CPU AdamW (torch >= 2.4): use --impl foreach")



def run(config: Config) -> Result:
    device = cli.pick_device(config.device)
    if config.snapshot and device.type != "cuda":
        raise UsageError("--snapshot needs a CUDA device (memory history is a CUDA allocator feature)")
    budget.require_gpt_training(config.model_config(), config.batch_size, device)  # too big for the machine: refused
    modes = MODES if config.offload == "all" else dict.fromkeys(("none", config.offload))  # none: the reference
    with record_snapshot(config.snapshot):
        runs = [run_mode(mode, config, device) for mode in modes]
    return Result(config, device, runs)


@dataclass
class Run:
    mode: str
    model: TinyGPT
    optimizer: OptimizerOffload | None  # the offload engine (host side), None for device AdamW
    ledger: Ledger | None  # None: a plain run, for time
    copies: Copies | None  # bytes copied to and from the host buffers (under the ledger)
    losses: list[float]
    step_s: list[float]
    cuda: dict | None
    wall_time_s: float


def run_mode(mode: str, config: Config, device, measured: bool = True) -> Run:
    """Train ``config.steps`` steps in ``mode`` from the same seed. ``measured``: under the memory
    ledger and a copy counter (both cost time per op); otherwise a plain run, for the step time."""
    torch.manual_seed(config.seed)
    model = TinyGPT(config.model_config()).to(device)
    data = SyntheticTokens(config.vocab, config.seq_len, seed=config.seed)
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
            copies = watching.enter_context(Copies(offload.host_buffers()))
        elif ledger:
            ledger.track_optimizer(optimizer)
        for step in cli.progress(range(config.steps), total=config.steps, desc=mode):
            x, y = data.batch(step, config.batch_size, device)
            t = time.perf_counter()
            losses.append(lab02.train_step(model, optimizer, x, y, step))  # .item() waits for the device
            step_s.append(time.perf_counter() - t)
    cuda = allocator_stats(device)
    if offload:
        offload.remove()
    model.cpu()  # frees the device: the next mode's allocator peak is its own
    return Run(mode, model, offload, ledger, copies, losses, step_s, cuda, time.perf_counter() - t0)


# ---------------------------------------------------------------------- the result and its report
@dataclass
class Result:
    config: Config
    device: torch.device
    runs: list[Run]

    def mode_summary(self, run: Run) -> dict:
        reference = next(r for r in self.runs if r.mode == "none")
        n, tensors = sum(p.numel() for p in run.model.parameters()), len(list(run.model.parameters()))
        state, tl = after_step(run.ledger), run.ledger.timeline()
        saved = sum(after_step(reference.ledger)[c] - state[c] for c in MODEL_STATE)
        timed = run.step_s[1:] or run.step_s  # the first step allocates AdamW state: left out
        steps = len(run.losses)
        return {"mode": run.mode, "params": n, "tensors": tensors, "losses": run.losses,
                "max_abs_diff_vs_device_adamw": largest_difference(run.model, reference.model)[0],
                "device_after_step": state, "device_saved_bytes": saved, "device_saved_per_param": saved / n,
                "peak_device_bytes": tl.peak()["total"],
                "host_bytes": tl.host["host_copies"][-1],  # master, gradients, AdamW state: labelled host_copies
                "d2h_bytes_per_step": run.copies.into // steps if run.copies else 0,
                "h2d_bytes_per_step": run.copies.out_of // steps if run.copies else 0,
                "step_ms": 1e3 * statistics.median(timed), "cuda": run.cuda}

    def modes(self) -> dict[str, dict]:
        """The summary of each mode asked for (device AdamW, the reference, always runs)."""
        return {r.mode: self.mode_summary(r) for r in self.runs if self.config.offload in ("all", r.mode)}

    def summary(self) -> dict:
        return {"lab": labs.slug(__file__), "device": str(self.device), "config": summary_of(self.config),
                "modes": list(self.modes().values()),
                "provenance": provenance.collect(__file__, self.device, sum(r.wall_time_s for r in self.runs))}


def report(result: Result) -> None:
    modes = result.modes()
    first = next(iter(modes.values()))
    print(f"Lab 07 on {result.device}: TinyGPT with {first['params']:,} parameters in {first['tensors']} tensors, "
          f"{result.config.steps} steps, AdamW impl '{result.config.impl}'"
          + (" (CPU: the device and the host are the same RAM; the ledger keeps them apart)"
             if result.device.type == "cpu" else ""))
    print(Table(["mode", ("device bytes saved", "bytes"), ("per parameter", "float:2"), ("peak device bytes", "bytes"),
                 ("host bytes", "bytes"), ("max abs diff vs device AdamW", "sci:2"), ("ms per step", "float:2")],
                [[m, s["device_saved_bytes"], s["device_saved_per_param"], s["peak_device_bytes"], s["host_bytes"],
                  s["max_abs_diff_vs_device_adamw"], s["step_ms"]] for m, s in modes.items()]).text())
    print("\nBytes per parameter between steps, derived against measured (ledger):")
    print(bytes_per_param(modes).text())
    if result.config.offload == "all":
        engine = next(r.optimizer for r in result.runs if r.optimizer)
        print("\n" + checks(modes, engine.master.nbytes, engine.master.flat.nbytes).text())
    if result.config.snapshot:
        print(f"memory history written to {result.config.snapshot} (open it at https://pytorch.org/memory_viz)")


if __name__ == "__main__":
    cli.main(Config, run, report)
