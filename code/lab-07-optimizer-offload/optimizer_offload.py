"""Lab 07 - optimizer offload on one device (ZeRO-Offload): AdamW state on the host, not the GPU.

    none        device AdamW: parameters, gradients and both moments on the device
    optimizer   fp32 master parameters and AdamW state on the host (Lab 08's HostMaster, pinned on
                CUDA). Each gradient goes to the host as soon as backward has accumulated it, AdamW
                steps there, the updated parameters come back: 8 bytes per parameter off the device.
    gradients   the same, and each device gradient is released once copied: 4 bytes more.

Every mode is checked against device AdamW: equal parameters after N steps, bit for bit on CPU when
both sides run the same AdamW implementation (``--impl``).

Run it:
    python code/lab-07-optimizer-offload/optimizer_offload.py --device cpu
    python code/lab-07-optimizer-offload/optimizer_offload.py --offload gradients --impl forloop --json
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # makes code/labkit importable
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lab-08-offload-memory-saving"))  # Lab 08's HostMaster
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lab-02-single-gpu-training"))  # Lab 02's train_step

import torch  # noqa: E402

from labkit import GPTConfig, Ledger, SyntheticTokens, TinyGPT, UsageError, emit_json  # noqa: E402
from labkit import lab_parser, pick_device, progress, provenance, run_lab  # noqa: E402
from labkit.cli import non_negative_float, positive_float, positive_int, probability  # noqa: E402
from labkit.cuda import allocator_stats, record_snapshot, reset_peak  # noqa: E402
from labkit.ledger import NullLedger  # noqa: E402
from labkit.plot import format_bytes  # noqa: E402
from offload_engines import HostMaster  # noqa: E402
from train_single_gpu import train_step  # noqa: E402  (zero_grad, forward, backward, step: each a ledger phase)

LAB = "lab-07-optimizer-offload"
MODES = ("none", "optimizer", "gradients")
IMPLS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "forloop": {"foreach": False}}
MODEL_STATE = ("parameters", "gradients", "optimizer_state")


@functools.cache
def fused_cpu_adamw_available() -> bool:
    """``AdamW(fused=True)`` on CPU tensors arrived in torch 2.4; older versions refuse it."""
    try:
        torch.optim.AdamW([torch.zeros(1, requires_grad=True)], fused=True)
    except (RuntimeError, TypeError, ValueError):
        return False
    return True


# --8<-- [start:config]
def parse_args(argv=None):
    p = lab_parser("Train a toy GPT with AdamW on the device, or with AdamW offloaded to the host.")
    p.add_argument("--offload", choices=[*MODES, "all"], default="all",
                   help="none: device AdamW; optimizer: AdamW state on the host; gradients: and the gradients")
    p.add_argument("--impl", choices=list(IMPLS), default="fused", help="the AdamW implementation, both sides")
    p.add_argument("--overlap", choices=["on", "off"], default="on",
                   help="CUDA: copy stream and events (on) or blocking copies on the compute stream (off)")
    p.add_argument("--steps", type=positive_int, default=4)
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--seq-len", type=positive_int, default=64)
    p.add_argument("--lr", type=positive_float, default=3e-3)
    p.add_argument("--weight-decay", type=non_negative_float, default=0.01)
    p.add_argument("--width", type=positive_int, default=128)
    p.add_argument("--layers", type=positive_int, default=2)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--vocab", type=positive_int, default=256)
    p.add_argument("--dropout", type=probability, default=0.1)
    p.add_argument("--snapshot", type=Path, help="CUDA only: a memory_viz history pickle")
    args = p.parse_args(argv)
    if args.width % args.heads:
        raise UsageError(f"--width {args.width} is not divisible by --heads {args.heads}")
    if args.impl == "fused" and not fused_cpu_adamw_available():
        raise UsageError(f"torch {torch.__version__} has no fused CPU AdamW (torch >= 2.4): use --impl foreach")
    return args
# --8<-- [end:config]


def _no_tag(category: str):
    return contextlib.nullcontext()


# --8<-- [start:engine]
class OptimizerOffload:
    """AdamW with fp32 master parameters and both moments on the host (ZeRO-Offload on one device).

    One backward per step: the hooks copy (not add) each gradient into its host buffer; then one
    AdamW step over every host parameter that received a gradient.
    """

    def __init__(self, params, lr: float, weight_decay: float, impl: str = "fused",
                 offload_grads: bool = False, overlap: bool = True, tag=_no_tag) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.device = self.params[0].device
        cuda = self.device.type == "cuda"
        self.offload_grads, self.tag = offload_grads, tag
        self.master = HostMaster(self.params, pinned=cuda, tag=tag)  # (1)!
        with tag("host_copies"):
            self.grad_flat = torch.zeros(self.master.nbytes, dtype=torch.uint8, pin_memory=cuda)  # (2)!
        self.host, self.host_grads = self.master.views(self.master.flat), self.master.views(self.grad_flat)
        self.optimizer = torch.optim.AdamW(self.host, lr=lr, weight_decay=weight_decay, **IMPLS[impl])  # (3)!
        self.stream = torch.cuda.Stream(self.device) if cuda and overlap else None  # (4)!
        self.landed = None  # CUDA event: "every gradient copy queued so far is on the host"
        self.arrived: list[int] = []  # parameter indices, in the order backward finished them
        self.d2h_bytes = self.h2d_bytes = 0
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
        self.d2h_bytes += host_grad.nbytes
    # --8<-- [end:hook]

    # --8<-- [start:step]
    def step(self) -> None:
        if self.stream is not None:
            # The copies up overwrite device parameters. The copy stream last waited for the compute
            # stream in the last gradient hook; a kernel queued since may still read a parameter.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # (1)!
        if self.landed is not None:
            self.landed.synchronize()  # (2)!
        with self.tag("host_copies"):
            self.optimizer.step()  # (3)!
        self.optimizer.zero_grad()  # (4)!
        for i in self.arrived:
            param, host = self.params[i].detach(), self.host[i]
            if self.stream is None:
                param.copy_(host)
            else:
                with torch.cuda.stream(self.stream):
                    param.copy_(host, non_blocking=True)  # (5)!
            self.h2d_bytes += host.nbytes
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)  # (6)!
        self.arrived.clear()
        self.landed = None
    # --8<-- [end:step]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None  # the host gradients are overwritten by the next backward's copies

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()


# --8<-- [start:install]
def install(mode: str, model: TinyGPT, args, ledger):
    """Device AdamW (``none``) or AdamW offloaded to the host; both have ``zero_grad`` and ``step``."""
    if mode == "none":
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                                      **IMPLS[args.impl])  # (1)!
        ledger.track_optimizer(optimizer)
        return optimizer
    return OptimizerOffload(model.parameters(), args.lr, args.weight_decay, args.impl,
                            offload_grads=mode == "gradients", overlap=args.overlap == "on",
                            tag=ledger.category)  # (2)!
# --8<-- [end:install]


@dataclass
class Run:
    mode: str
    model: TinyGPT
    optimizer: OptimizerOffload | None  # the offload engine (host side), None for device AdamW
    ledger: Ledger
    losses: list[float]
    step_s: list[float]
    device: torch.device
    cuda: dict | None
    wall_time_s: float


def config(args) -> GPTConfig:
    return GPTConfig(vocab=args.vocab, seq_len=args.seq_len, width=args.width, layers=args.layers,
                     heads=args.heads, dropout=args.dropout)


def run_mode(mode: str, args, device: torch.device, ledger_on: bool = True) -> Run:
    """Train ``args.steps`` steps in ``mode`` from the same seed; ``ledger_on=False`` for timing runs."""
    torch.manual_seed(args.seed)
    model = TinyGPT(config(args)).to(device)
    data = SyntheticTokens(args.vocab, args.seq_len, seed=args.seed)
    ledger = (Ledger(device) if ledger_on else NullLedger(device)).track_module(model)
    reset_peak(device)
    losses, step_s, t0 = [], [], time.perf_counter()
    with ledger:
        with ledger.phase("install"):
            optimizer = install(mode, model, args, ledger)  # inside the ledger: its gradient hooks run first
        for step in progress(range(args.steps), total=args.steps, desc=mode, quiet=args.json):
            x, y = data.batch(step, args.batch_size, device)
            t = time.perf_counter()
            losses.append(train_step(model, optimizer, x, y, step))  # .item() waits for the device
            step_s.append(time.perf_counter() - t)
    cuda = allocator_stats(device)
    offload = optimizer if isinstance(optimizer, OptimizerOffload) else None  # device AdamW's state dies here
    if offload:
        offload.remove()
    model.cpu()  # frees the device: the next mode's allocator peak is its own
    return Run(mode, model, offload, ledger, losses, step_s, device, cuda, time.perf_counter() - t0)


def run_all(args) -> list[Run]:
    device = pick_device(args.device)
    if args.snapshot and device.type != "cuda":
        raise UsageError("--snapshot needs a CUDA device (memory history is a CUDA allocator feature)")
    modes = MODES if args.offload == "all" else dict.fromkeys(("none", args.offload))  # none: the reference
    with record_snapshot(args.snapshot):
        return [run_mode(mode, args, device) for mode in modes]


def after_step(ledger: Ledger) -> dict[str, int]:
    """Device bytes by category at the end of the last optimizer phase: the model state between steps."""
    tl = ledger.timeline()
    last = max((s for s in tl.spans if s.name == "optimizer"), key=lambda s: s.end)
    return tl.row(last.end - 1)


def summary(run: Run, reference: Run) -> dict:
    params = [p for p in run.model.parameters()]
    n = sum(p.numel() for p in params)
    state, tl = after_step(run.ledger), run.ledger.timeline()
    saved = sum(after_step(reference.ledger)[c] - state[c] for c in MODEL_STATE)
    offload = run.optimizer
    diff = max((a - b).abs().max().item() for a, b in zip(params, reference.model.parameters()))
    timed = run.step_s[1:] or run.step_s  # the first step allocates AdamW state: left out
    return {
        "mode": run.mode,
        "params": n,
        "tensors": len(params),
        "losses": run.losses,
        "max_abs_diff_vs_device_adamw": diff,
        "device_after_step": state,
        "device_saved_bytes": saved,
        "device_saved_per_param": saved / n,
        "peak_device_bytes": run.ledger.peak(tl)["total"],
        "host_bytes": tl.host["host_copies"][-1],  # master, gradients, AdamW state: labelled host_copies
        "d2h_bytes_per_step": offload.d2h_bytes // len(run.losses) if offload else 0,
        "h2d_bytes_per_step": offload.h2d_bytes // len(run.losses) if offload else 0,
        "step_ms": 1e3 * statistics.median(timed),
        "cuda": run.cuda,
    }


def report(runs: list[Run], args) -> dict:
    reference = next(r for r in runs if r.mode == "none")
    modes = [summary(r, reference) for r in runs if args.offload in ("all", r.mode)]
    wall = sum(r.wall_time_s for r in runs)
    return {"lab": LAB, "config": config(args).to_dict(), "impl": args.impl, "overlap": args.overlap,
            "modes": modes, "provenance": provenance.collect(LAB, runs[0].device, wall)}


def main(argv=None) -> None:
    args = parse_args(argv)
    runs = run_all(args)
    result = report(runs, args)
    if args.json:
        emit_json(result)
        return
    first = result["modes"][0]
    print(f"Lab 07 on {runs[0].device}: TinyGPT with {first['params']:,} parameters in {first['tensors']} tensors, "
          f"{args.steps} steps, AdamW impl '{args.impl}'"
          + (" (CPU: the device and the host are the same RAM; the ledger keeps them apart)" if runs[0].device.type == "cpu" else ""))
    print(f"{'mode':<11}{'device state':>14}{'saved':>12}{'B/param':>9}{'host':>12}{'peak device':>13}"
          f"{'max |diff|':>12}{'ms/step':>9}")
    for s in result["modes"]:
        total = sum(s["device_after_step"][c] for c in MODEL_STATE)
        print(f"{s['mode']:<11}{format_bytes(total):>14}{format_bytes(s['device_saved_bytes']):>12}"
              f"{s['device_saved_per_param']:>9.2f}{format_bytes(s['host_bytes']):>12}"
              f"{format_bytes(s['peak_device_bytes']):>13}{s['max_abs_diff_vs_device_adamw']:>12.2e}{s['step_ms']:>9.2f}")
    print("device state: parameters + gradients + AdamW state between steps (ledger, measured); "
          "max |diff|: parameters against device AdamW after the last step")
    if args.snapshot:
        print(f"memory history written to {args.snapshot} (open it at https://pytorch.org/memory_viz)")


if __name__ == "__main__":
    run_lab(main)
