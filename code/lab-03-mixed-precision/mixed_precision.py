"""Lab 03 - mixed precision: fp32 against fp16 + GradScaler against bf16 autocast, on a toy GPT.

The same training loop runs three recipes; only two objects change between them:

    fp32  no autocast                          no scaler
    fp16  torch.autocast(device, float16)      torch.amp.GradScaler(device): loss scaling
    bf16  torch.autocast(device, bfloat16)     no scaler (bf16 has fp32's exponent range)

The memory ledger (labkit) shows what changes: parameters, gradients and AdamW state stay fp32
(the "master weights"), activations saved for backward shrink, autocast adds 16-bit weight copies.
``--inject-inf-at STEP`` puts an inf in an fp16 gradient: GradScaler skips the step, halves its scale.

Run it:
    python code/lab-03-mixed-precision/mixed_precision.py --device cpu
    python code/lab-03-mixed-precision/mixed_precision.py --device cpu --recipe fp16 --inject-inf-at 3
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # makes code/labkit importable

import torch  # noqa: E402

from labkit import GPTConfig, Ledger, SyntheticTokens, TinyGPT, UsageError, emit_json  # noqa: E402
from labkit import lab_parser, pick_device, progress, provenance, run_lab  # noqa: E402
from labkit.cli import non_negative_int, positive_float, positive_int, probability  # noqa: E402
from labkit.cuda import allocator_stats, ledger_vs_allocator, record_snapshot, reset_peak  # noqa: E402
from labkit.plot import format_bytes  # noqa: E402

LAB = "lab-03-mixed-precision"
RECIPES = ("fp32", "fp16", "bf16")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
LOSS_RTOL = 0.02  # every step's loss within 2 % of the fp32 loss at that step
ACTIVATION_BAND = (0.55, 0.80)  # 16-bit activations / fp32 activations, default CPU model


# --8<-- [start:config]
def parse_args(argv=None):
    p = lab_parser("Train a toy GPT in fp32, fp16 + GradScaler and bf16 autocast; compare loss and memory.")
    p.add_argument("--recipe", choices=[*RECIPES, "all"], default="all")
    p.add_argument("--steps", type=positive_int, default=20, help="training steps per recipe")
    p.add_argument("--ledger-steps", type=positive_int, default=2, help="steps under the ledger; the rest are timed")
    for flag, default in (("--batch-size", 8), ("--seq-len", 32), ("--width", 64), ("--layers", 2), ("--heads", 4),
                          ("--vocab", 256)):  # the model's size: tiny on a CPU, flags for a GPU-sized run
        p.add_argument(flag, type=positive_int, default=default)
    p.add_argument("--lr", type=positive_float, default=3e-3)
    p.add_argument("--dropout", type=probability, default=0.0)
    p.add_argument("--init-scale", type=positive_float, default=2.0**16, help="GradScaler's first scale")
    p.add_argument("--growth-interval", type=positive_int, default=2000, help="clean steps before the scale doubles")
    p.add_argument("--inject-inf-at", type=non_negative_int, metavar="STEP", help="fp16: put an inf in a gradient")
    p.add_argument("--snapshot", type=Path, help="CUDA only: dump a memory-history pickle for memory_viz")
    args = p.parse_args(argv)
    if args.width % args.heads:
        raise UsageError(f"--width {args.width} is not divisible by --heads {args.heads}")
    if args.inject_inf_at is not None and args.recipe not in ("fp16", "all"):
        raise UsageError("--inject-inf-at needs the fp16 recipe: only GradScaler skips a step on inf")
    if args.inject_inf_at is not None and args.inject_inf_at >= args.steps:
        raise UsageError(f"--inject-inf-at {args.inject_inf_at} is past the last step ({args.steps - 1})")
    return args
# --8<-- [end:config]


# --8<-- [start:recipes]
def autocast(recipe: str, device: torch.device):
    if recipe == "fp32":
        return contextlib.nullcontext()  # plain fp32: every op in fp32
    return torch.autocast(device.type, dtype=DTYPES[recipe])  # (1)!


def make_scaler(recipe: str, device: torch.device, args) -> torch.amp.GradScaler:
    return torch.amp.GradScaler(
        device.type,
        init_scale=args.init_scale,  # (2)!
        growth_factor=2.0,
        backoff_factor=0.5,  # (3)!
        growth_interval=args.growth_interval,
        enabled=recipe == "fp16",  # (4)!
    )


def check_autocast(recipe: str, device: torch.device) -> None:
    """Ask this torch whether it can autocast to the recipe's dtype here, instead of assuming."""
    with autocast(recipe, device):
        got = (torch.ones(2, 2, device=device) @ torch.ones(2, 2, device=device)).dtype
    if got != DTYPES[recipe]:
        raise UsageError(f"torch {torch.__version__} does not autocast matmuls to {recipe} on {device.type}")
