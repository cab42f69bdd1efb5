"""Benchmarks run end to end (tiny, on CPU) and write results with provenance."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, assert_clean_usage_error, load_bench


def run_bench(*args: str, script: str = "offload_bench.py") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT,
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
    for name in ("none", "model", "sequential", "layerwise k=1", "accelerate", "diffusers"):
        assert modes[name]["max_abs_diff"] == 0.0 and modes[name]["step_time_vs_resident"] > 0, modes[name]
    assert modes["none"]["step_time_vs_resident"] == 1.0
    assert data["bandwidth"] is None  # no host-device link on a CPU-only machine
    row = data["sweep"][0]
    assert row["width"] == 32 and row["block_bytes"] == 16 * 32 * 32 * 4 + 19 * 32 * 4  # one block, fp32
    assert "copy_ms_per_block" not in row  # no link to measure, so no copy time and no crossover
    assert data["crossover"]["width"] is None and "no crossover" in data["crossover"]["note"]
    assert json.loads(proc.stdout)["modes"]


def test_offload_bench_bad_input():
    assert_clean_usage_error(run_bench("--depths", "1,x"), "--depths")
    assert_clean_usage_error(run_bench("--device", "cpu", "--depths", "6"), "below the 6 denoiser blocks")


@pytest.mark.parametrize(("fields", "fragment"), [({"sweep_widths": (200,)}, "--sweep-widths 200: the sweep gives it 3 heads"),
                                                  ({"width": 100, "heads": 3}, "--width 100 is not divisible")])
def test_offload_bench_refuses_sizes_lab08_cannot_build_before_it_runs(fields, fragment):
    """Sizes are checked against Lab 08's rules when the flags are read: a sweep width the sweep
    cannot split into heads no longer fails after the modes have run."""
    bench = load_bench("offload_bench")
    with pytest.raises(bench.UsageError, match=fragment):
        bench.Config(device="cpu", **fields)


def test_offload_bench_names_the_crossover_width():
    """The first width whose block copy (bytes over the pinned bandwidth) outlasts its compute; the
    block bytes are one block's own flat buffer, not the denoiser's other weights."""
    import torch

    offload_bench = load_bench("offload_bench")
    rows = [{"width": w, "compute_ms_per_block": c, "block_bytes": b}
            for w, c, b in [(512, 1.0, 8e6), (1024, 2.0, 34e6), (2048, 4.0, 134e6), (4096, 8.0, 537e6)]]
    found = offload_bench.find_crossover(rows, {"h2d_pinned_gbps": 25.0})  # copies 0.32, 1.36, 5.36, 21.5 ms
    assert [r["copy_bound"] for r in rows] == [False, False, True, True]
    assert found["width"] == 2048 and found["copy_ms_per_block"] > found["compute_ms_per_block"] == 4.0
    assert offload_bench.find_crossover(rows[:2], {"h2d_pinned_gbps": 25.0})["width"] is None
    config = offload_bench.lab_config(offload_bench.Config(), torch.device("cpu"), width=1024, heads=16,
                                      dtype="bfloat16")
    assert offload_bench.block_bytes(config) == 2 * (16 * 1024**2 + 19 * 1024)  # 33,593,344: just above 32 MiB


def test_training_bench_smoke_run_writes_each_labs_rows(tmp_path):
    """Labs 02, 03, 04 and 09 measured by their own code in one process; every target row present."""
    out = tmp_path / "training.json"
    proc = run_bench("--device", "cpu", "--out", str(out), "--steps", "1", script="training_bench.py")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["provenance"]["device_type"] == "cpu" and "no GPU speed claim" in data["note"]
    labs = ["lab-02-single-gpu-training", "lab-03-mixed-precision", "lab-04-activation-checkpointing",
            "lab-09-activation-offload"]
    assert sorted(data["source_hashes"]) == labs
    rows = {r["metric"]: r for r in data["summary_rows"]}
    assert {r["lab"] for r in rows.values()} == set(labs)
    assert rows["bf16 autocast: step speed against fp32"]["target"].startswith(">= 1.8")
    assert rows["full checkpointing: activation peak reduction"]["target"] == ">= 0.60"
    assert rows["save-matmuls checkpointing: step-time overhead"]["target"] == "<= 0.10"
    assert rows["checkpoint + streamed offload against checkpoint alone: activation peak reduction"]["target"] == ">= 0.50"
    for r in rows.values():
        assert isinstance(r["value"], float) and r["unit"] in ("x", "fraction"), r
    ck = data["labs"]["lab-04-activation-checkpointing"]["results"]
    assert all(r["grads_equal"] for r in ck.values())  # the ratios come from runs held to the plain gradients
    assert rows["full checkpointing: activation peak reduction"]["value"] == ck["full"]["activation_reduction"]
    assert "fp32" in data["labs"]["lab-03-mixed-precision"]["recipes"]
    # the step's third peak candidate: foreach holds 4 B x P of temporaries at once, fused none
    assert rows["foreach AdamW: optimizer-step temporaries over 4 B x P"]["value"] == 1.0
    assert rows["fused AdamW: optimizer-step temporaries over 4 B x P"]["value"] == 0.0
    assert rows["fused AdamW: optimizer-step peak against foreach"]["target"] == "< 1"
    assert rows["fused AdamW: optimizer-step peak against foreach"]["value"] < 1


def test_training_bench_bad_input():
    assert_clean_usage_error(run_bench("--steps", "0", script="training_bench.py"), "--steps")


@pytest.mark.parametrize("script", ["offload_bench.py", "cpu_adam_bench.py", "training_bench.py", "cpu_threads_bench.py",
                                    "lab_runs_bench.py"])
@pytest.mark.parametrize("target", ["/proc/x/out.json", "DIR", "/dev/null"])
def test_an_unusable_out_is_refused_before_the_benchmark_runs(script, target, tmp_path, monkeypatch, capsys):
    from labkit import cli

    spec = importlib.util.spec_from_file_location(f"bench_{script[:-3]}_out", ROOT / "bench" / script)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench.provenance, "collect", lambda *a, **k: pytest.fail("the benchmark ran"))
    with pytest.raises(SystemExit) as exc:
        cli.main(bench.Config, bench.run, None, ["--device", "cpu", "--out", str(tmp_path) if target == "DIR" else target],
                 prog=script)
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "--out" in err[0], err
    assert Path("/dev/null").is_char_device()


def test_trace_bench_times_each_case_in_a_fresh_process(tmp_path, monkeypatch):
    """The benchmark's mechanics on a small model: each case's trace seconds, process seconds and
    peak RSS, written with provenance and targets; the 8B, 70B and 405B (one rank of TP x PP x DP) cases are
    what it runs by default."""
    bench = load_bench("trace_bench")
    assert {c[0]["model"] for c in bench.CASES.values()} == {"llama-3-8b", "llama-3-70b", "llama-3.1-405b"}
    monkeypatch.setattr(bench, "CASES", {"small Llama": (dict(model="small-llama", seq=64), 15)})
    result = bench.run(bench.Config(out=tmp_path / "trace.json"))
    case = result["cases"]["small Llama"]
    assert 0 < case["trace_s"] < case["process_s"] and 50 < case["peak_rss_mib"] < 4096
    assert case["per_rank_peak_bytes"] > 0
    data = json.loads((tmp_path / "trace.json").read_text())
    assert data["provenance"]["lab"] is None and data["source_hashes"]
    assert [r["target"] for r in data["summary_rows"]] == ["<= 15", "<= 2048"]


def test_cpu_threads_bench_times_both_settings_and_stops_its_busy_processes(tmp_path):
    """Each round runs Lab 08's command line once per thread setting, in a fresh process, while the
    busy processes spin; the file holds every run, the worst medians and their ratio, and no busy
    process outlives the benchmark."""

    bench = load_bench("cpu_threads_bench")
    result = bench.run(bench.Config(rounds=2, busy=1, repeats=2, out=tmp_path / "threads.json"))
    assert set(result["runs"]) == {label for _, label in bench.SETTINGS.values()}
    assert all(len(r) == 2 for r in result["runs"].values())
    for runs in result["runs"].values():
        assert all(0 < r["step_ms_range"][0] <= r["step_ms"] <= r["step_ms_range"][1] for r in runs)
    data = json.loads((tmp_path / "threads.json").read_text())
    ratio, worst_default, worst_one = data["summary_rows"]
    assert worst_default["value"] == max(r["step_ms"] for r in result["runs"]["default threads (one per core)"])
    assert data["medians"]["one_thread"]["worst_ms"] == worst_one["value"]
    assert ratio["value"] == pytest.approx(worst_default["value"] / worst_one["value"])
    left = subprocess.run(["pgrep", "-f", "^" + sys.executable + " -c while True"], capture_output=True, text=True)
    assert left.stdout == ""


def test_lab_runs_bench_times_the_pages_command_idle_and_busy_and_stops_its_busy_processes(tmp_path):
    """A rehearsal over one lab: its page's run_cpu, verbatim, in a fresh shell with the cores free
    and with one busy process, each row held to its target (10 s free, 20 s busy), beside the
    floor every command pays (importing torch); no busy process outlives the benchmark."""
    bench = load_bench("lab_runs_bench")
    result = bench.run(bench.Config(labs=(5,), rounds=1, busy=1, out=tmp_path / "runs.json"))
    slug = "lab-05-memory-efficient-attention"
    assert result["commands"] == {"floor": bench.FLOOR, slug: bench.page_commands()[5]}
    assert "--device cpu" in result["commands"][slug] and set(result["runs"]) == {"idle", "busy"}
    data = json.loads((tmp_path / "runs.json").read_text())
    assert data["provenance"]["device_type"] == "cpu" and set(data["source_hashes"]) == {slug}
    rows = {r["metric"]: r for r in data["summary_rows"]}
    for setting, target in [("idle", "<= 10"), ("busy", "<= 20")]:
        run = data["runs"][setting][slug][0]
        row = rows[f"Lab 05 page command, {setting}"]
        assert row["value"] == run["wall_s"] > 0 and row["target"] == target and row["lab"] == slug
        assert 0 < run["cpu_s"] and f"CPU {run['cpu_s']:.1f} s" in row["note"] and "load" in row["note"]
        assert "target" not in rows[f"floor, {setting}: python -c 'import torch'"]
    left = subprocess.run(["pgrep", "-f", "^" + sys.executable + " -c while True"], capture_output=True, text=True)
    assert left.stdout == ""


def test_lab_runs_bench_runs_each_command_as_a_reader_would(tmp_path, monkeypatch):
    """No virtual environment and no thread variable reach the command, whatever this process has;
    a command that fails or overruns stops the benchmark with what went wrong."""
    bench = load_bench("lab_runs_bench")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("VIRTUAL_ENV", str(ROOT / ".venv"))
    assert bench.time_command('test -z "$OMP_NUM_THREADS$VIRTUAL_ENV" && test "$PWD" = "' + str(ROOT) + '"', 60)
    with pytest.raises(RuntimeError, match="exit 3: .*: oops"):
        bench.time_command("echo oops >&2; exit 3", 60)
    with pytest.raises(RuntimeError, match="over --timeout 1 s"):
        bench.time_command("sleep 5", 1)


@pytest.mark.parametrize("argv, fragment", [(["--labs", "5,99"], "--labs 99: no such lab page"),
                                            (["--device", "cuda"], "--device cuda")])
def test_lab_runs_bench_refuses_bad_input_in_one_line(argv, fragment):
    assert_clean_usage_error(run_bench(*argv, script="lab_runs_bench.py"), fragment)
