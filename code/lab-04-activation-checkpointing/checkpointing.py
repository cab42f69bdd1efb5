"""Lab 04 - activation checkpointing: trade compute for memory, and measure both sides.

Backward needs tensors that forward computed. Keeping all of them is the default. Activation
checkpointing keeps fewer and recomputes the rest during backward. Four strategies, all with
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``:

    none          keep everything the blocks save for backward (the reference)
    full          checkpoint every block: keep its input, recompute its inside in backward
    every-k       checkpoint segments of k blocks: keep n/k inputs, recompute k blocks at once
    save-matmuls  checkpoint every block with an op-level policy: keep every matmul output,
                  recompute the cheap pointwise ops. On a CPU with dropout it keeps the T x T
                  attention scores (two bmm), which Korthikanti et al.'s selective recomputation drops.

For each one the lab measures activation memory (labkit's memory ledger), the recompute cost
(extra FLOPs counted by ``FlopCounterMode``, time per step measured) and checks that the
gradients equal the no-checkpointing gradients bit for bit, dropout included. How many blocks a
segment should hold is measured in ``segments.py``, next to this file.

Run it:
    python code/lab-04-activation-checkpointing/checkpointing.py --device cpu
    python code/lab-04-activation-checkpointing/checkpointing.py --strategy every-k --every 2 --layers 8
    python code/lab-04-activation-checkpointing/checkpointing.py --device cpu --json
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # makes code/labkit importable

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from labkit import GPTConfig, Ledger, SyntheticTokens, TinyGPT, UsageError, emit_json  # noqa: E402
from labkit import lab_parser, pick_device, progress, provenance, run_lab  # noqa: E402
from labkit.cli import positive_int, probability  # noqa: E402
from labkit.cuda import allocator_stats, ledger_vs_allocator, record_snapshot, reset_peak  # noqa: E402
from labkit.ledger import NullLedger  # noqa: E402
from labkit.plot import format_bytes  # noqa: E402

LAB = "lab-04-activation-checkpointing"
STRATEGIES = ("none", "full", "every-k", "save-matmuls")
GPU_TARGETS = {  # targets for the GPU run (tests/test_lab04.py, marked cuda), not results
    "full": {"min_activation_reduction": 0.60, "max_time_overhead": 0.35},
    "save-matmuls": {"min_activation_reduction": 0.40, "max_time_overhead": 0.10},
}


# --8<-- [start:config]
def parse_args(argv=None):
    p = lab_parser("Compare activation-checkpointing strategies: memory kept, compute redone.")
    p.add_argument("--strategy", choices=[*STRATEGIES, "all"], default="all",
                   help="which strategy to measure against 'none' (default: all of them)")
    p.add_argument("--every", type=positive_int, default=None,
                   help="k for every-k: blocks per checkpointed segment (default: round(sqrt(layers)), the "
                        "textbook rule, kept to show its cost: a block here keeps a, many times its input b, "
                        "so k = 1 peaks lower until --layers passes 2*a/b; see segments.py)")
    p.add_argument("--steps", type=positive_int, default=5, help="timed forward+backward steps per strategy")
    p.add_argument("--batch-size", type=positive_int, default=4)
    p.add_argument("--seq-len", type=positive_int, default=64)
    p.add_argument("--width", type=positive_int, default=128)
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--vocab", type=positive_int, default=256)
    p.add_argument("--dropout", type=probability, default=0.1)
    p.add_argument("--snapshot", type=Path, help="CUDA only: dump a memory-history pickle for memory_viz")
    args = p.parse_args(argv)
    if args.width % args.heads:
        raise UsageError(f"--width {args.width} is not divisible by --heads {args.heads}")
    if args.every is None:
        args.every = max(1, round(math.sqrt(args.layers)))  # the textbook sqrt(n) rule, on purpose (--help)
    if args.every > args.layers:
        raise UsageError(f"--every {args.every} is larger than --layers {args.layers}: a segment cannot "
                         f"hold more blocks than the model has")
    return args
# --8<-- [end:config]


# --8<-- [start:policy]
aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
DROPOUT_ARG = {  # fused attention kernels: the position of their dropout_p argument
    "_scaled_dot_product_flash_attention": 3, "_scaled_dot_product_flash_attention_for_cpu": 3,
    "_scaled_dot_product_efficient_attention": 5, "_scaled_dot_product_cudnn_attention": 5,
}
ATTENTION = {getattr(aten, n).default: i for n, i in DROPOUT_ARG.items() if hasattr(aten, n)}


def save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Asked once per op of a checkpointed block's forward: keep its output, or redo it?"""
    if op in MATMULS:
        return CheckpointPolicy.MUST_SAVE  # (1)!
    if op in ATTENTION:  # (2)!
        i = ATTENTION[op]
        dropout_p = args[i] if len(args) > i else kwargs.get("dropout_p", 0.0)
        return CheckpointPolicy.MUST_SAVE if dropout_p == 0 else CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.PREFER_RECOMPUTE  # (3)!
