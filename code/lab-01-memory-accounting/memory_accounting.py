"""Lab 01 - where the bytes of a transformer go: the memory ledger as formulas, checked by measurement.

Model state is bytes per parameter x P (parameters, gradients, fp32 master weights, optimizer state).
Activations follow Korthikanti et al. 2022, layer by layer. The KV cache of inference is
2 x layers x batch x seq x kv_heads x head_dim elements. ZeRO (Rajbhandari et al. 2020) divides the
model state across N data-parallel ranks, stage by stage. ``--measure`` runs one training step of the
toy GPT of the same shape under the memory ledger (labkit) and prints measured bytes next to the formulas.

Run it:
    python code/lab-01-memory-accounting/memory_accounting.py --params 7e9 --precision mixed --zero-stage 3 --dp 8
    python code/lab-01-memory-accounting/memory_accounting.py --layers 32 --hidden 4096 --heads 32 --seq 2048 --batch 1 --vocab 50304
    python code/lab-01-memory-accounting/memory_accounting.py --device cpu --measure
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]  # labkit, this lab

import torch  # noqa: E402

from labkit import GPTConfig, Ledger, SyntheticTokens, TinyGPT, UsageError, emit_json  # noqa: E402
from labkit import lab_parser, pick_device, provenance, run_lab  # noqa: E402
from labkit.cli import positive_int, probability  # noqa: E402
from labkit.cuda import allocator_stats, record_snapshot, reset_peak  # noqa: E402
from labkit.ledger import counted_bytes  # noqa: E402
from labkit.plot import format_bytes  # noqa: E402
from toy_gpt import Shape, gap_to_paper, param_count, param_tensors, tinygpt_activation_bytes  # noqa: E402

LAB = "lab-01-memory-accounting"


# --8<-- [start:recipes]
@dataclass(frozen=True)
class Recipe:
    param: int  # bytes of the working copy of one parameter (what forward reads)
    grad: int  # bytes of its gradient
    master: int  # bytes of an fp32 master copy kept for the optimizer (0: none)
    moment: int  # bytes of one optimizer moment (momentum, Adam's m or v)
    act: int  # bytes of one activation element


RECIPES = {
    "fp32": Recipe(param=4, grad=4, master=0, moment=4, act=4),  # (1)!
    "mixed": Recipe(param=2, grad=2, master=4, moment=4, act=2),  # (2)!
    "bf16": Recipe(param=2, grad=2, master=0, moment=2, act=2),  # (3)!
}
MOMENTS = {"sgd": 0, "momentum": 1, "adamw": 2}  # (4)!
STEP_COUNTER = 4  # Adam and AdamW keep one fp32 step count per parameter tensor
MASK = 1  # the paper's dropout mask: one byte per element
# --8<-- [end:recipes]


# --8<-- [start:model_state]
def model_state_bytes(params: int, precision: str = "fp32", optimizer: str = "adamw",
                      tensors: int = 0) -> dict[str, int]:
    """Parameters, gradients, master weights, optimizer state (ZeRO paper, section 3.1)."""
    r = RECIPES[precision]
    counters = STEP_COUNTER * tensors if optimizer == "adamw" else 0
    return {"parameters": r.param * params,
            "gradients": r.grad * params,
            "master_weights": r.master * params,  # (1)!
            "optimizer_state": MOMENTS[optimizer] * r.moment * params + counters}  # (2)!


ZERO_SHARDS = {"optimizer_state": 1, "master_weights": 1, "gradients": 2, "parameters": 3}  # (3)!


def zero_model_state(params: int, precision: str = "fp32", optimizer: str = "adamw",
                     zero_stage: int = 0, dp: int = 1, tensors: int = 0) -> dict[str, int]:
    """Model state on ONE of dp ranks under ZeRO stage 0-3 (ZeRO paper, section 5)."""
    full = model_state_bytes(params, precision, optimizer, tensors)
    shard = model_state_bytes(-(-params // dp), precision, optimizer, tensors)  # (4)!
    return {k: shard[k] if zero_stage >= ZERO_SHARDS[k] else full[k] for k in full}
# --8<-- [end:model_state]


# --8<-- [start:activations]
def activation_bytes_per_layer(seq: int, batch: int, hidden: int, heads: int, act: int = 2,
                               mask: int | None = MASK, recompute: str = "none") -> int:
    """Bytes one transformer layer keeps for backward (Korthikanti et al. 2022, 4.1 and 5).

    act=2, mask=1: the paper's s*b*h*(34 + 5*a*s/h). mask=None: no dropout at all."""
    sbh = seq * batch * hidden
    if recompute == "full":
        return act * sbh  # (1)!
    drop = mask is not None
    per_layer = (16 * act + (2 * mask if drop else 0)) * sbh  # (2)!
    if recompute == "none":
        scores = heads * seq * seq * batch  # one s x s matrix per head
        per_layer += (act + (act + mask if drop else 0)) * scores  # (3)!
    return per_layer


