"""How fast a real-scale trace is: Lab 13's fake-tensor step at Llama-3-8B and Llama-3-70B sizes.

    .venv/bin/python bench/trace_bench.py                      # writes results/trace_bench.json
    .venv/bin/python bench/trace_bench.py --out /tmp/t.json    # anywhere else

A trace is a CPU computation (no tensor holds data; every op computes shapes), so its speed is a
property of the machine that runs it, measured here and reported as such. Each case runs in a fresh
Python process, as a reader's ``fit.py`` command would: the seconds of the trace itself (model built
on the meta device, fake storages, one steady-state step under the ledger), the wall time of the
whole process (imports included) and its peak resident memory (``ru_maxrss`` of the child).
Targets (issues 13 and 28): Llama-3-8B at 4k tokens in 15 s or less, Llama-3-70B at 8 ranks in 45 s or
less, one rank of Llama-3.1-405B under TP 8 x PP 16 x DP 8 (1F1B's first stage, 16 micro-batches in
flight) in 60 s or less, each within 2 GiB of RAM, on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from labkit import cli, files, labs, provenance
from labkit.config import LabConfig, option

ROOT = Path(__file__).resolve().parents[1]
BENCH = "trace"
RESULT_FILE = "results/trace_bench.json"
CPU_ONLY = True  # what it measures is a CPU computation: no GPU run is pending for it
RSS_TARGET_MIB = 2048

#: name -> (Lab 13's Config fields, the seconds target)
CASES = {
    "Llama-3-8B train step, 4k tokens, mixed, AdamW": (dict(model="llama-3-8b", seq=4096), 15),
    "Llama-3-70B train step, 4k tokens, ZeRO-3 over 8 ranks": (dict(model="llama-3-70b", seq=4096, dp=8, zero_stage=3), 45),
    "Llama-3.1-405B, one rank of TP 8 (SP) x PP 16 x DP 8 (ZeRO-3), 4k tokens": (
        dict(model="llama-3.1-405b", seq=4096, tp=8, sp=True, pp=16, accumulation=16, dp=8, zero_stage=3), 60),
}

CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
from labkit import cli, labs
cli.cpu_threads()  # the thread rule fit.py's command line follows
fit = labs.load(13)
config = fit.Config(levers="none", **json.loads(sys.argv[1]))
traced = fit.trace(config)
print(json.dumps({"trace_s": traced.seconds, "peak_bytes": traced.per_rank_peak_bytes,
                  "process_s": time.perf_counter() - t0,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


@dataclass
class Config(LabConfig):
    """Time Lab 13's real-scale traces, each in a fresh process: seconds and peak RAM."""

    repeats: int = option(1, "runs of each case (the median is reported)", min=1, max=20)
    out: Path | None = option(None, "where to write the results (default: results/trace_bench.json)", path="write")


def measure(fields: dict) -> dict:
    """One case in a fresh interpreter: its timings and its peak RSS (the kernel's ru_maxrss, read
    by the child itself at the end)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(fields)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"the trace of {fields} failed: {err.strip().splitlines()[-1] if err.strip() else '?'}")
    data = json.loads(out.strip().splitlines()[-1])
    data["wall_s"] = wall
    return data


def _median(values: list[float]) -> float:
    s = sorted(values)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def run(config: Config) -> dict:
    out = config.out or ROOT / RESULT_FILE
    files.check_writable(out, "--out")
    t0 = time.perf_counter()
    cases, rows = {}, []
    for name, (fields, target_s) in cli.progress(CASES.items(), total=len(CASES), desc="traces"):
        runs = [measure(fields) for _ in range(config.repeats)]
        case = {"config": fields, "runs": runs,
                "trace_s": _median([r["trace_s"] for r in runs]),
                "process_s": _median([r["process_s"] for r in runs]),
                "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
                "per_rank_peak_bytes": runs[0]["peak_bytes"]}
        cases[name] = case
        rows += [{"metric": f"{name}: trace seconds", "value": case["trace_s"], "unit": "s",
                  "target": f"<= {target_s}", "lab": labs.slug(13),
                  "note": f"on {os.cpu_count()} cores; {case['process_s']:.1f} s with imports"},
                 {"metric": f"{name}: peak RSS", "value": case["peak_rss_mib"], "unit": "MiB",
                  "target": f"<= {RSS_TARGET_MIB}", "lab": labs.slug(13), "note": "the whole process"}]
    device = cli.pick_device("cpu")
    result = {"bench": BENCH, "device": "cpu", "cores": os.cpu_count(), "cases": cases, "summary_rows": rows,
              "source_hashes": {labs.slug(13): provenance.source_hash(13)},
              "note": "a trace runs on the CPU whatever it traces: these are this machine's seconds"}
    record = provenance.collect(None, device, time.perf_counter() - t0)
    provenance.write_results(out, result, record)
    return {"provenance": record, "out": str(out), **result}


def report(result: dict) -> None:
    print(f"trace benchmark on {result['provenance']['device_name']} ({result['cores']} cores) -> {result['out']}")
    for name, case in result["cases"].items():
        print(f"  {name:<58} trace {case['trace_s']:6.1f} s  process {case['process_s']:6.1f} s  "
              f"peak RSS {case['peak_rss_mib']:7.0f} MiB")


if __name__ == "__main__":
    cli.main(Config, run, report)