# --8<-- [end:recipes]


# --8<-- [start:step]
def train_step(model, optimizer, scaler, recipe, x, y, ledger: Ledger, step: int, inject_inf=False) -> dict:
    with ledger.phase("zero_grad", step):
        optimizer.zero_grad(set_to_none=True)
    with ledger.phase("forward", step):
        with autocast(recipe, x.device):
            loss = model(x, y)[1]  # (1)!
    with ledger.phase("backward", step):
        scaler.scale(loss).backward()  # (2)!
        if inject_inf:
            model.head.weight.grad[0, 0] = float("inf")  # (3)!
    scale_before, updates_before = scaler.get_scale(), updates(optimizer)
    with ledger.phase("optimizer", step):
        scaler.step(optimizer)  # (4)!
        scaler.update()  # (5)!
    return {"step": step, "loss": loss.item(), "scale_before": scale_before, "scale_after": scaler.get_scale(),
            "skipped": updates(optimizer) == updates_before}  # (6)!


def updates(optimizer) -> int:
    """Updates AdamW has made: the step counter it keeps with each parameter (0 before the first)."""
    return int(optimizer.state.get(optimizer.param_groups[0]["params"][0], {}).get("step", 0))
# --8<-- [end:step]


# --8<-- [start:census]
def is_weight_copy(t: torch.Tensor) -> bool:
    """Autograd's graph says whether ``t`` is a (view of a) dtype cast of a parameter."""
    fn = t.grad_fn
    for _ in range(4):  # walk through views such as weight.t()
        if fn is None:
            return False
        if fn.name() == "ToCopyBackward0":  # (1)!
            return any(f is not None and "AccumulateGrad" in f.name() for f, _ in fn.next_functions)
        inputs = [f for f, _ in fn.next_functions if f is not None]
        fn = inputs[0] if len(inputs) == 1 else None
    return False