def kv_cache_bytes(shape: Shape, act: int = 2) -> int:
    """Inference: a key and a value per layer, token and KV head (2 x L x b x s x kv x d)."""
    kv_heads = shape.kv_heads or shape.heads
    head_dim = shape.hidden // shape.heads
    return 2 * shape.layers * shape.batch * shape.seq * kv_heads * head_dim * act  # (4)!
# --8<-- [end:activations]


# --8<-- [start:estimate]
def estimate_bytes(params: int | None = None, shape: Shape | None = None,
                   precision: str = "fp32", optimizer: str = "adamw", zero_stage: int = 0,
                   dp: int = 1, recompute: str = "none", dropout: bool = True,
                   inference: bool = False) -> dict[str, int]:
    """The ledger in one call: bytes per category held by ONE of dp data-parallel ranks.

    Give params (a count) or a shape; only a shape has activations and a KV cache."""
    if (params is None) == (shape is None) or (inference and shape is None):
        raise ValueError("give params or a shape, not both (inference needs a shape)")
    r = RECIPES[precision]
    if inference:  # (1)!
        return {"parameters": r.param * param_count(shape),
                "kv_cache": kv_cache_bytes(shape, r.act)}
    if shape is None:
        return zero_model_state(params, precision, optimizer, zero_stage, dp)
    out = zero_model_state(param_count(shape), precision, optimizer, zero_stage, dp,
                           param_tensors(shape))
    per_layer = activation_bytes_per_layer(shape.seq, shape.batch, shape.hidden, shape.heads,
                                           r.act, MASK if dropout else None, recompute)
    out["activations"] = shape.layers * per_layer  # (2)!
    return out
# --8<-- [end:estimate]


# --8<-- [start:measure]
def train_step(model, optimizer, x, y, ledger: Ledger, masters=()) -> float:
    with ledger.phase("forward", 0):
        loss = model(x, y)[1]  # (1)!
    with ledger.phase("backward", 0):
        loss.backward()
    with ledger.phase("optimizer", 0):
        for p, master in zip(model.parameters(), masters):  # (2)!
            master.grad = p.grad.float()
        optimizer.step()  # (3)!
        with torch.no_grad():
            for p, master in zip(model.parameters(), masters):
                p.copy_(master)  # the updated master, rounded into the 16-bit working copy
                master.grad = None
    return loss.item()


def measure(args, shape: Shape) -> dict:
    """One training step of TinyGPT with this shape under the ledger: bytes by category."""
    device = pick_device(args.device)
    if args.snapshot and device.type != "cuda":
        raise UsageError("--snapshot needs a CUDA device (memory history is a CUDA feature)")
    torch.manual_seed(args.seed)
    cfg = GPTConfig(vocab=shape.vocab, seq_len=shape.seq, width=shape.hidden,
                    layers=shape.layers, heads=shape.heads, dropout=args.dropout)
    model = TinyGPT(cfg).to(device=device, dtype=torch.float32 if args.precision == "fp32" else torch.bfloat16)
    masters = [p.detach().float() for p in model.parameters()] if args.precision == "mixed" else []  # (4)!
    trained = masters or list(model.parameters())  # mixed: the optimizer updates the fp32 masters
    optimizer = (torch.optim.AdamW(trained, lr=1e-3) if args.optimizer == "adamw" else
                 torch.optim.SGD(trained, lr=1e-3, momentum=0.9 if args.optimizer == "momentum" else 0.0))
    x, y = SyntheticTokens(cfg.vocab, cfg.seq_len, seed=args.seed).batch(0, shape.batch, device)
    ledger = Ledger(device).track_module(model).track_optimizer(optimizer)
    ledger.track(masters, "parameters")  # the ledger has no master category: counted apart below
    reset_peak(device)
    with record_snapshot(args.snapshot), ledger:
        loss = train_step(model, optimizer, x, y, ledger, masters)
    tl = ledger.timeline()
    forward = next(s for s in tl.spans if s.name == "forward")
    now = ledger.current()  # (5)!
    measured = {k: now[k] for k in ("parameters", "gradients", "optimizer_state")}
    measured["master_weights"] = sum(counted_bytes(m.untyped_storage().nbytes(), device) for m in masters)
    measured["parameters"] -= measured["master_weights"]
    measured["optimizer_state_on_host"] = tl.host["optimizer_state"][-1]  # (6)!
    measured["activations"] = tl.device["activations"][forward.end - 1]  # (7)!
    elem = RECIPES[args.precision].act
    return {"device": str(device), "loss": loss, "measured": measured,
            "tinygpt_activations": tinygpt_activation_bytes(cfg, shape.batch, elem),  # (8)!
            "gap_to_paper": gap_to_paper(cfg, shape.batch, elem),
            "peak_bytes": ledger.peak()["total"], "exact": device.type == "cpu",
            "cuda": allocator_stats(device), "ledger": ledger}
