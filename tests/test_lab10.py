"""Lab 10: DDP under torchrun with 2 CPU processes (gloo): buckets, identical replicas, the match
with one process on the concatenated batch, memory per rank; bad input; broken promises.

Three torchrun launches (buckets copied, gradients as bucket views, an unwritable --ledger-dir) run
at the same time in one module fixture: each is mostly process start-up, so together they take the
time of about one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import CODE, ROOT, assert_clean_usage_error, assert_usage_error_in_process, load_lab, run_cli

from labkit import run_lab

SCRIPT = "lab-10-ddp/train_ddp.py"
TINY = ["--device", "cpu", "--steps", "3", "--width", "32", "--layers", "2", "--heads", "2", "--seq-len", "16",
        "--vocab", "64", "--batch-size", "2", "--bucket-cap-mb", "0.02"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone"]


@pytest.fixture(scope="module")
def lab10():
    return load_lab(SCRIPT)


def launch(*args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen([*TORCHRUN, str(CODE / SCRIPT), *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    base = tmp_path_factory.mktemp("lab10")
    procs = {mode: launch(*TINY, "--json", "--ledger-dir", str(base / mode), *extra)
             for mode, extra in (("copy", []), ("view", ["--grad-as-bucket-view"]))}
    procs["bad path"] = launch(*TINY, "--ledger-dir", "/proc/lab10/x")
    out = {}
    for mode, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        out[mode] = {"proc": proc, "stdout": stdout, "stderr": stderr, "dir": base / mode}
    return out


@pytest.fixture(scope="module")
def runs(launched):
    out = {}
    for mode in ("copy", "view"):
        run = launched[mode]
        assert run["proc"].returncode == 0, run["stderr"][-3000:]
        lines = [line for line in run["stdout"].splitlines() if line.strip()]
        assert len(lines) == 1, run["stdout"]  # rank 0 prints one JSON object, rank 1 nothing
        out[mode] = {"summary": json.loads(lines[0]), "dir": run["dir"], "stderr": run["stderr"]}
    return out


def model_state(summary) -> tuple[int, int]:
    return summary["params"], summary["param_tensors"]


def test_one_json_object_and_one_ledger_file_per_rank(runs):
    s = runs["copy"]["summary"]
    assert s["world_size"] == 2 and s["backend"] == "gloo" and s["device"] == "cpu"
    assert len(s["losses"]) == 3 and all(isinstance(v, float) for v in s["losses"])
    assert s["provenance"]["lab"] == "lab-10-ddp" and s["provenance"]["source_hash"]
    assert [m["rank"] for m in s["memory"]] == [0, 1]
    for rank in (0, 1):
        data = json.loads((runs["copy"]["dir"] / f"rank{rank}.json").read_text())
        assert data["rank"] == rank and len(data["timeline"]["index"]) == data["events"] > 0
    assert "Traceback" not in runs["copy"]["stderr"]


def test_replicas_differ_before_ddp_and_are_identical_after_every_step(runs):
    same = runs["copy"]["summary"]["replicas_identical"]
    assert same["before DDP"] is False  # seeded with seed + rank on purpose
    assert same["after DDP()"] is True  # DDP broadcast rank 0's weights
    assert [same[f"step {i}"] for i in range(3)] == [True, True, True]


def test_matches_one_process_on_the_concatenated_batch_within_tolerance(runs):
    ref = runs["copy"]["summary"]["reference"]
    for key in ("loss", "grads", "params"):
        assert ref[key]["within"] and ref[key]["ratio"] <= ref["tolerance"][key], (key, ref[key])
    assert ref["tolerance"] == {"loss": 1e-5, "grads": 1e-4, "params": 1e-2}
    assert ref["bit_exact"] is False  # other summation orders: equal up to rounding, not bit for bit
    assert 0 < ref["grads"]["ratio"] < 1e-5  # a few fp32 roundings, far below the tolerance
    assert ref["largest_element_diff"]["param"].endswith("attn.qkv.bias")  # AdamW on a zero gradient


def test_buckets_follow_the_derivation_and_what_ddp_reports(runs):
    s = runs["copy"]["summary"]
    b, (P, _) = s["buckets"], model_state(s)
    cap = int(0.02 * 2**20)
    assert b["cap_bytes"] == cap
    assert len(b["first_backward"]) == 1 and len(b["first_backward"][0]["params"]) == s["param_tensors"]
    sizes = [x["bytes"] for x in b["buckets"]]
    assert len(sizes) >= 3 and sum(sizes) == 4 * P  # every fp32 gradient in exactly one bucket
    assert all(n >= cap for n in sizes[:-1])  # a bucket closes once it reaches the cap
    assert b["bytes_match_reverse_order"] and b["params_match_ready_order"]
    assert b["ddp_reported_matches"] is True  # the third step's forward logged the rebuilt buckets
    assert b["ready_order"][0] == "head.weight" and b["ready_order"][-1] == "tok.weight"
    assert s["buckets_equal_on_all_ranks"]


def test_memory_per_rank_counts_the_buckets_as_communication(runs):
    s = runs["copy"]["summary"]
    P, T = model_state(s)
    for m in s["memory"]:
        opt = m["peaks_by_phase"]["optimizer"]
        assert opt["parameters"] == 4 * P and opt["gradients"] == 4 * P
        assert opt["optimizer_state"] == 8 * P + 4 * T
        assert opt["communication"] == 4 * P == m["at_end"]["communication"]
    assert s["memory"][0]["peak"] == s["memory"][1]["peak"]  # same shapes, same bytes on every rank


def test_gradient_as_bucket_view_drops_the_separate_gradients(runs):
    copy, view = runs["copy"]["summary"], runs["view"]["summary"]
    P, _ = model_state(copy)
    assert view["losses"] == copy["losses"]  # the same arithmetic, only where gradients live
    a, b = copy["memory"][0]["peaks_by_phase"]["optimizer"], view["memory"][0]["peaks_by_phase"]["optimizer"]
    assert b["gradients"] == 0 and b["communication"] == 4 * P
    assert sum(a.values()) - sum(b.values()) == 4 * P


def test_the_timeline_shows_one_bucket_then_the_rebuilt_ones(runs):
    s = runs["copy"]["summary"]
    P, _ = model_state(s)
    tl = json.loads((runs["copy"]["dir"] / "rank0.json").read_text())["timeline"]
    comm, steps, phases = tl["device"]["communication"], tl["step"], tl["phase"]
    step0 = [c for c, st, ph in zip(comm, steps, phases) if st == 0 and ph != "wrap"]
    assert set(step0) == {4 * P}  # the one big bucket made by DDP() lives through step 0
    rebuild = [c for c, st, ph in zip(comm, steps, phases) if st == 1 and ph == "forward"]
    assert min(rebuild) < 4 * P and rebuild[-1] == 4 * P  # old bucket freed, new ones allocated
    assert comm[-1] == 4 * P


def test_human_report(lab10, runs, capsys):
    import ddp_report  # on sys.path once the starter is loaded

    ddp_report.report(runs["copy"]["summary"])
    out = capsys.readouterr().out
    assert "replicas identical: True" in out and "bucket 0:" in out and "| rank 0 optimizer |" in out
    assert "Not seen: gloo's own buffers" in out


def test_derive_buckets_closes_a_bucket_at_the_cap(lab10):
    sizes = [("a", 10), ("b", 10), ("c", 10), ("d", 30), ("e", 5)]
    assert lab10.derive_buckets(sizes, 20) == [["a", "b"], ["c", "d"], ["e"]]
    assert lab10.derive_buckets(sizes, 100) == [["a", "b", "c", "d", "e"]]
    assert lab10.derive_buckets(sizes, 20, first_cap_bytes=5) == [["a"], ["b", "c"], ["d"], ["e"]]


def test_without_torchrun_is_one_line_and_exit_2(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert_clean_usage_error(run_cli(SCRIPT, "--device", "cpu"), "launch with torchrun")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--steps", "1"], "at least 2"),
        (["--steps", "0"], "--steps"),
        (["--bucket-cap-mb", "-1"], "--bucket-cap-mb"),
        (["--bucket-cap-mb", "lots"], "--bucket-cap-mb"),
        (["--width", "30", "--heads", "4"], "not divisible"),
        (["--backend", "mpi"], "--backend"),
        (["--device", "tpu"], "--device"),
        (["--ledger-dir", "/proc/lab10/x"], "--ledger-dir /proc/lab10/x: cannot write there"),
        (["--ledger-dir", "/dev/null"], "--ledger-dir /dev/null: cannot write there"),
        ([], "launch with torchrun"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(lab10, capsys, monkeypatch, args, fragment):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert_usage_error_in_process(lab10.main, [*TINY, *args], capsys, fragment)


@pytest.mark.parametrize(("args", "fragment"), [(["--backend", "nccl"], "needs --device cuda"),
                                                (["--snapshot", "s.pickle"], "needs a CUDA device")])
def test_cpu_only_refusals_come_before_the_process_group(lab10, capsys, monkeypatch, args, fragment):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")  # as under torchrun, but refused before init_process_group
    assert_usage_error_in_process(lab10.main, [*TINY, *args], capsys, fragment)
    assert not torch.distributed.is_initialized()


def test_under_torchrun_bad_input_is_reported_by_rank_0_alone(launched):
    """Both ranks refuse the path before training; only rank 0 says so. Its exit code 2 becomes
    torchrun's own failure report and exit code 1."""
    run = launched["bad path"]
    assert run["proc"].returncode == 1 and run["stdout"] == ""
    ours = [line for line in run["stderr"].splitlines() if line.startswith("train_ddp.py:")]
    assert ours == ["train_ddp.py: error: --ledger-dir /proc/lab10/x: cannot write there (No such file or directory)"]
    assert "exitcode  : 2" in run["stderr"]  # torchrun names the rank that failed and its code


