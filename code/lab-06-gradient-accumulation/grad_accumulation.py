"""Lab 06 - gradient accumulation, and a trainer that fits a memory budget.

k forward/backward passes on micro-batches, each loss divided by k, then one optimizer step: the
gradients are those of the whole effective batch (up to floating-point summation order), yet only
one micro-batch's activations are ever alive. Given ``--budget 10MiB``, the trainer measures probe
runs with the memory ledger at candidate micro-batch sizes, without and then with checkpointing of
the blocks, and trains with the largest that fits, or says in one line (exit 2) that none does.

Run it:
    python code/lab-06-gradient-accumulation/grad_accumulation.py --device cpu
    python code/lab-06-gradient-accumulation/grad_accumulation.py --batch 16 --micro-batch 16
    python code/lab-06-gradient-accumulation/grad_accumulation.py --batch 8 --budget 10MiB
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # makes code/labkit importable

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from labkit import GPTConfig, Ledger, SyntheticTokens, TinyGPT, UsageError, emit_json  # noqa: E402
from labkit import lab_parser, pick_device, progress, provenance, run_lab  # noqa: E402
from labkit.cli import positive_float, positive_int  # noqa: E402
from labkit.cuda import allocator_stats, ledger_vs_allocator, record_snapshot, reset_peak  # noqa: E402
from labkit.plot import format_bytes, peak_table  # noqa: E402

LAB = "lab-06-gradient-accumulation"
UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}


def parse_bytes(text: str) -> int:
    """'64MiB' -> 67108864. Plain bytes or KiB/MiB/GiB (powers of 1024), any letter case."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in UNITS or float(m.group(1)) * UNITS[unit] < 1:
        hint = "; KB/MB/GB are ambiguous, write KiB/MiB/GiB" if unit in ("K", "KB", "M", "MB", "G", "GB") else ""
        raise argparse.ArgumentTypeError(f"expected bytes such as 500000, 512KiB, 64MiB or 1.5GiB, got {text!r}{hint}")
    return int(float(m.group(1)) * UNITS[unit])