# --8<-- [end:policy]


# --8<-- [start:blocks]
def run_segment(blocks, x):
    for block in blocks:
        x = block(x)
    return x


def run_blocks(blocks, x, strategy: str, every: int):
    if strategy == "none":
        return run_segment(blocks, x)  # (1)!
    if strategy == "save-matmuls":
        policy = partial(create_selective_checkpoint_contexts, save_matmuls)  # (2)!
        for block in blocks:
            x = checkpoint(block, x, use_reentrant=False, context_fn=policy)
        return x
    k = 1 if strategy == "full" else every
    for i in range(0, len(blocks), k):
        x = checkpoint(run_segment, blocks[i:i + k], x, use_reentrant=False)  # (3)!
    return x


def forward(model: TinyGPT, idx, targets, strategy: str, every: int):
    """TinyGPT.forward written out, so that the loop over blocks is ours."""
    pos = torch.arange(idx.shape[1], device=idx.device)
    x = model.drop(model.tok(idx) + model.pos(pos))
    x = run_blocks(list(model.blocks), x, strategy, every)
    logits = model.head(model.ln_f(x))
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
# --8<-- [end:blocks]



# --8<-- [start:step]
def train_step(model, x, y, strategy: str, every: int, seed: int,
               ledger: Ledger | None = None, loss_of=forward) -> float:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # (1)!
    ledger = NullLedger() if ledger is None else ledger  # timing runs: no ledger, no phases
    with ledger.phase("forward", 0):
        loss = loss_of(model, x, y, strategy, every)
    with ledger.phase("backward", 0):
        loss.backward()  # (2)!
    return loss.item()
# --8<-- [end:step]


# --8<-- [start:measure]
def activation_memory(ledger: Ledger) -> dict:
    """What this lab calls activation memory, read from one step's ledger timeline."""
    tl = ledger.timeline()
    fwd = next(s for s in tl.spans if s.name == "forward")
    act, tmp = tl.device["activations"], tl.device["temporaries"]
    return {
        "kept_bytes": act[fwd.end - 1],  # (1)!
        "activation_peak_bytes": max(a + t for a, t in zip(act, tmp)),  # (2)!
        "peak_bytes": ledger.peak(tl)["total"],
    }


def measure_memory(model, x, y, strategy: str, every: int, seed: int, loss_of=forward) -> tuple[Ledger, list]:
    ledger = Ledger(x.device)
    ledger.track_module(model)
    ledger.track((x, y), "other")
    with ledger:  # checkpoint's own dispatch modes nest inside the ledger's  (3)!
        train_step(model, x, y, strategy, every, seed, ledger, loss_of)
    return ledger, grads_of(model)


def count_flops(model, x, y, strategy: str, every: int, seed: int) -> tuple[int, int]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with FlopCounterMode(display=False) as fwd:
        loss = forward(model, x, y, strategy, every)
    with FlopCounterMode(display=False) as bwd:
        loss.backward()  # (4)!
    return fwd.get_total_flops(), bwd.get_total_flops()
# --8<-- [end:measure]


def time_steps(model, x, y, strategies, every: int, seed: int, steps: int, quiet: bool) -> dict[str, list[float]]:
    """Seconds per forward+backward step, strategies interleaved so that drift hits all alike."""
    times: dict[str, list[float]] = {s: [] for s in strategies}
    for s in strategies:
        train_step(model, x, y, s, every, seed)  # warm-up (allocator, kernels, caches)
    for _ in progress(range(steps), total=steps, desc="timing", quiet=quiet):
        for s in strategies:
            t0 = time.perf_counter()
            train_step(model, x, y, s, every, seed)  # .item() inside waits for the device
            times[s].append(time.perf_counter() - t0)
    return times


def grads_of(model) -> list[torch.Tensor]:
    return [p.grad.detach().cpu() for p in model.parameters()]  # off the device: not in its peak


def grads_equal(a: list, b: list) -> tuple[bool, float]:
    equal = all(torch.equal(u, v) for u, v in zip(a, b))
    return equal, max(float((u - v).abs().max()) for u, v in zip(a, b))


@dataclass
class Run:
    args: object
    cfg: GPTConfig
    device: torch.device
    model: TinyGPT
    strategies: list[str]
    results: dict[str, dict] = field(default_factory=dict)
    ledgers: dict[str, Ledger] = field(default_factory=dict)
    wall_time_s: float = 0.0


def build(args):
    device = pick_device(args.device)
    if args.snapshot and device.type != "cuda":
        raise UsageError("--snapshot needs a CUDA device (memory history is a CUDA allocator feature)")
    torch.manual_seed(args.seed)
    cfg = GPTConfig(vocab=args.vocab, seq_len=args.seq_len, width=args.width,
                    layers=args.layers, heads=args.heads, dropout=args.dropout)
    model = TinyGPT(cfg).to(device).train()
    x, y = SyntheticTokens(cfg.vocab, cfg.seq_len, seed=args.seed).batch(0, args.batch_size, device)
    return cfg, device, model, x, y


