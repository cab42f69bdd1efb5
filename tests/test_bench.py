"""Benchmarks run end to end (tiny, on CPU) and write results with provenance."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT, assert_clean_usage_error


def run_bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "offload_bench.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_offload_bench_smoke_run_writes_results(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_bench("--device", "cpu", "--out", str(out), "--repeats", "1", "--depths", "1",
                     "--sweep-widths", "32", "--denoiser-layers", "3", "--latent-tokens", "16", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["provenance"]["device_type"] == "cpu" and data["provenance"]["source_hash"]
    assert "no GPU speed or bandwidth claim" in data["note"]
    modes = {m["mode"]: m for m in data["modes"]}
    assert {"none", "model", "sequential", "layerwise k=1", "accelerate", "diffusers"} <= set(modes)
    for name in ("none", "model", "sequential", "layerwise k=1"):
        assert modes[name]["max_abs_diff"] == 0.0 and modes[name]["step_time_vs_resident"] > 0
    assert modes["none"]["step_time_vs_resident"] == 1.0
    assert data["bandwidth"] is None  # no host-device link on a CPU-only machine
    assert data["crossover"][0]["width"] == 32
    assert json.loads(proc.stdout)["modes"]


def test_offload_bench_bad_input():
    assert_clean_usage_error(run_bench("--depths", "1,x"), "comma-separated")
