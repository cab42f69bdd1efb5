"""Training levers on one GPU: the speedups and overheads Labs 03, 04 and 09 are held to, in one run.

    python bench/training_bench.py --device cuda                    # writes results/training_bench.json
    python bench/training_bench.py --device cpu --out /tmp/t.json   # a smoke run; CPU times only

One process runs each lab's own measurement (its ``run`` and ``summary``, unchanged) at GPU size:
1. Lab 03: fp32, fp16 + GradScaler and bf16 autocast training steps; step speed and activation bytes
   as ratios against fp32 (target: bf16 at least 1.8x faster on an H100-class GPU);
2. Lab 04: no checkpointing, full, every-k and save-matmuls; activation peak reduction and step-time
   overhead against no checkpointing (targets: ``GPU_TARGETS`` in the lab);
3. Lab 09: checkpointing alone against checkpointing with streamed activation offload; activation
   peak reduction and step-time overhead (target: at least 50 % lower at no more than 10 % more
   time), and the synchronous ``save_on_cpu`` against the streamed hooks.

Each lab interleaves its variants step by step, so that drift on the machine hits all of them alike.
The rows go to the performance page with the source hash of the lab that produced them, so a row
measured on older lab code says so.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "code"))

import torch  # noqa: E402

from labkit import emit_json, lab_parser, pick_device, progress, provenance, run_lab  # noqa: E402
from labkit.cli import positive_int  # noqa: E402
from labkit.notebook import load_lab  # noqa: E402

BENCH = "training"
RESULT_FILE = "results/training_bench.json"  # the GPU run; a CPU run writes results/training_bench.cpu.json
LABS = {"lab-03-mixed-precision": "mixed_precision.py", "lab-04-activation-checkpointing": "checkpointing.py",
        "lab-09-activation-offload": "activation_offload.py"}
BF16_TARGET = 1.8  # Lab 03's issue: a bf16 step at least 1.8x faster than fp32 on an H100-class GPU
OFFLOAD_TARGET = {"min_reduction": 0.50, "max_overhead": 0.10}  # Lab 09's issue, against checkpointing alone

# The model sizes of the labs' own cuda tests; a CPU smoke run uses each lab's small defaults.
GPU_SIZES = {
    "lab-03-mixed-precision": ["--width", "1024", "--layers", "8", "--heads", "16", "--seq-len", "512",
                               "--batch-size", "16"],
    "lab-04-activation-checkpointing": ["--width", "1024", "--layers", "16", "--heads", "16", "--seq-len", "1024",
                                        "--batch-size", "8"],
    "lab-09-activation-offload": ["--width", "1024", "--layers", "32", "--heads", "16", "--seq-len", "1024",
                                  "--batch-size", "8"],
}


def parse_args(argv=None):
    p = lab_parser("Benchmark the training levers of Labs 03, 04 and 09 side by side, as ratios.")
    p.add_argument("--steps", type=positive_int, default=None, help="timed steps per variant (default: 10 on CUDA, 2 on CPU)")
    p.add_argument("--out", type=Path, default=None,
                   help="default: results/training_bench.json on CUDA, results/training_bench.cpu.json on CPU")
    return p.parse_args(argv)


def lab_argv(lab: str, device: torch.device, seed: int) -> list[str]:
    size = GPU_SIZES[lab] if device.type == "cuda" else []
    return ["--device", device.type, "--json", "--seed", str(seed), *size]


def row(metric: str, value, unit: str, lab: str, target: str | None = None) -> dict:
    return {"metric": metric, "value": value, "unit": unit, "target": target, "lab": lab}


def mixed_precision(device, steps: int, seed: int) -> tuple[dict, list[dict]]:
    lab = "lab-03-mixed-precision"
    mp = load_lab(f"{lab}/{LABS[lab]}")
    ledger_steps = 2  # the lab's default: steps under the ledger, not timed
    args = mp.parse_args([*lab_argv(lab, device, seed), "--steps", str(steps + ledger_steps)])
    s = mp.summary(mp.run_recipes(args))
    rows = []
    for name in ("bf16", "fp16"):
        v = s["vs_fp32"][name]
        target = f">= {BF16_TARGET} (H100 class)" if name == "bf16" else None
        label = "bf16 autocast" if name == "bf16" else "fp16 autocast + GradScaler"
        rows.append(row(f"{label}: step speed against fp32", v["speedup_vs_fp32"], "x", lab, target))
        rows.append(row(f"{label}: activation bytes against fp32", v["activation_ratio"], "x", lab))
    detail = {name: {"step_time_s": r["step_time_s"], "activation_bytes": r["activation_bytes"],
                     "peak_bytes": r["peak_bytes"]["total"], "losses": r["losses"]} for name, r in s["recipes"].items()}
    return {"config": s["config"], "recipes": detail, "vs_fp32": s["vs_fp32"], "timing": s["timing"]}, rows


def checkpointing(device, steps: int, seed: int) -> tuple[dict, list[dict]]:
    lab = "lab-04-activation-checkpointing"
    ck = load_lab(f"{lab}/{LABS[lab]}")
    s = ck.summary(ck.run(ck.parse_args([*lab_argv(lab, device, seed), "--steps", str(steps)])))
    rows = []
    for name, r in s["results"].items():
        if name == "none":
            continue
        t = ck.GPU_TARGETS.get(name, {})
        red, over = t.get("min_activation_reduction"), t.get("max_time_overhead")
        rows.append(row(f"{name} checkpointing: activation peak reduction", r["activation_reduction"], "fraction", lab,
                        f">= {red:.2f}" if red is not None else None))
        rows.append(row(f"{name} checkpointing: step-time overhead", r["time_overhead"], "fraction", lab,
                        f"<= {over:.2f}" if over is not None else None))
    keep = ("activation_peak_bytes", "peak_bytes", "activation_reduction", "step_time_s", "time_overhead",
            "recompute_flops_of_forward", "grads_equal")
    detail = {name: {k: r[k] for k in keep} for name, r in s["results"].items()}
    return {"config": s["config"], "every": s["every"], "results": detail, "timing": s["timing"]}, rows


def activation_offload(device, steps: int, seed: int) -> tuple[dict, list[dict]]:
    lab = "lab-09-activation-offload"
    ao = load_lab(f"{lab}/{LABS[lab]}")
    args = ao.parse_args([*lab_argv(lab, device, seed), "--steps", str(steps)])
    s = ao.summary(ao.run(args), args)
    r = s["results"]
    both = r["checkpoint+streamed"]
    rows = [
        row("checkpoint + streamed offload against checkpoint alone: activation peak reduction",
            both["reduction_vs_baseline"], "fraction", lab, f">= {OFFLOAD_TARGET['min_reduction']:.2f}"),
        row("checkpoint + streamed offload against checkpoint alone: step-time overhead",
            both["overhead_vs_baseline"], "fraction", lab, f"<= {OFFLOAD_TARGET['max_overhead']:.2f}"),
        row("save_on_cpu step time against streamed offload", r["save_on_cpu"]["step_time_s"] / r["streamed"]["step_time_s"],
            "x", lab, "> 1"),
    ]
    keep = ("activation_peak_bytes", "host_peak_bytes", "step_time_s", "activation_reduction", "time_overhead",
            "baseline", "reduction_vs_baseline", "overhead_vs_baseline", "grads_equal")
    detail = {name: {k: m[k] for k in keep} for name, m in r.items()}
    return {"config": s["config"], "results": detail, "timing": s["timing"]}, rows


def main(argv=None) -> None:
    args = parse_args(argv)
    device = pick_device(args.device)
    steps = args.steps or (10 if device.type == "cuda" else 2)
    t0 = time.perf_counter()
    parts, rows = {}, []
    plan = [("lab-03-mixed-precision", mixed_precision), ("lab-04-activation-checkpointing", checkpointing),
            ("lab-09-activation-offload", activation_offload)]
    for lab, measure in progress(plan, total=len(plan), desc="labs", quiet=args.json):
        parts[lab], lab_rows = measure(device, steps, args.seed)
        rows += lab_rows
    result = {"bench": BENCH, "device": device.type, "steps": steps, "labs": parts,
              "source_hashes": {lab: provenance.source_hash(lab) for lab in LABS}, "summary_rows": rows,
              "note": None if device.type == "cuda" else "CPU run: times are CPU times; no GPU speed claim comes from it"}
    record = provenance.collect(None, device, time.perf_counter() - t0)
    out = args.out or ROOT / (RESULT_FILE if device.type == "cuda" else RESULT_FILE.replace(".json", ".cpu.json"))
    provenance.write_results(out, result, record)
    if args.json:
        emit_json({"provenance": record, **result})
        return
    print(f"training benchmark on {record['device_name']} -> {out}")
    for r in rows:
        value = f"{r['value']:.2f}x" if r["unit"] == "x" else f"{100 * r['value']:+.1f} %"
        print(f"  {r['metric']:<82} {value:>9}  target {r['target'] or '-'}")


if __name__ == "__main__":
    run_lab(main)
