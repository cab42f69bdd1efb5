"""Training levers on one GPU: the speedups and overheads Labs 02, 03, 04 and 09 are held to, in one run.

    .venv/bin/python bench/training_bench.py --device cuda                    # writes results/training_bench.json
    .venv/bin/python bench/training_bench.py --device cpu --out /tmp/t.json   # a smoke run; CPU times only

One process runs each lab's own measurement (``run(Config(...)).summary()``, unchanged) at GPU size:
1. Lab 03: fp32, fp16 + GradScaler and bf16 autocast training steps; step speed and activation bytes
   as ratios against fp32 (target: bf16 at least 1.8x faster on an H100-class GPU);
2. Lab 04: no checkpointing, full, every-k and save-matmuls; activation peak reduction and step-time
   overhead against no checkpointing (targets: ``GPU_TARGETS`` in the lab);
3. Lab 09: checkpointing alone against checkpointing with streamed activation offload; activation
   peak reduction and step-time overhead (target: at least 50 % lower at no more than 10 % more
   time), and the synchronous ``save_on_cpu`` against the streamed hooks;
4. Lab 02: AdamW foreach (PyTorch's CUDA default) against fused, the third candidate for a step's
   peak: the optimizer step's temporaries over 4 B x P (foreach holds one fp32 copy of every weight
   at once, fused none), the step's and the whole peak with fused against foreach (the whole peak
   moves only where the step sets it), and on a GPU the ledger's peak against
   ``max_memory_allocated`` for each.

Each lab interleaves its variants step by step, so that drift on the machine hits all of them alike.
The rows go to the performance page with the source hash of the lab that produced them, so a row
measured on older lab code says so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from labkit import cli, files, labs, provenance
from labkit.config import MAX_STEPS, LabConfig, option

lab02, lab03, lab04, lab09 = labs.load(2), labs.load(3), labs.load(4), labs.load(9)

ROOT = Path(__file__).resolve().parents[1]
BENCH = "training"
RESULT_FILE = "results/training_bench.json"  # the GPU run; a CPU run writes results/training_bench.cpu.json
BF16_TARGET = 1.8  # Lab 03's issue: a bf16 step at least 1.8x faster than fp32 on an H100-class GPU
OFFLOAD_TARGET = {"min_reduction": 0.50, "max_overhead": 0.10}  # Lab 09's issue, against checkpointing alone

# The model sizes of the labs' own cuda tests; a CPU smoke run uses each lab's small defaults.
GPU_SIZES = {
    2: dict(width=1024, layers=8, heads=16, seq_len=512, batch_size=8),  # Lab 02's run_gpu
    3: dict(width=1024, layers=8, heads=16, seq_len=512, batch_size=16),
    4: dict(width=1024, layers=16, heads=16, seq_len=1024, batch_size=8),
    9: dict(width=1024, layers=32, heads=16, seq_len=1024, batch_size=8),
}


@dataclass
class Config(LabConfig):
    """Benchmark the training levers of Labs 02, 03, 04 and 09 side by side, as ratios."""

    steps: int | None = option(None, "timed steps per variant (default: 10 on CUDA, 2 on CPU)", min=1, max=MAX_STEPS)
    out: Path | None = option(None, "where to write the results (default: results/training_bench.json on CUDA, "
                                    "results/training_bench.cpu.json on CPU)", path="write")


def sized(n: int, device, seed: int, **fields) -> dict:
    """A lab's Config fields for this device: GPU-sized on CUDA, the lab's small defaults on CPU."""
    return dict(device=device.type, seed=seed, **(GPU_SIZES[n] if device.type == "cuda" else {}), **fields)


def row(metric: str, value, unit: str, lab: str, target: str | None = None) -> dict:
    return {"metric": metric, "value": value, "unit": unit, "target": target, "lab": lab}


def mixed_precision(device, steps: int, seed: int) -> tuple[dict, list[dict]]:
    lab = labs.slug(3)
    ledger_steps = 2  # the lab's default: steps under the ledger, not timed
    s = lab03.run(lab03.Config(**sized(3, device, seed, steps=steps + ledger_steps))).summary()
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
    lab = labs.slug(4)
    s = lab04.run(lab04.Config(**sized(4, device, seed, steps=steps))).summary()
    rows = []
    for name, r in s["results"].items():
        if name == "none":
            continue
        t = lab04.GPU_TARGETS.get(name, {})
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
    lab = labs.slug(9)
    s = lab09.run(lab09.Config(**sized(9, device, seed, steps=steps))).summary()
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


def adamw_step(device, steps: int, seed: int) -> tuple[dict, list[dict]]:
    lab = labs.slug(2)
    s = {impl: lab02.run(lab02.Config(**sized(2, device, seed, steps=max(steps, 2), adamw=impl))).summary()
         for impl in ("foreach", "fused")}
    four_p = 4 * s["fused"]["params"]
    temporaries = {impl: r["peak_bytes_by_phase"]["optimizer"]["temporaries"] for impl, r in s.items()}
    rows = [row(f"{impl} AdamW: optimizer-step temporaries over 4 B x P", temporaries[impl] / four_p, "x", lab)
            for impl in ("foreach", "fused")]
    step_peak = {impl: sum(r["peak_bytes_by_phase"]["optimizer"].values()) for impl, r in s.items()}
    rows.append(row("fused AdamW: optimizer-step peak against foreach", step_peak["fused"] / step_peak["foreach"],
                    "x", lab, "< 1"))
    rows.append(row("fused AdamW: whole-step peak against foreach", s["fused"]["peak_bytes"]["total"]
                    / s["foreach"]["peak_bytes"]["total"], "x", lab))  # 1 where activations set the peak
    for impl, r in s.items():
        if r["cuda"]:
            rows.append(row(f"{impl} AdamW: ledger peak over max_memory_allocated", r["cuda"]["ledger_over_allocator"],
                            "x", lab))
    detail = {impl: {"peak_bytes": r["peak_bytes"]["total"], "optimizer_step_peak_bytes": step_peak[impl],
                     "optimizer_temporaries": temporaries[impl],
                     "losses": r["losses"], "cuda": r["cuda"]} for impl, r in s.items()}
    return {"config": s["fused"]["config"], "params": s["fused"]["params"], "adamw": detail}, rows


def run(config: Config) -> dict:
    device = cli.pick_device(config.device)
    steps = config.steps or (10 if device.type == "cuda" else 2)
    out = config.out or ROOT / (RESULT_FILE if device.type == "cuda" else RESULT_FILE.replace(".json", ".cpu.json"))
    files.check_writable(out, "--out")
    t0 = time.perf_counter()
    parts, rows = {}, []
    plan = [(2, adamw_step), (3, mixed_precision), (4, checkpointing), (9, activation_offload)]
    for n, measure in cli.progress(plan, total=len(plan), desc="labs"):
        parts[labs.slug(n)], lab_rows = measure(device, steps, config.seed)
        rows += lab_rows
    result = {"bench": BENCH, "device": device.type, "steps": steps, "labs": parts,
              "source_hashes": {labs.slug(n): provenance.source_hash(n) for n, _ in plan}, "summary_rows": rows,
              "note": None if device.type == "cuda" else "CPU run: times are CPU times; no GPU speed claim comes from it"}
    record = provenance.collect(None, device, time.perf_counter() - t0)
    provenance.write_results(out, result, record)
    return {"provenance": record, "out": str(out), **result}


def report(result: dict) -> None:
    print(f"training benchmark on {result['provenance']['device_name']} -> {result['out']}")
    for r in result["summary_rows"]:
        value = f"{r['value']:.2f}x" if r["unit"] == "x" else f"{100 * r['value']:+.1f} %"
        print(f"  {r['metric']:<82} {value:>9}  target {r['target'] or '-'}")


if __name__ == "__main__":
    cli.main(Config, run, report)