# --8<-- [end:measure]


def whole_number(text: str) -> int:
    """``--params 7e9``: a count written as an integer or in scientific notation."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number such as 7e9, got {text!r}") from None
    if not (value >= 1 and value.is_integer()):
        raise argparse.ArgumentTypeError(f"must be a whole number of parameters, 1 or more, got {text}")
    return int(value)


# --8<-- [start:config]
SHAPE_FLAGS = ("layers", "hidden", "heads", "seq", "batch", "vocab", "kv_heads")
CPU_MEASURE_LIMIT = 2 * 2**30  # --measure on CPU refuses shapes whose formulas exceed this
TOY = {"layers": 2, "hidden": 128, "heads": 4, "seq": 64, "batch": 8, "vocab": 256, "kv_heads": None}


def parse_args(argv=None):
    p = lab_parser("The memory ledger of a transformer: formulas per category, per rank, checked by --measure.")
    p.add_argument("--params", type=whole_number, help="parameter count (7e9 works); instead of a shape")
    for name in SHAPE_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), type=positive_int, help=f"model shape: {name} (toy default {TOY[name]})")
    p.add_argument("--precision", choices=list(RECIPES), default="fp32",
                   help="fp32; mixed: 16-bit weights and activations, fp32 master weights and states; bf16: pure bf16")
    p.add_argument("--optimizer", choices=list(MOMENTS), default="adamw")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=0)
    p.add_argument("--dp", type=positive_int, default=1, help="data-parallel ranks; figures are per rank")
    p.add_argument("--recompute", choices=["none", "selective", "full"], help="activation recomputation (shape only)")
    p.add_argument("--dropout", type=probability, default=0.1, help="0 removes the dropout masks (default 0.1)")
    p.add_argument("--inference", action="store_true", help="weights and KV cache instead of a training step")
    p.add_argument("--measure", action="store_true", help="run one step of the toy GPT under the ledger")
    p.add_argument("--snapshot", type=Path, help="CUDA only, with --measure: dump a memory-history pickle")
    args = p.parse_args(argv)
    given = [f"--{n.replace('_', '-')}" for n in SHAPE_FLAGS if getattr(args, n) is not None]
    if args.params is not None and given:
        raise UsageError(f"--params and a model shape ({' '.join(given)}) exclude each other: --params gives the "
                         "model state only; activations need the whole shape")
    for flag in ("recompute", "inference", "measure"):
        if args.params is not None and getattr(args, flag):
            raise UsageError(f"--{flag} needs a model shape (--layers --hidden --heads --seq --batch --vocab), not --params")
    vars(args).update({n: TOY[n] for n in SHAPE_FLAGS if getattr(args, n) is None})  # the toy shape by default
    args.recompute = args.recompute or "none"
    if args.hidden % args.heads:
        raise UsageError(f"--heads {args.heads} does not divide --hidden {args.hidden}")
    if args.kv_heads and args.heads % args.kv_heads:
        raise UsageError(f"--kv-heads {args.kv_heads} does not divide --heads {args.heads}")
    if args.inference and (args.zero_stage or args.measure):
        raise UsageError("--inference counts weights and KV cache; it takes no --zero-stage or --measure")
    if args.measure and (args.dp > 1 or args.zero_stage):
        raise UsageError("--measure runs one process: drop --dp and --zero-stage (ZeRO per rank is Lab 11)")
    if args.snapshot and not args.measure:
        raise UsageError("--snapshot records the --measure run: add --measure --device cuda")
    return args
# --8<-- [end:config]


def formula_text(category: str, args, shape: Shape | None) -> str:
    """The formula behind one category of the report, with this run's numbers in it."""
    r = RECIPES[args.precision]
    e, m = f"e={r.act}", f"m={MASK}"
    kept = {"none": f"L x [sbh(16e+2m) + as^2b(2e+m)], {e}, {m}", "selective": f"L x sbh(16e+2m), {e}, {m}"}
    if not args.dropout:  # no masks: 16 units of sbh and one s x s matrix per head (activations, (3))
        kept = {"none": f"L x [sbh x 16e + as^2b x e], {e}, no dropout", "selective": f"L x sbh x 16e, {e}, no dropout"}
    fixed = {"kv_cache": f"2 x L x b x s x kv_heads x head_dim x {r.act} B",
             "activations": (kept | {"full": f"L x sbh x e, {e}"})[args.recompute]}
    if category in fixed:
        return fixed[category]
    coeff = {"parameters": r.param, "gradients": r.grad, "master_weights": r.master,
             "optimizer_state": MOMENTS[args.optimizer] * r.moment}[category]
    shard = f" / {args.dp}" if args.zero_stage >= ZERO_SHARDS[category] and args.dp > 1 else ""
    adam = category == "optimizer_state" and args.optimizer == "adamw" and shape is not None
    return f"{coeff} B x P{shard}" + (f" + 4 B x {param_tensors(shape)} tensors" if adam else "")