# --8<-- [start:run]
def run(args) -> Run:
    cfg, device, model, x, y = build(args)
    chosen = list(STRATEGIES) if args.strategy == "all" else ["none", args.strategy]
    out = Run(args, cfg, device, model, list(dict.fromkeys(chosen)))
    k, seed, t0 = args.every, args.seed, time.perf_counter()
    train_step(model, x, y, "none", k, seed)
    reference = grads_of(model)  # (1)!
    with record_snapshot(args.snapshot):
        for s in out.strategies:
            model.zero_grad(set_to_none=True)
            reset_peak(device)
            ledger, grads = measure_memory(model, x, y, s, k, seed)
            r = activation_memory(ledger) | {"cuda": allocator_stats(device)}
            r["grads_equal"], r["max_abs_grad_diff"] = grads_equal(grads, reference)  # (2)!
            train_step(model, x, y, s, k, seed)
            r["grads_equal_without_ledger"] = grads_equal(grads_of(model), reference)[0]
            r["forward_flops"], r["backward_flops"] = count_flops(model, x, y, s, k, seed)
            out.ledgers[s], out.results[s] = ledger, r
    times = time_steps(model, x, y, out.strategies, k, seed, args.steps, args.json)
    base = out.results["none"]
    for s, r in out.results.items():
        r["recompute_flops"] = r["backward_flops"] - base["backward_flops"]  # (3)!
        r["recompute_flops_of_forward"] = r["recompute_flops"] / max(base["forward_flops"], 1)
        r["activation_reduction"] = 1 - r["activation_peak_bytes"] / base["activation_peak_bytes"]
        r["step_times_s"], r["step_time_s"] = times[s], statistics.median(times[s])
        r["time_overhead"] = r["step_time_s"] / base["step_time_s"] - 1  # "none" comes first: 0
    out.wall_time_s = time.perf_counter() - t0
    return out
# --8<-- [end:run]


def summary(run: Run) -> dict:
    a = run.args
    out = {
        "lab": LAB,
        "device": str(run.device),
        "config": run.cfg.to_dict(),
        "batch_size": a.batch_size,
        "every": a.every,
        "strategies": run.strategies,
        "block_input_bytes": a.batch_size * a.seq_len * a.width * 4,  # one fp32 (B, T, width) tensor
        "activation_memory": "activation_peak_bytes: highest live activations + temporaries over "
                             "forward and backward; kept_bytes: activations alive when forward ends",
        "timing": f"median wall-clock seconds of {a.steps} forward+backward steps on {run.device.type}",
        "gpu_targets": GPU_TARGETS,
        "results": run.results,
        "provenance": provenance.collect(LAB, run.device, run.wall_time_s),
    }
    for s, r in run.results.items():  # cuBLAS workspaces and other bytes unseen by the ledger set aside
        if r["cuda"]:
            r["cuda"] = ledger_vs_allocator(run.ledgers[s].timeline(), r["cuda"])
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    result = summary(run(args))
    if args.json:
        emit_json(result)
        return
    c, kind = result["config"], result["device"].split(":")[0]
    print(f"Lab 04 on {result['device']}: TinyGPT, {c['layers']} blocks of width {c['width']}, batch "
          f"{args.batch_size} x {c['seq_len']} tokens, dropout {c['dropout']}; every-k uses k = {args.every}\n")
    print(f"{'strategy':<12} {'kept after fwd':>14} {'act. peak':>10} {'reduction':>9} {'recompute FLOPs':>17} "
          f"{'step (' + kind + ')':>11} {'overhead':>8}  gradients vs none")
    for s, r in result["results"].items():
        same = "reference" if s == "none" else "identical" if r["grads_equal"] else \
            f"differ by up to {r['max_abs_grad_diff']:.1e}"
        print(f"{s:<12} {format_bytes(r['kept_bytes']):>14} {format_bytes(r['activation_peak_bytes']):>10} "
              f"{r['activation_reduction']:>9.0%} {r['recompute_flops'] / 1e9:>9.3f} G ({r['recompute_flops_of_forward']:.0%}) "
              f"{r['step_time_s'] * 1e3:>8.1f} ms {r['time_overhead']:>+8.0%}  {same}")
        if r["cuda"]:
            print(f"{'':<12} CUDA max allocated {format_bytes(r['cuda']['max_memory_allocated'])}, "
                  f"ledger peak / (max allocated - unseen before) = {r['cuda']['ledger_over_allocator']:.3f}")
    print("\nact. peak = highest activations + temporaries over forward and backward (ledger; recomputed "
          "tensors are\nborn in backward, so they count as temporaries). reduction and overhead: against 'none'. "
          "Recompute FLOPs:\nbackward FLOPs minus none's, as a share of the forward's."
          + (" Step times are CPU wall clock: no GPU claim." if kind == "cpu" else ""))
    if args.snapshot:
        print(f"memory history written to {args.snapshot} (open it at https://pytorch.org/memory_viz)")


if __name__ == "__main__":
    run_lab(main)
