"""Lab 13's trace against the allocator: the same training step traced on fake tensors and run for real.

    .venv/bin/python bench/fit_gpu_bench.py --device cuda   # writes results/fit_gpu_bench.json
    .venv/bin/python bench/fit_gpu_bench.py --device cpu    # a rehearsal: results/fit_gpu_bench.cpu.json

Issue 13, clause 6, and issue 32, item 2. On a GPU: Llama-3.2-1B and Llama-3.2-3B, pure bf16, AdamW as
CUDA runs it (foreach), checkpointing none and full, batch 1 at 4,096 tokens (the largest of them, 3B
without checkpointing, is traced at about 40 GiB: it fits an 80 GB card); and two of Lab 15's
questions, as Lab 15 asks them (``finetune_scale.ANSWERS``): Llama-3-8B under QLoRA at 2,048 tokens
(traced at about 20 GiB) and under LoRA in bf16 at 4,096 tokens (about 44 GiB). Each step is traced (``fit.trace``,
CPU dispatch, rounded to 512-byte blocks), then run on real CUDA tensors by the same code
(``fit.measure_on_gpu``): the allocator's peak is reset just before the step and read after it.
Reported: the trace, the real step's ledger, ``torch.cuda.max_memory_allocated`` less what the
allocator held before the step that no tensor of the step owns (cuBLAS workspaces), and
``memory_stats()["requested_bytes.all.peak"]`` (the bytes asked for, before rounding). Target: the
trace within 3 % of the allocator. Beside it, the step's reserved peak as Lab 16's model of the caching
allocator simulates the trace (two steps replayed, cuBLAS's workspaces first) and
``torch.cuda.max_memory_reserved`` over the real step (target: within 2 %). The real step runs once,
after the model and its optimizer state were made, and the allocator's peak is reset just before it;
the simulation starts from the step's first event: what the two count differently is for the GPU run
to show, and the report prints both, never one fitted to the other.

On a CPU the same plumbing runs on ``small-llama`` (real CPU tensors, exact bytes): it proves the
script runs, not what a GPU holds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from labkit import cli, files, labs, provenance
from labkit.config import LabConfig, option
from labkit.table import format_bytes

ROOT = Path(__file__).resolve().parents[1]
BENCH = "fit_gpu"
RESULT_FILE = "results/fit_gpu_bench.json"  # the GPU run; a CPU run writes results/fit_gpu_bench.cpu.json
TARGET = 0.03  # issue 13: the trace within 3 % of max_memory_allocated
RESERVED_TARGET = 0.02  # issue 32: the simulated reserved peak within 2 % of max_memory_reserved

#: the GPU cases: model x checkpointing, each pure bf16 with CUDA's default AdamW, batch 1
MODELS, CHECKPOINTING, SEQ = ("llama-3.2-1b", "llama-3.2-3b"), ("none", "full"), 4096
FINE_TUNING = ("qlora_8b_2k", "lora_8b_h100")  # Lab 15's questions that fit a GPU alone
REHEARSAL = (("small-llama",), CHECKPOINTING, 64)  # on a CPU; and one QLoRA step of the toy


@dataclass
class Config(LabConfig):
    """Trace Lab 13's step, run it for real on the same device, and compare the peaks."""

    out: Path | None = option(None, "where to write the results (default: results/fit_gpu_bench.json, or "
                                    "results/fit_gpu_bench.cpu.json on CPU)", path="write")


def cases(device_type: str) -> list[dict]:
    models, strategies, seq = (MODELS, CHECKPOINTING, SEQ) if device_type == "cuda" else REHEARSAL
    out = [dict(model=m, seq=seq, precision="bf16", optimizer="adamw", checkpointing=c, levers="none")
           for m in models for c in strategies]
    if device_type != "cuda":
        return out + [dict(model="small-llama", seq=seq, precision="bf16", method="qlora", levers="none")]
    answers = labs.load(15, "finetune_scale").ANSWERS
    return out + [{k: v for k, v in answers[name][1].items() if k != "gpu"} | {"levers": "none"} for name in FINE_TUNING]


def run(config: Config) -> dict:
    fit = labs.load(13)
    device = cli.pick_device(config.device)
    out = config.out or ROOT / (RESULT_FILE if device.type == "cuda" else RESULT_FILE.replace(".json", ".cpu.json"))
    files.check_writable(out, "--out")
    t0, results, rows = time.perf_counter(), {}, []
    for fields in cli.progress(cases(device.type), desc="steps"):
        step = fit.Config(**fields)
        traced = fit.trace(step)
        measured = fit.measure_on_gpu(step, traced, device=device.type)
        name = f"{step.model}, " + (f"{step.method}" if step.method != "full" else f"checkpointing {step.checkpointing}") \
            + f", {step.seq} tokens"
        if measured.get("max_memory_reserved"):  # Lab 16's simulation of the trace beside the real segments
            simulated = traced.reserved["reserved_bytes"]
            measured |= {"simulated_reserved_bytes": simulated,
                         "simulated_over_reserved": simulated / measured["max_memory_reserved"]}
        results[name] = {"config": fields, **measured}
        ratio = measured.get("traced_over_allocated")
        rows.append({"metric": f"{name}: traced / max_memory_allocated", "value": ratio, "unit": "x",
                     "target": f"within {TARGET:.0%} of 1", "lab": labs.slug(13),
                     "note": "not measured: " + measured.get("why", "") if not measured["measured"] else
                     "the allocator's peak less what it held before the step (cuBLAS workspaces)"})
        if "simulated_over_reserved" in measured:
            rows.append({"metric": f"{name}: simulated / max_memory_reserved", "value": measured["simulated_over_reserved"],
                         "unit": "x", "target": f"within {RESERVED_TARGET:.0%} of 1", "lab": labs.slug(16),
                         "note": "Lab 16's allocator model on the trace, against the real step's reserved peak"})
    result = {"bench": BENCH, "device": device.type, "cases": results, "summary_rows": rows,
              "source_hashes": {labs.slug(n): provenance.source_hash(n) for n in (13, 15, 16)},
              "note": "traced: fake tensors, CPU dispatch, 512-byte blocks; measured: the same step on this device"
                      + ("" if device.type == "cuda" else "; a CPU rehearsal of the plumbing, no GPU figure")}
    record = provenance.collect(None, device, time.perf_counter() - t0)
    provenance.write_results(out, result, record)
    return {"provenance": record, "out": str(out), **result}


def report(result: dict) -> None:
    print(f"Lab 13's trace against the allocator on {result['provenance']['device_name']} -> {result['out']}")
    for name, case in result["cases"].items():
        if not case["measured"]:
            print(f"  {name:<48} not measured: {case['why']}")
            continue
        ratio, sim = case["traced_over_allocated"], case.get("simulated_over_reserved")
        print(f"  {name:<48} traced {format_bytes(case['traced_peak_bytes'])}  ledger "
              f"{format_bytes(case['ledger_peak_bytes'])}  allocated "
              + ("-" if case["max_memory_allocated"] is None else format_bytes(case["max_memory_allocated"]))
              + ("" if ratio is None else f"  traced/allocated {ratio:.4f}")
              + ("" if sim is None else f"  simulated/reserved {sim:.4f}"))


if __name__ == "__main__":
    cli.main(Config, run, report)
