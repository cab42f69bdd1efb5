"""Lab 09 - activation offload: the tensors backward needs, kept on the host until it needs them.

Autograd keeps ("saves") tensors in forward for backward. Saved-tensor hooks decide where they
wait: ``pack`` runs when an op saves a tensor, ``unpack`` when backward asks for it. Five modes:

    none                 every saved tensor stays on the device (the reference)
    save_on_cpu          torch.autograd.graph.save_on_cpu: every saved tensor copied to the host in
                         forward, copied back when backward asks (the synchronous baseline)
    streamed             our hooks: pinned host buffers, a copy stream, prefetch in backward, the
                         last few and the tiny saved tensors kept on the device
    checkpoint           Lab 04's full checkpointing: each block keeps only its input
    checkpoint+streamed  checkpointing, and the block inputs it keeps streamed to the host

The ledger measures device bytes and host copies; gradients are compared with ``torch.equal``.

Run it:
    python code/lab-09-activation-offload/activation_offload.py --device cpu
    python code/lab-09-activation-offload/activation_offload.py --mode streamed --keep-last 0 --json
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from pathlib import Path

CODE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(CODE))  # makes code/labkit importable
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the hooks next to this file
sys.path.insert(0, str(CODE / "lab-04-activation-checkpointing"))  # Lab 04's model set-up

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from labkit import Ledger, TinyGPT, UsageError, emit_json  # noqa: E402
from labkit import lab_parser, progress, provenance, run_lab  # noqa: E402
from labkit.cli import non_negative_int, positive_int, probability  # noqa: E402
from labkit.cuda import allocator_stats, ledger_vs_allocator, record_snapshot, reset_peak  # noqa: E402
from labkit.plot import format_bytes  # noqa: E402
from checkpointing import build, grads_equal  # noqa: E402  (Lab 04's model, batch, gradient check)
from offload_hooks import LabelledSaveOnCpu, StreamedOffload  # noqa: E402

LAB = "lab-09-activation-offload"
MODES = ("none", "save_on_cpu", "streamed", "checkpoint", "checkpoint+streamed")


def parse_args(argv=None):
    p = lab_parser("Offload saved activations to the host: save_on_cpu, streamed, with checkpointing.")
    p.add_argument("--mode", choices=[*MODES, "all"], default="all",
                   help="measured against 'none' (checkpoint+streamed also against 'checkpoint')")
    p.add_argument("--keep-last", type=non_negative_int, default=2,
                   help="streamed: the last N offloadable saved tensors stay on the device")
    p.add_argument("--min-bytes", type=non_negative_int, default=4096,
                   help="streamed: saved tensors smaller than this stay on the device")
    p.add_argument("--prefetch", type=non_negative_int, default=2,
                   help="streamed: saved tensors copied back ahead of backward's need")
    p.add_argument("--steps", type=positive_int, default=3, help="timed forward+backward steps per mode")
    p.add_argument("--batch-size", type=positive_int, default=4)
    p.add_argument("--seq-len", type=positive_int, default=64)
    p.add_argument("--width", type=positive_int, default=64)
    p.add_argument("--layers", type=positive_int, default=8)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--vocab", type=positive_int, default=256)
    p.add_argument("--dropout", type=probability, default=0.1)
    p.add_argument("--snapshot", type=Path, help="CUDA only: dump a memory-history pickle for memory_viz")
    args = p.parse_args(argv)
    if args.width % args.heads:
        raise UsageError(f"--width {args.width} is not divisible by --heads {args.heads}")
    return args


# --8<-- [start:forward]
def make_hooks(mode, model, batch, args, device, tag=None):
    tag = tag or (lambda category: contextlib.nullcontext())  # no ledger
    if mode == "save_on_cpu":
        return LabelledSaveOnCpu(device, tag)
    if mode.endswith("streamed"):
        resident = [*model.parameters(), *batch]  # (1)!
        return StreamedOffload(device, args.keep_last, args.min_bytes,
                               args.prefetch, resident, tag)
    return None  # none, checkpoint: no hooks of ours


def forward(model: TinyGPT, idx, targets, mode: str, hooks):
    """TinyGPT.forward written out: the loop over blocks is ours to wrap."""
    nothing = contextlib.nullcontext()
    everything = hooks if mode in ("save_on_cpu", "streamed") else nothing  # (2)!
    block_inputs = hooks if mode == "checkpoint+streamed" else nothing  # (3)!
    with everything:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = model.drop(model.tok(idx) + model.pos(pos))
        with block_inputs:
            for block in model.blocks:
                if mode.startswith("checkpoint"):
                    x = checkpoint(block, x, use_reentrant=False)  # (4)!
                else:
                    x = block(x)
        logits = model.head(model.ln_f(x))
        logits = logits.view(-1, logits.size(-1))
        return F.cross_entropy(logits, targets.reshape(-1))
# --8<-- [end:forward]


# --8<-- [start:step]
def train_step(model, x, y, mode, args, seed, ledger: Ledger | None = None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # same dropout masks in every mode
    phase = ledger.phase if ledger else (lambda *a: contextlib.nullcontext())
    tag = ledger.category if ledger else None
    hooks = make_hooks(mode, model, (x, y), args, x.device, tag)
    with phase("forward", 0):
        loss = forward(model, x, y, mode, hooks)
    with phase("backward", 0):
        loss.backward()  # (1)!
    return loss.item(), hooks
# --8<-- [end:step]


# --8<-- [start:measure]
def measure(model, x, y, mode, args, seed) -> tuple[dict, list]:
    ledger = Ledger(x.device)
    ledger.track_module(model)
    ledger.track((x, y), "other")
    with ledger:  # outermost: the hooks and checkpoint run inside it  (1)!
        _, hooks = train_step(model, x, y, mode, args, seed, ledger)
    tl = ledger.timeline()
    fwd = next(s for s in tl.spans if s.name == "forward")
    act, tmp = tl.device["activations"], tl.device["temporaries"]
    host = tl.host["host_copies"]
    return {
        "kept_bytes": act[fwd.end - 1],  # device activations when forward ends
        "activation_peak_bytes": max(a + t for a, t in zip(act, tmp)),  # (2)!
        "host_bytes_after_forward": host[fwd.end - 1],  # (3)!
        "host_peak_bytes": max(host),
        "peak_bytes": ledger.peak(tl)["total"],
        "d2h_bytes": getattr(hooks, "d2h_bytes", 0),
        "h2d_bytes": getattr(hooks, "h2d_bytes", 0),
        "tensors_moved": getattr(hooks, "moved", 0),
        "fetched_on_demand": getattr(hooks, "on_demand", 0),
        "ledger": ledger,
    }, grads_of(model)
# --8<-- [end:measure]


def grads_of(model) -> list[torch.Tensor]:
    return [p.grad.detach().to("cpu", copy=True) for p in model.parameters()]  # a copy, off the device


def time_steps(model, x, y, modes, args, quiet: bool) -> dict[str, list[float]]:
    """Seconds per forward+backward step, modes interleaved so that drift hits all alike."""
    times: dict[str, list[float]] = {m: [] for m in modes}
    for m in modes:
        train_step(model, x, y, m, args, args.seed)  # warm-up (allocator, pinned pool, kernels)
    for _ in progress(range(args.steps), total=args.steps, desc="timing", quiet=quiet):
        for m in modes:
            t0 = time.perf_counter()
            train_step(model, x, y, m, args, args.seed)  # .item() inside waits for the device
            times[m].append(time.perf_counter() - t0)
    return times


# --8<-- [start:run]
def run(args) -> dict:
    cfg, device, model, x, y = build(args)
    modes = {"all": MODES, "none": ("none",),
             "checkpoint+streamed": ("none", "checkpoint", "checkpoint+streamed")
             }.get(args.mode, ("none", args.mode))
    t0, results = time.perf_counter(), {}
    train_step(model, x, y, "none", args, args.seed)
    reference = grads_of(model)  # a plain step: no hooks, checkpoint or ledger
    with record_snapshot(args.snapshot):
        for m in modes:
            reset_peak(device)
            r, grads = measure(model, x, y, m, args, args.seed)
            r["cuda"] = allocator_stats(device)
            equal, diff = grads_equal(grads, reference)  # (1)!
            r["grads_equal"], r["max_abs_grad_diff"] = equal, diff
            train_step(model, x, y, m, args, args.seed)
            equal, _ = grads_equal(grads_of(model), reference)
            r["grads_equal_without_ledger"] = equal
            results[m] = r
    times = time_steps(model, x, y, modes, args, args.json)
    peak = {m: r["activation_peak_bytes"] for m, r in results.items()}
    step = {m: statistics.median(t) for m, t in times.items()}
    for m, r in results.items():
        r["step_times_s"], r["step_time_s"] = times[m], step[m]
        r["activation_reduction"] = 1 - peak[m] / peak["none"]
        r["time_overhead"] = step[m] / step["none"] - 1
        base = "checkpoint" if m == "checkpoint+streamed" else "none"  # (2)!
        r["baseline"] = base
        r["reduction_vs_baseline"] = 1 - peak[m] / peak[base]
        r["overhead_vs_baseline"] = step[m] / step[base] - 1
    return {"cfg": cfg, "device": device, "model": model, "results": results,
            "wall_time_s": time.perf_counter() - t0}
# --8<-- [end:run]


def summary(out: dict, args) -> dict:
    results = {m: {k: v for k, v in r.items() if k != "ledger"} for m, r in out["results"].items()}
    for m, r in results.items():  # cuBLAS workspaces and other bytes unseen by the ledger set aside
        if r["cuda"]:
            r["cuda"] = ledger_vs_allocator(out["results"][m]["ledger"].timeline(), r["cuda"])
    return {
        "lab": LAB, "device": str(out["device"]), "config": out["cfg"].to_dict(),
        "batch_size": args.batch_size, "keep_last": args.keep_last, "min_bytes": args.min_bytes,
        "prefetch": args.prefetch, "modes": list(results),
        "block_input_bytes": args.batch_size * args.seq_len * args.width * 4,
        "activation_memory": "activation_peak_bytes: highest device activations + temporaries over forward and "
                             "backward; host copies are counted apart (host_peak_bytes)",
        "timing": f"median wall-clock seconds of {args.steps} forward+backward steps on {out['device'].type}",
        "results": results,
        "provenance": provenance.collect(LAB, out["device"], out["wall_time_s"]),
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    result = summary(run(args), args)
    if args.json:
        emit_json(result)
        return
    c, kind = result["config"], result["device"].split(":")[0]
    print(f"Lab 09 on {result['device']}: TinyGPT, {c['layers']} blocks of width {c['width']}, batch "
          f"{args.batch_size} x {c['seq_len']} tokens; keep-last {args.keep_last}, min-bytes {args.min_bytes}, "
          f"prefetch {args.prefetch}\n")
    print(f"{'mode':<20} {'kept after fwd':>14} {'act. peak':>10} {'reduction':>9} {'host copies':>11} "
          f"{'moved D2H':>10} {'step (' + kind + ')':>11} {'overhead':>8}  gradients vs none")
    for m, r in result["results"].items():
        same = "reference" if m == "none" else "identical" if r["grads_equal"] else \
            f"differ by up to {r['max_abs_grad_diff']:.1e}"
        print(f"{m:<20} {format_bytes(r['kept_bytes']):>14} {format_bytes(r['activation_peak_bytes']):>10} "
              f"{r['activation_reduction']:>9.0%} {format_bytes(r['host_peak_bytes']):>11} "
              f"{format_bytes(r['d2h_bytes']):>10} {r['step_time_s'] * 1e3:>8.1f} ms {r['time_overhead']:>+8.0%}  {same}")
        if r["baseline"] != "none":
            print(f"{'':<20} against {r['baseline']}: activation peak {r['reduction_vs_baseline']:.0%} lower, "
                  f"step {r['overhead_vs_baseline']:+.0%}")
        if r["cuda"]:
            print(f"{'':<20} CUDA max allocated {format_bytes(r['cuda']['max_memory_allocated'])}, "
                  f"ledger peak / (max allocated - unseen before) = {r['cuda']['ledger_over_allocator']:.3f}")
    print("\nact. peak = highest device activations + temporaries over forward and backward (ledger); host copies = "
          "highest\nbytes labelled host_copies. reduction and overhead: against 'none'."
          + (" On CPU the host and the 'device'\nare the same RAM: the ledger keeps them apart by label, and step "
             "times are CPU wall clock (no GPU claim)." if kind == "cpu" else ""))
    if args.snapshot:
        print(f"memory history written to {args.snapshot} (open it at https://pytorch.org/memory_viz)")


if __name__ == "__main__":
    run_lab(main)
