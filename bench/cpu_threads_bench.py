"""Why two identical CPU runs of a lab can differ 300-fold: intra-op threads on cores that are busy.

    .venv/bin/python bench/cpu_threads_bench.py                     # writes results/cpu_threads_bench.json
    .venv/bin/python bench/cpu_threads_bench.py --rounds 3 --out /tmp/t.json

Lab 08's all-resident pipeline (``offload.py --mode none``) runs in a fresh process per round,
once with PyTorch's default intra-op threads (one per core, ``--threads 0``) and once with one
thread, while ``--busy`` other processes keep the cores busy (a test suite, a browser, a second
lab). Each run reports the median of its warm denoising steps and their range; the benchmark keeps
every run and reports the worst median of each setting. With more threads than free cores, an op's
threads wait at their barrier for a thread the scheduler has put aside, and a few-millisecond step
can take about a second. A CPU figure by nature; what it shows is why a CPU run of any lab uses one
thread (``labkit.cli.cpu_threads``, the rule every lab follows).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from labkit import cli, files, provenance
from labkit.busy import cores as busy_cores
from labkit.config import LabConfig, option

ROOT = Path(__file__).resolve().parents[1]
BENCH = "cpu threads"
RESULT_FILE = "results/cpu_threads_bench.json"
LAB = "lab-08-offload-memory-saving"
CPU_ONLY = True  # a property of CPU scheduling: no GPU run is pending for it
#: published key (what a page's placeholder names) -> (Lab 08's --threads, the label in tables)
SETTINGS = {"default_threads": (0, "default threads (one per core)"), "one_thread": (1, "one thread")}


@dataclass
class Config(LabConfig):
    """Time Lab 08's all-resident step on default threads and on one thread, with the cores kept busy."""

    rounds: int = option(5, "fresh runs of each setting, interleaved", min=1, max=50)
    busy: int | None = option(None, "processes that keep the cores busy meanwhile (default: one per core; 0: none)",
                              min=0, max=256)
    repeats: int = option(6, "Lab 08's timed pipeline runs per run (the first warms up)", min=2, max=100)
    out: Path | None = option(None, "where to write the results (default: results/cpu_threads_bench.json)",
                              path="write")


def one_run(threads: int, repeats: int) -> dict:
    """Lab 08's command line in a fresh interpreter: the all-resident mode's median step and range."""
    command = [sys.executable, str(ROOT / "code" / LAB / "offload.py"), "--device", "cpu", "--mode", "none",
               "--threads", str(threads), "--repeats", str(repeats), "--json"]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"Lab 08 failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else '?'}")
    mode = json.loads(proc.stdout)["modes"][0]
    return {"step_ms": mode["step_ms"], "step_ms_range": mode["step_ms_range"]}


def run(config: Config) -> dict:
    out = config.out or ROOT / RESULT_FILE
    files.check_writable(out, "--out")
    busy = os.cpu_count() if config.busy is None else config.busy
    t0 = time.perf_counter()
    with busy_cores(busy):
        runs = {label: [] for _, label in SETTINGS.values()}
        for _ in cli.progress(range(config.rounds), total=config.rounds, desc="rounds"):
            for threads, label in SETTINGS.values():
                runs[label].append(one_run(threads, config.repeats))
    worst = {name: max(r["step_ms"] for r in rs) for name, rs in runs.items()}
    best = {name: min(r["step_ms"] for r in rs) for name, rs in runs.items()}
    default, one = (label for _, label in SETTINGS.values())
    note = f"{config.rounds} runs each, {busy} busy process(es) on {os.cpu_count()} cores"
    rows = [{"metric": "worst median step, default threads over one thread", "value": worst[default] / worst[one],
             "unit": "x", "lab": LAB, "note": note},
            *({"metric": f"worst median step, {name}", "value": worst[name], "unit": "ms", "lab": LAB,
               "note": f"best median {best[name]:.1f} ms; {note}"} for name in runs)]
    medians = {key: {"best_ms": best[label], "worst_ms": worst[label], "runs": len(runs[label])}
               for key, (_, label) in SETTINGS.items()}
    result = {"bench": BENCH, "device": "cpu", "cores": os.cpu_count(), "busy": busy, "runs": runs, "medians": medians,
              "summary_rows": rows, "source_hashes": {LAB: provenance.source_hash(8)},
              "note": "CPU scheduling: the same command, only the intra-op thread count differs"}
    record = provenance.collect(None, cli.pick_device("cpu"), time.perf_counter() - t0)
    provenance.write_results(out, result, record)
    return {"provenance": record, "out": str(out), **result}


def report(result: dict) -> None:
    print(f"CPU threads on {result['provenance']['device_name']} ({result['cores']} cores, {result['busy']} busy "
          f"process(es)) -> {result['out']}")
    for name, rs in result["runs"].items():
        print(f"  {name:<32} median step per run, ms: " + ", ".join(f"{r['step_ms']:.1f}" for r in rs))


if __name__ == "__main__":
    cli.main(Config, run, report)