def main(argv=None) -> None:
    args = parse_args(argv)
    t0 = time.perf_counter()
    shape = None if args.params is not None else Shape(**{n: getattr(args, n) for n in SHAPE_FLAGS})
    n_params = args.params if shape is None else param_count(shape)
    est = estimate_bytes(args.params, shape, args.precision, args.optimizer, args.zero_stage, args.dp,
                         args.recompute, args.dropout > 0, args.inference)
    if args.measure and pick_device(args.device).type == "cpu" and sum(est.values()) > CPU_MEASURE_LIMIT:
        raise UsageError(f"--measure on CPU is for toy shapes: the formulas give {format_bytes(sum(est.values()))} "
                         f"(limit {format_bytes(CPU_MEASURE_LIMIT)}); shrink the shape")
    run = measure(args, shape) if args.measure else None
    result = {"lab": LAB, "params": n_params, "shape": asdict(shape) if shape else None, "precision": args.precision,
              "optimizer": None if args.inference else args.optimizer, "zero_stage": args.zero_stage, "dp": args.dp,
              "recompute": args.recompute if shape else None, "dropout": args.dropout, "inference": args.inference,
              "bytes": est, "total_bytes": sum(est.values()), "formulas": {k: formula_text(k, args, shape) for k in est}}
    if run:
        result["measure"] = {k: v for k, v in run.items() if k != "ledger"}
    device = torch.device(run["device"]) if run else torch.device("cpu")
    result["provenance"] = provenance.collect(LAB, device, time.perf_counter() - t0)
    if args.json:
        emit_json(result)
        return
    print(f"Lab 01 · derived ledger, bytes per rank: {n_params:,} parameters, {args.precision}, "
          f"{'inference' if args.inference else args.optimizer}, ZeRO stage {args.zero_stage}, {args.dp} rank(s)")
    if shape:
        print("shape: " + ", ".join(f"{k} {v}" for k, v in asdict(shape).items() if v is not None))
    print("\n| category | formula | bytes | GB (1e9) | GiB |\n|---|---|---:|---:|---:|")
    for k, v in [*est.items(), ("total", result["total_bytes"])]:
        print(f"| {k.replace('_', ' ')} | {result['formulas'].get(k, '')} | {v:,} | {v / 1e9:,.3f} | {v / 2**30:,.3f} |")
    if run:
        report_measure(run, est, shape, args)


def report_measure(run: dict, est: dict, shape: Shape, args) -> None:
    m, tiny = run["measured"], run["tinygpt_activations"]
    host = STEP_COUNTER * param_tensors(shape) if run["device"] != "cpu" and args.optimizer == "adamw" else 0
    print(f"\nMeasured on {run['device']}: one step of TinyGPT of this shape under the ledger")
    print("| category | measured | derived | measured - derived | derived by |\n|---|---:|---:|---:|---|")
    for name, want, how in [("parameters", est["parameters"], "formula"), ("gradients", est["gradients"], "formula"),
                            ("master_weights", est["master_weights"], "formula"),
                            ("optimizer_state", est["optimizer_state"] - host, "formula" + ", less the counters" * bool(host)),
                            ("optimizer_state_on_host", host, "4 B x tensors: AdamW's step counters, on the host"),
                            ("activations", est["activations"], "paper formula, transformer layers only"),
                            ("activations", tiny["total"], "TinyGPT's saved tensors (toy_gpt.py)")]:
        if want or m[name] or name not in ("master_weights", "optimizer_state_on_host"):  # no rows of zeros
            print(f"| {name.replace('_', ' ')} | {m[name]:,} | {want:,} | {m[name] - want:+,} | {how} |")
    print("\nTinyGPT's saved tensors minus the paper's formula, term by term (derived" + (")" if run["exact"] else
          ", for CPU kernels)") + ":")
    for why, nbytes in run["gap_to_paper"]:
        print(f"  {nbytes:+,} B  {why}")
    print(f"Peak of the step {run['peak_bytes']:,} B: activations die in backward as gradients are born, "
          "and temporaries sit on top, so the peak is not the sum of the categories.")
    if run["cuda"]:
        print(f"CUDA max allocated {run['cuda']['max_memory_allocated']:,} B. The ledger rounds every tensor up to 512-byte "
              "blocks, as the caching allocator does: the small device gaps above are that rounding." + (" AdamW keeps "
              "its step counters on the host for CUDA parameters (torch/optim/adam.py): their own row." if host else ""))


if __name__ == "__main__":
    run_lab(main)