def saved_for_backward(model, recipe: str, x, y) -> dict[str, int]:
    """Bytes of the new tensors one forward saves for backward, by kind: the ledger's activations."""
    existing = {t.untyped_storage().data_ptr() for t in [*model.parameters(), x, y]}
    kinds: dict[int, tuple[str, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in existing and ptr not in kinds:  # (2)!
            kind = "16-bit weight copies" if is_weight_copy(t) else str(t.dtype).removeprefix("torch.")
            kinds[ptr] = (kind, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(recipe, x.device):
        model(x, y)  # (3)!
    return {k: sum(n for kind, n in kinds.values() if kind == k) for k in dict(kinds.values())}
# --8<-- [end:census]


@dataclass
class Run:
    recipe: str
    steps: list[dict]  # one record per step: loss, scale before and after, skipped, growth tracker
    ledger: Ledger  # the first --ledger-steps steps
    saved: dict[str, int]  # bytes one forward saves for backward, by kind
    cfg: GPTConfig
    param_dtypes: list[str]  # every recipe: float32, the master weights
    params: int
    linear_weights: int  # elements autocast casts to 16 bits in every forward
    scaler: torch.amp.GradScaler
    step_times_s: list[float]  # the steps after the ledger, timed bare
    inject: dict | None
    wall_time_s: float
    cuda: dict | None


# --8<-- [start:train]
def train(args, recipe: str) -> Run:
    device = pick_device(args.device)
    check_autocast(recipe, device)
    torch.manual_seed(args.seed)
    cfg = GPTConfig(vocab=args.vocab, seq_len=args.seq_len, width=args.width,
                    layers=args.layers, heads=args.heads, dropout=args.dropout)
    model = TinyGPT(cfg).to(device)  # (1)!
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scaler = make_scaler(recipe, device, args)
    data = SyntheticTokens(cfg.vocab, cfg.seq_len, seed=args.seed)
    ledger, bare = Ledger(device), Ledger(device)  # `bare` is never entered: it records nothing
    ledger.track_module(model).track_optimizer(optimizer)
    steps, times, inject = [], [], None

    def one_step(step: int, led: Ledger) -> None:
        nonlocal inject
        x, y = data.batch(step, args.batch_size, device)
        hit = recipe == "fp16" and step == args.inject_inf_at
        before = [p.detach().clone() for p in model.parameters()] if hit else []
        t = time.perf_counter()
        rec = train_step(model, optimizer, scaler, recipe, x, y, led, step, inject_inf=hit)
        times.append(time.perf_counter() - t)  # loss.item() in train_step waited for the device
        steps.append(rec | {"growth_tracker": scaler.state_dict().get("_growth_tracker", 0)})
        if hit:  # (2)!
            inject = steps[-1] | {"params_unchanged": all(map(torch.equal, before, model.parameters()))}

    reset_peak(device)
    t0, n_ledger = time.perf_counter(), min(args.ledger_steps, args.steps)
    with ledger:
        for step in range(n_ledger):
            one_step(step, ledger)
    for step in progress(range(n_ledger, args.steps), total=args.steps - n_ledger, desc=recipe, quiet=args.json):
        one_step(step, bare)
    wall, cuda = time.perf_counter() - t0, ledger_vs_allocator(ledger.timeline(), allocator_stats(device))
    saved = saved_for_backward(model, recipe, *data.batch(0, args.batch_size, device))  # (3)!
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return Run(recipe, steps, ledger, saved, cfg, dtypes, sum(p.numel() for p in model.parameters()), linear,
               scaler, times[n_ledger:], inject, wall, cuda)
# --8<-- [end:train]


def run_recipes(args) -> dict[str, Run]:
    device = pick_device(args.device)
    if args.snapshot and device.type != "cuda":
        raise UsageError("--snapshot needs a CUDA device (memory history is a CUDA allocator feature)")
    with record_snapshot(args.snapshot):
        return {recipe: train(args, recipe) for recipe in (RECIPES if args.recipe == "all" else (args.recipe,))}


def recipe_summary(run: Run) -> dict:
    tl = run.ledger.timeline()
    # GradScaler keeps its state in two one-element tensors on the device (private names: read, not written)
    tensors = {n: getattr(run.scaler, n, None) for n in ("_scale", "_growth_tracker")} if run.scaler.is_enabled() else {}
    out = {
        "autocast_dtype": None if run.recipe == "fp32" else run.recipe, "grad_scaler": run.scaler.is_enabled(),
        "losses": [s["loss"] for s in run.steps], "steps": run.steps,
        "skipped_steps": [s["step"] for s in run.steps if s["skipped"]],
        "parameter_dtypes": run.param_dtypes, "activation_bytes": max(tl.device["activations"], default=0),
        "peak_bytes": run.ledger.peak(tl), "peak_bytes_by_phase": run.ledger.peaks_by_phase(tl),
        "saved_for_backward": run.saved,
        "weight_copy_bytes_derived": 0 if run.recipe == "fp32" else 2 * run.linear_weights,
        "step_time_s": statistics.median(run.step_times_s) if run.step_times_s else None,
        "scaler_state": run.scaler.state_dict() if run.scaler.is_enabled() else None,
        "scaler_tensors": {n: {"dtype": str(t.dtype).removeprefix("torch."), "device": str(t.device), "value": t.item()}
                           for n, t in tensors.items() if isinstance(t, torch.Tensor)},
        "inject": run.inject, "cuda": run.cuda,
    }
    return out


def compare(base: dict, other: dict) -> dict:
    # An injected inf loses that step's update on purpose: from the next step on, fp16 trains another run.
    n = other["inject"]["step"] + 1 if other["inject"] else len(other["losses"])
    rel = max(abs(a - b) / abs(b) for a, b in zip(other["losses"][:n], base["losses"][:n]))
    ratio = other["activation_bytes"] / base["activation_bytes"] if base["activation_bytes"] else None
    speed = base["step_time_s"] / other["step_time_s"] if base["step_time_s"] and other["step_time_s"] else None
    return {"max_rel_loss_diff": rel, "losses_within_tolerance": rel <= LOSS_RTOL, "compared_steps": n,
            "activation_ratio": ratio, "in_band": ratio is not None and ACTIVATION_BAND[0] <= ratio <= ACTIVATION_BAND[1],
            "speedup_vs_fp32": speed}


def summary(runs: dict[str, Run]) -> dict:
    first = next(iter(runs.values()))
    recipes = {name: recipe_summary(run) for name, run in runs.items()}
    base = recipes.get("fp32")
    return {
        "lab": LAB, "device": str(first.ledger.device), "config": first.cfg.to_dict(), "params": first.params,
        "recipes": recipes,
        "vs_fp32": {n: compare(base, r) for n, r in recipes.items() if n != "fp32"} if base else {},
        "tolerances": {"loss_rtol": LOSS_RTOL, "activation_ratio_band": list(ACTIVATION_BAND)},
        "timing": "CPU timing, not a GPU figure" if first.ledger.device.type == "cpu" else "CUDA timing",
        "gpu_target": "bf16 step at least 1.8x faster than fp32 on an H100-class GPU: a target for the GPU run",
        "provenance": provenance.collect(LAB, first.ledger.device, sum(r.wall_time_s for r in runs.values())),
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    result = summary(run_recipes(args))
    if args.json:
        emit_json(result)
        return
    print(f"Lab 03 on {result['device']}: TinyGPT with {result['params']:,} parameters, AdamW, {args.steps} steps "
          f"per recipe, ledger on the first {min(args.ledger_steps, args.steps)}")
    if result["device"] == "cpu" and "fp16" in result["recipes"]:
        print("note: fp16 on CPU runs for real (autocast, GradScaler, overflows): its losses, bytes and scaler are\n"
              "      measured. Its speed is not a GPU figure: a CPU does not run fp16 matmuls as tensor cores do.")
    lo, hi = ACTIVATION_BAND
    print(f"\n| recipe | parameters | activations | vs fp32 (band {lo}-{hi}) | max loss diff vs fp32 (tolerance "
          f"{LOSS_RTOL:.0%}) | skipped steps | step time ({result['timing']}) |\n|---|---|---:|---:|---:|---:|---:|")
    for name, r in result["recipes"].items():
        c = result["vs_fp32"].get(name)
        ratio = f"{c['activation_ratio']:.3f}x, {'in' if c['in_band'] else 'OUT'}" if c else "-"
        diff = f"{c['max_rel_loss_diff']:.2%}, {'within' if c['losses_within_tolerance'] else 'over'}" if c else "-"
        if c and r["inject"]:
            diff += f", steps 0-{c['compared_steps'] - 1} (the update of step {r['inject']['step']} was lost on purpose)"
        t = f"{r['step_time_s'] * 1e3:.1f} ms" if r["step_time_s"] else "-"
        print(f"| {name} | {','.join(r['parameter_dtypes'])} | {format_bytes(r['activation_bytes'])} | {ratio} | {diff} "
              f"| {len(r['skipped_steps'])} | {t} |")
    for name, r in result["recipes"].items():
        print(f"saved for backward ({name}): " + ", ".join(f"{k} {format_bytes(v)}" for k, v in r["saved_for_backward"].items()))
        if c := r["cuda"]:
            print(f"  CUDA allocator: max allocated {format_bytes(c['max_memory_allocated'])}, reserved "
                  f"{format_bytes(c['max_memory_reserved'])}; ledger peak / (max allocated - unseen by the ledger "
                  f"when the run began) {c['ledger_over_allocator']:.3f}")
    if fp16 := result["recipes"].get("fp16"):
        print(f"\nGradScaler.state_dict(): {fp16['scaler_state']}")
        for name, t in fp16["scaler_tensors"].items():
            print(f"  scaler.{name}: a one-element {t['dtype']} tensor on {t['device']}, value {t['value']:g}")
        if inj := fp16["inject"]:
            print(f"injected inf at step {inj['step']}: scale {inj['scale_before']:g} -> {inj['scale_after']:g}; step "
                  f"skipped: {'yes' if inj['skipped'] else 'NO'}; parameters unchanged: {'yes' if inj['params_unchanged'] else 'NO'}"
                  f"; growth tracker reset to {inj['growth_tracker']}. A skipped step is a lost update: the curve lags.")
    if args.snapshot:
        print(f"memory history written to {args.snapshot} (open it at https://pytorch.org/memory_viz)")


if __name__ == "__main__":
    run_lab(main)