def test_the_other_ranks_refuse_bad_input_in_silence(lab10, capsys, monkeypatch):
    from labkit import dist as labdist

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(labdist, "QUIET_EXIT_DELAY_S", 0)
    with pytest.raises(SystemExit) as exc:
        run_lab(labdist.ranked(lab10.main), ["--device", "cpu", "--steps", "1"])
    assert exc.value.code == 2 and capsys.readouterr().err == ""


@pytest.mark.parametrize(("broken", "fragment"), [
    ("tolerance", "DDP differs from one process beyond the stated tolerance: loss"),
    ("replicas", "the replicas are not bit-identical at: after DDP(), step 0, step 1, step 2"),
])
def test_a_broken_promise_is_one_line_and_exit_1(lab10, one_rank, capsys, monkeypatch, broken, fragment):
    """A real run in this process (one rank): with a tolerance no result can meet, or replicas
    that never compare equal, the report is printed and the check fails in one line, exit code 1."""
    from labkit import dist as labdist

    if broken == "tolerance":
        monkeypatch.setattr(lab10, "TOLERANCE", {"loss": -1.0, "grads": -1.0, "params": -1.0})
    else:
        monkeypatch.setattr(lab10, "replicas_identical", lambda module: False)
    with pytest.raises(SystemExit) as exc:
        run_lab(labdist.ranked(lab10.main), [*TINY, "--json"])
    out, err = capsys.readouterr()
    assert exc.value.code == 1
    assert json.loads(out)["world_size"] == 1  # the numbers that broke it are reported first
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "check failed: " + fragment in lines[0], lines


@pytest.mark.cuda
def test_cuda_run_per_rank_agrees_with_the_allocator():
    """Two ranks: NCCL with two GPUs, gloo when they share one. Over the last step, every byte the
    allocator adds is one the ledger saw, within 5 %."""
    proc = launch("--device", "cuda", "--json", "--steps", "3")
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    s = json.loads(stdout)
    assert s["device"].startswith("cuda") and all(s["replicas_identical"][f"step {i}"] for i in range(3))
    assert s["backend"] == ("nccl" if torch.cuda.device_count() >= 2 else "gloo")
    assert all(s["reference"][k]["within"] for k in ("loss", "grads", "params"))
    for m in s["memory"]:
        assert 0.95 <= m["cuda"]["ledger_over_allocator"] <= 1.05, m["cuda"]
