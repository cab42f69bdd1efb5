"""Lab 12 - memory debugging: leaks through held references, fragmentation, an OOM message read.

Five reproducible scenarios, each with its diagnosis:

    leak-losses       the loop keeps every loss as a tensor; the monitoring loss, computed with
                      autograd on, pins its whole graph (fix: torch.no_grad(), then loss.item())
    leak-activations  a forward hook keeps each block's output "for debugging" (fix: keep a number)
    fixed             all the fixes: flat from step to step, and no graph outlives its step
    fragmentation     CUDA only: allocated against reserved, with and without expandable_segments
    oom               CUDA only: torch.OutOfMemoryError caught and its message read line by line

The memory ledger (labkit) runs with stacks=True, so every live tensor remembers the line of code
that allocated it (inside the model, for the toy GPT) and the line of this file that called the
model: the report lists what grew in the last step and what is alive at the end, by category and
by both lines. The CUDA-only scenarios live in cuda_scenarios.py next to this file.

Run it:
    python code/lab-12-memory-debugging/memory_debugging.py --device cpu
    python code/lab-12-memory-debugging/memory_debugging.py --scenario leak-losses --top 10
    python code/lab-12-memory-debugging/memory_debugging.py --device cuda --scenario oom
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # makes code/labkit importable
sys.path.insert(0, str(Path(__file__).resolve().parent))  # and cuda_scenarios.py next to this file
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lab-01-memory-accounting"))  # Lab 01's count

import torch  # noqa: E402

import cuda_scenarios  # noqa: E402
from labkit import GPTConfig, Ledger, SyntheticTokens, TinyGPT, UsageError, emit_json  # noqa: E402
from labkit import lab_parser, pick_device, provenance, run_lab  # noqa: E402
from labkit.cli import positive_float, positive_int  # noqa: E402
from labkit.cuda import allocator_stats, record_snapshot, reset_peak  # noqa: E402
from labkit.plot import format_bytes  # noqa: E402
from toy_gpt import tinygpt_activation_bytes  # noqa: E402

LAB = "lab-12-memory-debugging"
LEAKS = {"leak-losses": "losses", "leak-activations": "activations", "fixed": None}
CUDA_ONLY = ("fragmentation", "oom")
SCENARIOS = (*LEAKS, *CUDA_ONLY)


# --8<-- [start:config]
def parse_args(argv=None):
    p = lab_parser("Reproduce memory leaks, fragmentation and an out-of-memory error, and diagnose each.")
    p.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all",
                   help="all: every scenario this device can run")
    p.add_argument("--steps", type=positive_int, default=6, help="training steps per leak scenario (>= 2)")
    p.add_argument("--top", type=positive_int, default=12, help="rows of each live-tensor table")
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--seq-len", type=positive_int, default=64)
    p.add_argument("--width", type=positive_int, default=128)
    p.add_argument("--layers", type=positive_int, default=2)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--vocab", type=positive_int, default=256)
    p.add_argument("--lr", type=positive_float, default=1e-3)
    p.add_argument("--frag-iters", type=positive_int, default=12, help="fragmentation: batch sizes tried")
    p.add_argument("--frag-layers", type=positive_int, default=8, help="fragmentation: buffer pairs kept")
    p.add_argument("--cap-mb", type=positive_int, default=1024, help="oom: the memory cap in MiB")
    p.add_argument("--snapshot", type=Path, help="CUDA only: a memory_viz history of the leak loops")
    args = p.parse_args(argv)
    if args.width % args.heads:
        raise UsageError(f"--width {args.width} is not divisible by --heads {args.heads}")
    if args.steps < 2:
        raise UsageError("--steps must be at least 2: growth is measured from one step to the next")
    if args.cap_mb < 128:
        raise UsageError(f"--cap-mb {args.cap_mb} is too small: the OOM patterns need at least 128 MiB")
    return args
# --8<-- [end:config]


# --8<-- [start:loop]
def run_loop(model, optimizer, data, val, args, ledger: Ledger, leak: str | None):
    """Train, log a monitoring loss every step, and read what is alive after each step."""
    losses, debug = [], []  # what the loop keeps from one step to the next

    def capture(block, inputs, output):  # a forward hook, "for debugging"
        if block.training:
            debug.append(output if leak == "activations" else output.detach().abs().mean().item())  # (1)!

    hooks = [block.register_forward_hook(capture) for block in model.blocks]
    after_step = []
    for step in range(args.steps):
        x, y = data.batch(step, args.batch_size, ledger.device)
        with ledger.phase("forward", step):
            loss = model(x, y)[1]
        with ledger.phase("backward", step):
            loss.backward()  # (2)!
        with ledger.phase("optimizer", step):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        with ledger.phase("forward", step):  # monitoring: the loss on a held-out batch
            model.eval()  # (3)!
            with torch.set_grad_enabled(leak == "losses"):  # (4)!
                val_loss = model(*val)[1]
            model.train()
        if leak == "losses":
            losses.append((loss, val_loss))  # (5)!
        else:
            losses.append((loss.item(), val_loss.item()))  # (6)!
        after_step.append(ledger.live_by_origin())  # (7)!
    for hook in hooks:
        hook.remove()
    return (losses, debug), after_step
# --8<-- [end:loop]


# --8<-- [start:tool]
def live_total(rows: list[dict]) -> int:
    return sum(r["bytes"] for r in rows if r["scope"] == "device")


def origin(row: dict) -> tuple:
    """Where a group of live tensors came from: its category, the line that allocated it and, when
    that line is inside the model (labkit's models.py), the lab line that called the model."""
    return row["category"], row["where"], row.get("called_from")


def what_grew(before: list[dict], after: list[dict]) -> list[dict]:
    """The groups (by origin) whose live bytes grew between two readings, largest first."""
    old = {origin(r): r for r in before}
    grew = []
    for r in after:
        o = old.get(origin(r), {"bytes": 0, "tensors": 0})
        if r["bytes"] > o["bytes"]:  # (1)!
            grew.append(r | {"bytes": r["bytes"] - o["bytes"], "tensors": r["tensors"] - o["tensors"]})
    return sorted(grew, key=lambda r: -r["bytes"])


def origin_table(rows: list[dict], top: int) -> str:
    """Live tensors by category, by the line that allocated them and by the lab line that called it."""
    out = ["| category | allocated at (file:line in function: code) | called from | tensors | bytes |",
           "|---|---|---|---:|---:|"]
    for r in rows[:top]:
        where, caller = code_cell(r["where"]), code_cell(r.get("called_from"))
        out.append(f"| {r['category']} | {where} | {caller} | {r['tensors']:,} | {r['bytes']:,} |")  # (2)!
    return "\n".join(out)


def code_cell(line: str | None) -> str:
    """A line of code as a Markdown table cell (a pipe in the code cannot break the table)."""
    return "`" + line.replace("|", "\\|") + "`" if line else "-"
# --8<-- [end:tool]


# --8<-- [start:expected]
def expected_growth(scenario: str, cfg: GPTConfig, batch: int, device: torch.device) -> int | None:
    """Bytes a leaking loop gains per step, derived from the shapes (CPU kernels; exact there)."""
    if scenario == "leak-losses":  # one monitoring graph + one 4-byte training loss
        if device.type != "cpu":
            return None  # (1)!
        return tinygpt_activation_bytes(cfg, batch)["total"] + 4  # (2)!
    if scenario == "leak-activations":  # one fp32 block output per layer
        return cfg.layers * batch * cfg.seq_len * cfg.width * 4
    return 0
# --8<-- [end:expected]


@dataclass
class Run:
    scenario: str
    cfg: GPTConfig
    device: torch.device
    ledger: Ledger
    kept: tuple  # what the loop held on to: (losses, debug)
    after_step: list[list[dict]]
    wall_time_s: float
    cuda: dict | None


# --8<-- [start:run]
def run_scenario(args, scenario: str, device: torch.device) -> Run:
    torch.manual_seed(args.seed)
    cfg = GPTConfig(vocab=args.vocab, seq_len=args.seq_len, width=args.width,
                    layers=args.layers, heads=args.heads)
    model = TinyGPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = SyntheticTokens(cfg.vocab, cfg.seq_len, seed=args.seed)
    val = data.batch(10**6, args.batch_size, device)  # a held-out batch, never trained on
    ledger = Ledger(device, stacks=True)  # (1)!
    ledger.track_module(model)
    ledger.track_optimizer(optimizer)
    reset_peak(device)
    t0 = time.perf_counter()
    with ledger:
        kept, after_step = run_loop(model, optimizer, data, val, args, ledger, LEAKS[scenario])
    return Run(scenario, cfg, device, ledger, kept, after_step, time.perf_counter() - t0,
               allocator_stats(device))
# --8<-- [end:run]


def summary(run: Run, args) -> dict:
    """Read a run while what it kept is still alive: growth per step and the live tables."""
    totals = [live_total(rows) for rows in run.after_step]
    out = {
        "live_bytes_after_step": totals,
        "growth_per_step_bytes": [b - a for a, b in zip(totals, totals[1:])],
        "expected_growth_per_step_bytes": expected_growth(run.scenario, run.cfg, args.batch_size, run.device),
        "grew_in_last_step": what_grew(run.after_step[-2], run.after_step[-1])[:args.top],
        "live_at_end": run.after_step[-1][:args.top],
        "peak_bytes": run.ledger.peak(),
        "wall_time_s": round(run.wall_time_s, 3),
        "cuda": run.cuda,
    }
    if run.cuda:  # the allocator's own count at the end of each step, next to the ledger's
        tl = run.ledger.timeline()
        last = {s: i for i, s in enumerate(tl.step) if s is not None}
        out["cuda"]["allocated_after_step"] = [tl.cuda_allocated[last[s]] for s in sorted(last)]
    return out


def snapshot_path(path: Path | None, scenario: str, several: bool) -> Path | None:
    return path.with_name(f"{path.stem}-{scenario}{path.suffix}") if path and several else path


def run_all(args, device: torch.device) -> dict:
    wanted = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    if device.type != "cuda":
        if args.scenario in CUDA_ONLY:
            raise UsageError(f"--scenario {args.scenario} needs a CUDA GPU (it studies CUDA's caching "
                             "allocator); on CPU choose leak-losses, leak-activations or fixed")
        if args.snapshot:
            raise UsageError("--snapshot needs a CUDA device (a CUDA allocator feature)")
    leaks = [s for s in wanted if s in LEAKS]
    results, t0 = {}, time.perf_counter()
    for name in leaks:
        with record_snapshot(snapshot_path(args.snapshot, name, len(leaks) > 1)):
            run = run_scenario(args, name, device)
        results[name] = summary(run, args)
        del run  # what it leaked goes with it, before the next scenario starts
    if device.type == "cuda" and "fragmentation" in wanted:
        results["fragmentation"] = cuda_scenarios.fragmentation(args.frag_iters, args.frag_layers)
    if device.type == "cuda" and "oom" in wanted:
        total_mb = torch.cuda.get_device_properties(device).total_memory // 2**20
        if args.cap_mb >= total_mb:
            raise UsageError(f"--cap-mb {args.cap_mb} must be below the GPU's {total_mb} MiB")
        results["oom"] = cuda_scenarios.oom_experiments(args.cap_mb)
    skipped = [s for s in wanted if s not in results]
    return {"lab": LAB, "device": str(device), "steps": args.steps, "scenarios": results,
            "skipped_cuda_only": skipped,
            "provenance": provenance.collect(LAB, device, time.perf_counter() - t0)}


def print_leak(name: str, r: dict, top: int) -> None:
    print(f"\n{name}: live device bytes after each step (ledger, measured)")
    print("  " + "  ".join(format_bytes(b) for b in r["live_bytes_after_step"]))
    grew = sorted(set(r["growth_per_step_bytes"]))
    expected = r["expected_growth_per_step_bytes"]
    print(f"  growth per step: {', '.join(f'{g:,} B' for g in grew)} measured"
          + (f"; {expected:,} B derived" if expected is not None else ""))
    if r["grew_in_last_step"]:
        print("  what grew in the last step, by the line that allocated it:")
        print(origin_table(r["grew_in_last_step"], top))
    print(f"  alive at the end of the last step (top {top}):")
    print(origin_table(r["live_at_end"], top))
    if r["cuda"]:
        print("  CUDA allocator after each step: "
              + "  ".join(format_bytes(b) for b in r["cuda"]["allocated_after_step"]))


def print_cuda(results: dict) -> None:
    for run in results.get("fragmentation", []):
        peak_alloc = max(row["allocated"] for row in run["rows"])
        peak_res = max(row["reserved"] for row in run["rows"])
        print(f"\nfragmentation, {run['alloc_conf']}: peak allocated {format_bytes(peak_alloc)}, "
              f"peak reserved {format_bytes(peak_res)} ({peak_res / peak_alloc:.2f}x), "
              f"{run['segments']} segments, cached after the last free {format_bytes(run['after']['reserved'])}")
    for run in results.get("oom", []):
        print(f"\noom, {run['pattern']} pattern, {run['alloc_conf']} allocator: "
              + ("torch.OutOfMemoryError caught" if run["oom"] else "no error: the allocation fitted"))
        for line in run.get("reading", {}).get("lines", []):
            nums = "; ".join(f"{n['name']} = {format_bytes(n['bytes'])}" for n in line["numbers"])
            print(f"  {line['text']}" + (f"\n      -> {nums}" if nums else ""))
        for lever in run.get("levers", []):
            print(f"  pattern: {lever['pattern']}\n      next lever: {lever['lever']}")


def main(argv=None) -> None:
    args = parse_args(argv)
    device = pick_device(args.device)
    result = run_all(args, device)
    if args.json:
        emit_json(result)
        return
    print(f"Lab 12 on {device}: TinyGPT, AdamW, {args.steps} steps per leak scenario, "
          "a monitoring forward each step")
    for name, r in result["scenarios"].items():
        if name in LEAKS:
            print_leak(name, r, args.top)
    print_cuda(result["scenarios"])
    if result["skipped_cuda_only"]:
        print(f"\nskipped (CUDA only): {', '.join(result['skipped_cuda_only'])}; "
              "run with --device cuda on a GPU machine")
    if args.snapshot:
        print(f"memory history written next to {args.snapshot} (open it at https://pytorch.org/memory_viz)")


if __name__ == "__main__":
    run_lab(main)
