"""How fast Lab 16's allocator model replays a real-scale step: Llama-3-8B's training step traced by
Lab 13, then its events replayed through the model, with the native allocator and with expandable
segments.

    .venv/bin/python bench/allocator_bench.py                      # writes results/allocator_bench.json
    .venv/bin/python bench/allocator_bench.py --out /tmp/a.json    # anywhere else

The trace is made once (Lab 13's seconds are ``trace_bench.py``'s to measure); what is timed is the
replay alone, two steps on a warm cache as ``caching_allocator.simulate`` runs it, the median of
``--repeats`` runs. Target (issue 29): a Llama-3-8B step's events in 5 s or less.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from labkit import cli, files, labs, provenance
from labkit.config import LabConfig, option

ROOT = Path(__file__).resolve().parents[1]
BENCH = "allocator"
RESULT_FILE = "results/allocator_bench.json"
CPU_ONLY = True  # a replay is a CPU computation whatever it models
TARGET_S = 5.0
CASE = dict(model="llama-3-8b", seq=4096)  # Lab 13's default step: one GPU, mixed precision, AdamW


@dataclass
class Config(LabConfig):
    """Time the replay of a Llama-3-8B step through Lab 16's allocator model."""

    repeats: int = option(3, "replays of each setting (the median is reported)", min=1, max=20)
    out: Path | None = option(None, "where to write the results (default: results/allocator_bench.json)",
                               path="write")


def run(config: Config) -> dict:
    out = config.out or ROOT / RESULT_FILE
    files.check_writable(out, "--out")
    t0 = time.perf_counter()
    lab13, lab16 = labs.load(13), labs.load(16)
    replay, conf = labs.load(16, "replay"), labs.load(16, "alloc_conf")
    traced = lab13.trace(lab13.Config(levers="none", **CASE))
    ev = replay.events_of(traced.ledger)
    rows, cases = [], {}
    for setting in ("", "expandable_segments:True"):
        seconds, r = [], None
        for _ in range(config.repeats):
            t = time.perf_counter()
            r = lab16.simulate(ev, conf.parse(setting), capacity=None, workspaces=2, repeat=2)
            seconds.append(time.perf_counter() - t)
        name = setting or "default"
        cases[name] = {"seconds": sorted(seconds)[len(seconds) // 2], "runs": seconds, "events": len(ev.events),
                       "peak_reserved_bytes": r.peak_reserved, "peak_traced_bytes": r.peak_traced}
        rows.append({"metric": f"Llama-3-8B step replay, {name}", "value": cases[name]["seconds"], "unit": "s",
                     "target": f"<= {TARGET_S:g}", "lab": labs.slug(16),
                     "note": f"{len(ev.events):,} events, two steps; on {os.cpu_count()} cores"})
    result = {"bench": BENCH, "device": "cpu", "cores": os.cpu_count(), "case": CASE, "cases": cases,
              "summary_rows": rows, "source_hashes": {labs.slug(16): provenance.source_hash(16)},
              "note": "a replay runs on the CPU: these are this machine's seconds"}
    record = provenance.collect(None, cli.pick_device("cpu"), time.perf_counter() - t0)
    provenance.write_results(out, result, record)
    return {"provenance": record, "out": str(out), **result}


def report(result: dict) -> None:
    print(f"allocator benchmark on {result['provenance']['device_name']} ({result['cores']} cores) -> {result['out']}")
    for name, case in result["cases"].items():
        print(f"  {name:<28} {case['events']:>7,} events  replay {case['seconds']:5.2f} s  (target <= {TARGET_S:g} s)")


if __name__ == "__main__":
    cli.main(Config, run, report)