# --8<-- [start:config]
def parse_args(argv=None):
    p = lab_parser("Gradient accumulation, and a trainer that picks micro-batch and checkpointing to fit a budget.")
    p.add_argument("--batch", type=positive_int, help="effective batch per optimizer step")
    p.add_argument("--micro-batch", type=positive_int, help="samples per forward/backward pass")
    p.add_argument("--accum-steps", type=positive_int, help="micro-batches per optimizer step")
    p.add_argument("--budget", type=parse_bytes, help="peak bytes allowed, e.g. 24MiB; the trainer picks the split")
    p.add_argument("--checkpoint", choices=["auto", "on", "off"], default="auto",
                   help="checkpoint every block; auto: only if the budget needs it (off without --budget)")
    p.add_argument("--steps", type=positive_int, default=4, help="optimizer steps")
    p.add_argument("--lr", type=positive_float, default=3e-3)
    for flag, default in (("--seq-len", 64), ("--width", 128), ("--layers", 2), ("--heads", 4), ("--vocab", 256)):
        p.add_argument(flag, type=positive_int, default=default, help=f"model size (default {default})")
    p.add_argument("--snapshot", type=Path, help="CUDA only: dump a memory-history pickle for memory_viz")
    a = p.parse_args(argv)
    if a.width % a.heads:
        raise UsageError(f"--width {a.width} is not divisible by --heads {a.heads}")
    m, k, b = a.micro_batch, a.accum_steps, a.batch
    if a.budget is not None:
        if m or k:
            raise UsageError("--budget chooses the micro-batch: give --batch, not --micro-batch/--accum-steps")
        a.batch = b or 16
        return a
    if b is None:  # (1)!
        m, k = m or 4, k or 4
    elif m is None and k is None:
        m, k = b, 1  # --batch alone: one large batch
    elif m and k and m * k != b:
        raise UsageError(f"--micro-batch {m} x --accum-steps {k} = {m * k}, but --batch is {b}")
    elif not (m and k):
        given, flag = (m, "--micro-batch") if m else (k, "--accum-steps")
        if b % given:
            raise UsageError(f"--batch {b} is not a multiple of {flag} {given}")
        m, k = (m, b // m) if m else (b // k, k)
    a.micro_batch, a.accum_steps, a.batch = m, k, m * k
    return a
# --8<-- [end:config]


# --8<-- [start:model]
class CheckpointedBlock(nn.Module):
    """A block that keeps only its input for backward and recomputes its inside there."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)  # (1)!


def build_model(cfg: GPTConfig, checkpoint_blocks: bool, device, seed: int) -> TinyGPT:
    torch.manual_seed(seed)  # (2)!
    model = TinyGPT(cfg)
    if checkpoint_blocks:
        model.blocks = nn.ModuleList(CheckpointedBlock(b) for b in model.blocks)  # (3)!
    return model.to(device)
# --8<-- [end:model]


# --8<-- [start:data]
def samples(data: SyntheticTokens, first: int, n: int, device):
    """Samples first .. first+n-1 as one batch; sample j is ``data.batch(j, 1)`` whatever the split."""
    xs, ys = zip(*(data.batch(j, 1) for j in range(first, first + n)))
    return torch.cat(xs).to(device), torch.cat(ys).to(device)


def micro_batches(data: SyntheticTokens, step: int, batch: int, micro: int, device):
    """One step's effective batch, one micro-batch at a time."""
    for start in range(0, batch, micro):
        yield samples(data, step * batch + start, micro, device)  # (1)!
# --8<-- [end:data]


# --8<-- [start:step]
def accumulate(model, batches, k: int, ledger: Ledger, step: int | None = None) -> float:
    """Clear the gradients, then add k micro-batch gradients into them. Returns the mean loss."""
    with ledger.phase("zero_grad", step):
        model.zero_grad(set_to_none=True)
    total = 0.0
    for x, y in batches:
        with ledger.phase("forward", step):
            loss = model(x, y)[1] / k  # (1)!
        with ledger.phase("backward", step):
            loss.backward()  # (2)!
        total += loss.item()
    return total


def train_step(model, optimizer, batches, k: int, ledger: Ledger, step: int) -> float:
    loss = accumulate(model, batches, k, ledger, step)
    with ledger.phase("optimizer", step):
        optimizer.step()  # (3)!
    return loss
# --8<-- [end:step]


@dataclass
class Run:
    micro_batch: int
    accum_steps: int
    checkpoint: bool
    losses: list[float]
    ledger: Ledger
    model: TinyGPT
    device: torch.device
    wall_time_s: float
    cuda: dict | None
    probes: list[dict] = field(default_factory=list)  # the budget trainer's measurements


def run_steps(cfg, device, micro, k, ckpt, steps, seed=0, lr=3e-3, quiet=True, snapshot=None) -> Run:
    """``steps`` optimizer steps of k micro-batches of ``micro`` samples, under a fresh ledger."""
    model = build_model(cfg, ckpt, device, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    data = SyntheticTokens(cfg.vocab, cfg.seq_len, seed=seed)
    ledger = Ledger(device)
    ledger.track_module(model)
    ledger.track_optimizer(optimizer)
    reset_peak(device)
    losses, t0 = [], time.perf_counter()
    with record_snapshot(snapshot), ledger:
        for step in progress(range(steps), total=steps, desc=f"train {k} x {micro}", quiet=quiet):
            batches = micro_batches(data, step, k * micro, micro, device)
            losses.append(train_step(model, optimizer, batches, k, ledger, step))
    return Run(micro, k, ckpt, losses, ledger, model, device, time.perf_counter() - t0, allocator_stats(device))


# --8<-- [start:plan]
def probe(cfg, device, batch: int, micro: int, ckpt: bool, seed: int = 0) -> int | None:
    """Measured peak bytes of steady-state training at this micro-batch size (None: out of memory)."""
    k = min(batch // micro, 2)  # (1)!
    try:
        return run_steps(cfg, device, micro, k, ckpt, steps=2, seed=seed).ledger.peak()["total"]  # (2)!
    except torch.cuda.OutOfMemoryError:
        return None


def plan(cfg, device, batch: int, budget: int, mode: str = "auto", seed: int = 0, quiet: bool = True):
    """Pick (micro_batch, checkpoint, probes) that fits ``budget``; every probe is a measurement."""
    sizes = [m for m in range(1, batch + 1) if batch % m == 0]
    modes = {"off": [False], "on": [True], "auto": [False, True]}[mode]  # (3)!
    probes: dict[tuple[int, bool], dict] = {}  # in the order they were measured

    def measured(micro, ckpt):
        if (micro, ckpt) not in probes:
            peak = probe(cfg, device, batch, micro, ckpt, seed)
            probes[micro, ckpt] = {"micro_batch": micro, "accum_steps": batch // micro, "checkpoint": ckpt,
                                   "peak_bytes": peak, "fits": peak is not None and peak <= budget}
        return probes[micro, ckpt]

    smallest = measured(1, modes[-1])  # (4)!
    if not smallest["fits"]:
        peak = smallest["peak_bytes"]
        said = "ran out of device memory" if peak is None else f"peaks at {format_bytes(peak)} ({peak:,} B, measured)"
        raise UsageError(f"budget {format_bytes(budget)} ({budget:,} B) cannot be met: the smallest configuration "
                         f"(micro-batch 1, checkpointing {'on' if modes[-1] else 'off'}) {said}")
    for ckpt in modes:
        best = None
        for micro in progress(sizes, desc=f"probe checkpoint={ckpt}", quiet=quiet):
            if not measured(micro, ckpt)["fits"]:
                break  # (5)!
            best = micro
        if best:
            return best, ckpt, list(probes.values())  # (6)!
    raise AssertionError("unreachable: the smallest configuration fits")
# --8<-- [end:plan]


# --8<-- [start:train]
def train(args) -> Run:
    device = pick_device(args.device)
    if args.snapshot and device.type != "cuda":
        raise UsageError("--snapshot needs a CUDA device (memory history is a CUDA allocator feature)")
    cfg = GPTConfig(vocab=args.vocab, seq_len=args.seq_len, width=args.width,
                    layers=args.layers, heads=args.heads, dropout=0.0)  # (1)!
    probes = []
    if args.budget is not None:
        micro, ckpt, probes = plan(cfg, device, args.batch, args.budget, args.checkpoint, args.seed, args.json)
    else:
        micro, ckpt = args.micro_batch, args.checkpoint == "on"
    run = run_steps(cfg, device, micro, args.batch // micro, ckpt, args.steps, args.seed, args.lr,
                    quiet=args.json, snapshot=args.snapshot)  # (2)!
    run.probes = probes
    return run
# --8<-- [end:train]


# --8<-- [start:equivalence]
# max |g_accumulated - g_large| / max |g_large|, asserted by the tests and the notebook
TOLERANCE = 1e-5  # (1)!


def gradient_gap(cfg: GPTConfig, batch: int, k: int, seed: int = 0, ckpt: bool = False, scale: bool = True) -> dict:
    """Gradients of k accumulated micro-batches against one large batch of the same samples."""
    model = build_model(cfg, ckpt, "cpu", seed)
    x, y = samples(SyntheticTokens(cfg.vocab, cfg.seq_len, seed=seed), 0, batch, "cpu")
    ledger = Ledger("cpu")  # marks phases only; never entered, so it records nothing here
    accumulate(model, [(x, y)], 1, ledger)
    large = [p.grad.clone() for p in model.parameters()]
    accumulate(model, zip(x.chunk(k), y.chunk(k)), k if scale else 1, ledger)  # (2)!
    accumulated = [p.grad for p in model.parameters()]
    norm = torch.stack([g.norm() for g in accumulated]).norm() / torch.stack([g.norm() for g in large]).norm()
    return {"k": k, "max_abs_diff": max((a - g).abs().max().item() for a, g in zip(accumulated, large)),
            "max_abs_grad": max(g.abs().max().item() for g in large), "norm_ratio": norm.item(),
            "bit_exact": all(torch.equal(a, g) for a, g in zip(accumulated, large))}
# --8<-- [end:equivalence]


def probe_table(probes: list[dict]) -> str:
    rows = ["| micro-batch | accumulation steps | checkpointing | measured peak | fits |", "|---:|---:|---|---:|---|"]
    for p in probes:
        peak = "out of memory" if p["peak_bytes"] is None else format_bytes(p["peak_bytes"])
        rows.append(f"| {p['micro_batch']} | {p['accum_steps']} | {'on' if p['checkpoint'] else 'off'} | "
                    f"{peak} | {'yes' if p['fits'] else 'no'} |")
    return "\n".join(rows)


def summary(run: Run, args) -> dict:
    peak = run.ledger.peak()
    out = {
        "lab": LAB, "device": str(run.device), "config": run.model.cfg.to_dict(),
        "params": sum(p.numel() for p in run.model.parameters()),
        "batch": run.micro_batch * run.accum_steps, "micro_batch": run.micro_batch,
        "accum_steps": run.accum_steps, "checkpoint": run.checkpoint,
        "steps": len(run.losses), "losses": run.losses,
        "budget_bytes": args.budget, "probes": run.probes,
        "peak_bytes": peak, "peak_bytes_by_phase": run.ledger.peaks_by_phase(),
        "within_budget": None if args.budget is None else peak["total"] <= args.budget,
        "cuda": run.cuda,
        "provenance": provenance.collect(LAB, run.device, run.wall_time_s),
    }
    if run.cuda:  # cuBLAS workspaces and other bytes unseen by the ledger set aside
        out["cuda"] = ledger_vs_allocator(run.ledger.timeline(), run.cuda)
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    run = train(args)
    result = summary(run, args)
    total = result["peak_bytes"]["total"]
    if result["within_budget"] is False:  # the probes measured this very configuration: a bug if it happens
        raise SystemExit(f"run peak {total:,} B exceeds the budget of {args.budget:,} B")
    if args.json:
        emit_json(result)
        return
    split = f"{run.accum_steps} x micro-batch {run.micro_batch}, checkpointing {'on' if run.checkpoint else 'off'}"
    print(f"Lab 06 on {run.device}: TinyGPT, {result['params']:,} parameters, AdamW; batch {result['batch']} = {split}")
    if run.probes:
        print(f"\nBudget {format_bytes(args.budget)}: probes measured with the ledger (2 steps each)")
        print(f"{probe_table(run.probes)}\nchosen: {split}")
    print("\n".join(f"  step {i:4d}  loss {loss:.4f}" for i, loss in enumerate(run.losses)))
    print("\nPeak live device bytes in each phase (ledger, measured):")
    print(peak_table(result["peak_bytes_by_phase"]))
    if args.budget is not None:
        print(f"\nRun peak {total:,} B is within the budget of {args.budget:,} B ({format_bytes(args.budget)}).")
    if c := run.cuda:
        print(f"CUDA allocator: max allocated {format_bytes(c['max_memory_allocated'])}, reserved "
              f"{format_bytes(c['max_memory_reserved'])}; ledger / allocated {c['ledger_over_allocator']:.3f}")
    if args.snapshot:
        print(f"memory history written to {args.snapshot} (open it at https://pytorch.org/memory_viz)")


if __name__ == "__main__":
    run_lab(main)
