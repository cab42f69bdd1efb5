"""Lab 10: DDP under torchrun with 2 CPU processes (gloo): buckets, identical replicas, the match
with one process on the concatenated batch, memory per rank; bad input; broken promises; one rank
of N traced in this process (the fake process group, fake tensors) against the launched rank and
against real tensors, and the page's claim at real size.

Three torchrun launches (buckets copied, gradients as bucket views, an unwritable --ledger-dir) run
at the same time in one module fixture: each is mostly process start-up, so together they take the
time of about one.
"""

from __future__ import annotations

import functools
import json
import re

import pytest
import torch
from conftest import assert_clean_usage_error, assert_usage_error_in_process, load_lab, run_cli

from labkit import cli, fake
from labkit import dist as labdist
from labkit.timeline import Timeline

SCRIPT = "lab-10-ddp/train_ddp.py"
TINY = {"device": "cpu", "steps": 3, "width": 32, "layers": 2, "heads": 2, "seq_len": 16, "vocab": 64,
        "batch_size": 2, "bucket_cap_mb": 0.02}
MODEL_STATE = ("parameters", "gradients", "optimizer_state", "communication")


@pytest.fixture(scope="module")
def lab10():
    return load_lab(10)


@pytest.fixture(scope="module")
def tiny_flags(lab10):
    return cli.argv(lab10.Config(**TINY))


@pytest.fixture(scope="module")
def launched(lab10, tiny_flags, tmp_path_factory):
    """Two good runs (rank 0's JSON summaries, each rank's ledger) and one refused before training."""
    base = tmp_path_factory.mktemp("lab10")
    bad = labdist.torchrun(lab10, [*tiny_flags, "--ledger-dir", "/proc/lab10/x"])
    summaries = labdist.launch(lab10, {
        "copy": lab10.Config(**TINY, ledger_dir=base / "copy"),
        "view": lab10.Config(**TINY, grad_as_bucket_view=True, ledger_dir=base / "view")}, timeout=240)
    stdout, stderr = bad.communicate(timeout=120)
    return {"copy": summaries["copy"], "view": summaries["view"], "dir": base,
            "bad path": {"returncode": bad.returncode, "stdout": stdout, "stderr": stderr}}


def ledger_of(launched, run: str, rank: int) -> tuple[dict, Timeline]:
    data = json.loads((launched["dir"] / run / f"rank{rank}.json").read_text())
    return data, Timeline.from_dict(data["timeline"])


def model_size(summary) -> tuple[int, int]:
    """P parameters in T tensors."""
    return summary["params"], summary["param_tensors"]


def main(lab10, argv: list[str]) -> None:
    """The lab's command line in this process, as its ``__main__`` runs it."""
    with labdist.one_voice() as voice:
        cli.main(lab10.Config, voice.ranked(lab10.run), lab10.report, argv)


def test_one_json_object_and_one_ledger_file_per_rank(launched):
    s = launched["copy"]  # launch() has checked: exit code 0, one JSON line (rank 1 prints nothing)
    assert s["world_size"] == 2 and s["backend"] == "gloo" and s["device"] == "cpu"
    assert len(s["losses"]) == 3 and all(isinstance(v, float) for v in s["losses"])
    assert s["provenance"]["lab"] == "lab-10-ddp" and s["provenance"]["source_hash"]
    assert [m["rank"] for m in s["memory"]] == [0, 1]
    for rank in (0, 1):
        data, tl = ledger_of(launched, "copy", rank)
        assert data["rank"] == rank and len(tl) == data["events"] > 0
        assert tl.peak() == data["peak"]  # the file's timeline is the one the rank measured


def test_replicas_differ_before_ddp_and_are_identical_after_every_step(launched):
    same = launched["copy"]["replicas_identical"]
    assert same["before DDP"] is False  # seeded with seed + rank on purpose
    assert same["after DDP()"] is True  # DDP broadcast rank 0's weights
    assert [same[f"step {i}"] for i in range(3)] == [True, True, True]


def test_matches_one_process_on_the_concatenated_batch_within_tolerance(launched):
    ref = launched["copy"]["reference"]
    for key in ("loss", "grads", "params"):
        assert ref[key]["within"] and ref[key]["ratio"] <= ref["tolerance"][key], (key, ref[key])
    assert ref["tolerance"] == {"loss": 1e-5, "grads": 1e-4, "params": 1e-2}
    assert ref["bit_exact"] is False  # other summation orders: equal up to rounding, not bit for bit
    assert 0 < ref["grads"]["ratio"] < 1e-5  # a few fp32 roundings, far below the tolerance
    assert ref["largest_element_diff"]["param"].endswith("attn.qkv.bias")  # AdamW on a zero gradient


def test_buckets_follow_the_derivation_and_what_ddp_reports(launched):
    s = launched["copy"]
    b, (P, T) = s["buckets"], model_size(s)
    cap = int(0.02 * 2**20)
    assert b["cap_bytes"] == cap
    assert len(b["first_backward"]) == 1 and len(b["first_backward"][0]["params"]) == T
    sizes = [x["bytes"] for x in b["buckets"]]
    assert len(sizes) >= 3 and sum(sizes) == 4 * P  # every fp32 gradient in exactly one bucket
    assert all(n >= cap for n in sizes[:-1])  # a bucket closes once it reaches the cap
    assert b["bytes_match_reverse_order"] and b["params_match_ready_order"]
    assert b["derived_reverse_order_bytes"] == sizes
    assert [sum(b["param_bytes"][n] for n in x["params"]) for x in b["buckets"]] == sizes  # its gradients, no more
    assert b["ddp_reported_matches"] is True  # the third step's forward logged the rebuilt buckets
    assert b["ready_order"][0] == "head.weight" and b["ready_order"][-1] == "tok.weight"
    assert s["buckets_equal_on_all_ranks"]


def test_every_rank_holds_the_same_model_state_and_the_buckets_as_communication(launched):
    """The model state is the same on every rank, to the byte, at its peak and in its optimizer
    phase. The rest of a peak may differ by a few hundred bytes: the buffers of a collective are
    freed by gloo's worker thread when it drops the finished work, which can be some ledger events
    after the rank has moved on. Such a buffer then lands in the next phase: the layout DDP
    broadcasts when it rebuilds its buckets in step 1's forward, 4 B x (T + 1) + 4 B x buckets
    (140 B here), becomes activations; the digests a check all-gathers (158 B) stay temporaries a
    little longer. So the ranks' peaks are compared category by category, not as totals."""
    s = launched["copy"]
    P, T = model_size(s)
    for m in s["memory"]:
        opt = m["peaks_by_phase"]["optimizer"]
        assert opt["parameters"] == 4 * P and opt["gradients"] == 4 * P
        assert opt["optimizer_state"] == 8 * P + 4 * T
        assert opt["communication"] == 4 * P == m["at_end"]["communication"]
    rank0, rank1 = s["memory"]
    for row0, row1 in ((rank0["peak"], rank1["peak"]), (rank0["peaks_by_phase"]["optimizer"],
                                                         rank1["peaks_by_phase"]["optimizer"])):
        assert {c: row0[c] for c in MODEL_STATE} == {c: row1[c] for c in MODEL_STATE}
        in_flight = sum(abs(row0[c] - row1[c]) for c in ("activations", "temporaries", "other"))
        assert in_flight < 1024, (row0, row1)  # collective buffers: 140 B and 158 B seen


def test_gradient_as_bucket_view_drops_the_separate_gradients(launched):
    copy, view = launched["copy"], launched["view"]
    P, _ = model_size(copy)
    assert view["losses"] == copy["losses"]  # the same arithmetic, only where gradients live
    for a, b in zip(copy["memory"], view["memory"]):
        a, b = a["peaks_by_phase"]["optimizer"], b["peaks_by_phase"]["optimizer"]
        assert b["gradients"] == 0 and b["communication"] == 4 * P
        assert sum(a[c] for c in MODEL_STATE) - sum(b[c] for c in MODEL_STATE) == 4 * P


def communication_in(tl: Timeline, step: int, *phases: str) -> list[int]:
    return [tl.device["communication"][i] for i in range(len(tl)) if tl.step[i] == step and tl.phase[i] in phases]


def test_the_timeline_shows_one_bucket_then_the_rebuilt_ones(launched):
    P, _ = model_size(launched["copy"])
    for rank in (0, 1):
        _, tl = ledger_of(launched, "copy", rank)
        assert set(communication_in(tl, 0, "backward", "optimizer")) == {4 * P}  # DDP()'s one bucket
        rebuild = communication_in(tl, 1, "forward")
        assert min(rebuild) < 4 * P and rebuild[-1] == 4 * P  # old bucket freed, new ones allocated
        assert tl.device["communication"][-1] == 4 * P


def test_the_derived_model_state_equals_each_ranks_ledger(lab10, launched):
    """The notebook's dashed line: in every check phase, parameters + buckets + gradients + AdamW
    state on the ledger equal the formula, on both ranks."""
    P, T = model_size(launched["copy"])
    for rank in (0, 1):
        _, tl = ledger_of(launched, "copy", rank)
        predicted = lab10.predicted_model_state(tl, P, T)
        checks = [i for i in range(len(tl)) if tl.phase[i] == "check"]
        assert checks and all(sum(tl.device[c][i] for c in MODEL_STATE) == predicted[i] for i in checks)


def test_the_tables_and_the_human_report(launched, capsys):
    from ddp_report import memory_table, print_summary

    s, P = launched["copy"], launched["copy"]["params"]
    rows = memory_table({"copy": s, "view": launched["view"]}).rows
    assert rows[0][1:5] == [4 * P, 4 * P, rows[0][3], 4 * P] and len(rows) == 5
    assert [r[2] for r in rows[3:]] == [0, 0]  # the view run's gradients live in the buckets
    print_summary(s)
    out = capsys.readouterr().out
    assert "replicas identical: True" in out and "bucket 0:" in out
    assert re.search(r"rank 0 +rank 0 +rank 1 +rank 1\n *rank, moment +peak +optimizer +peak +optimizer", out)
    assert "Not seen: gloo's own buffers" in out


def test_derive_buckets_closes_a_bucket_at_the_cap(lab10):
    sizes = [("a", 10), ("b", 10), ("c", 10), ("d", 30), ("e", 5)]
    assert lab10.derive_buckets(sizes, 20) == [["a", "b"], ["c", "d"], ["e"]]
    assert lab10.derive_buckets(sizes, 100) == [["a", "b", "c", "d", "e"]]
    assert lab10.derive_buckets(sizes, 20, first_cap_bytes=5) == [["a"], ["b", "c"], ["d"], ["e"]]


@pytest.mark.parametrize(("fields", "fragment"), [
    ({"width": 30, "heads": 4}, "not divisible"),
    ({"backend": "nccl"}, "--backend nccl needs --device cuda"),
    ({"snapshot": "s.pickle"}, "--snapshot needs a CUDA device"),
])
def test_the_config_refuses_what_cannot_run(lab10, fields, fragment):
    with pytest.raises(lab10.UsageError, match=fragment):
        lab10.Config(**{**TINY, **fields})


def test_run_with_python_it_starts_its_own_ranks(monkeypatch, tiny_flags):
    """No torchrun: the script checks its flags, then starts --nproc-per-node ranks itself; rank 0
    speaks for all of them."""
    for name in labdist.TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    proc = run_cli(SCRIPT, *tiny_flags, "--nproc-per-node", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    identical = summary["replicas_identical"]  # each rank starts from its own seed; DDP() broadcasts rank 0's
    assert summary["world_size"] == 3 and not identical.pop("before DDP") and all(identical.values())


def test_run_with_python_bad_input_is_one_line_and_exit_2_before_any_rank(monkeypatch):
    for name in labdist.TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    proc = run_cli(SCRIPT, "--device", "cpu", "--ledger-dir", "/proc/lab10/x")
    assert_clean_usage_error(proc, "--ledger-dir /proc/lab10/x: cannot write into /proc")
    assert_clean_usage_error(run_cli(SCRIPT, "--device", "cpu", "--nproc-per-node", "0"), "--nproc-per-node")


def test_nproc_per_node_must_agree_with_torchrun_and_not_with_a_fake_world(lab10, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # as torchrun sets it
    with pytest.raises(lab10.UsageError, match="torchrun started 2"):
        lab10.Config(**TINY, nproc_per_node=3)
    lab10.Config(**TINY, nproc_per_node=2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(lab10.UsageError, match="give one"):
        lab10.Config(**TINY, world_size=8, nproc_per_node=2)


@pytest.mark.parametrize(("args", "fragment"), [
    (["--ledger-dir", "/proc/lab10/x"], "--ledger-dir /proc/lab10/x: cannot write into /proc"),
    (["--ledger-dir", "/dev/null"], "--ledger-dir /dev/null is not a folder"),
    ([], "launch with torchrun"),
])
def test_what_cannot_run_is_refused_before_the_process_group(lab10, tiny_flags, capsys, monkeypatch, args, fragment):
    if args:
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")  # as under torchrun, but refused before joining
    else:
        monkeypatch.delenv("RANK", raising=False)
    assert_usage_error_in_process(lab10, [*tiny_flags, *args], capsys, fragment)
    assert not torch.distributed.is_initialized()


def test_under_torchrun_bad_input_is_reported_by_rank_0_alone(launched):
    """Both ranks refuse the path before training; only rank 0 says so. Its exit code 2 becomes
    torchrun's own failure report and exit code 1."""
    run = launched["bad path"]
    assert run["returncode"] == 1 and run["stdout"] == ""
    ours = [line for line in run["stderr"].splitlines() if line.startswith("train_ddp.py:")]
    assert ours == ["train_ddp.py: error: --ledger-dir /proc/lab10/x: cannot write into /proc (No such file or directory)"]
    assert "exitcode  : 2" in run["stderr"]  # torchrun names the rank that failed and its code


def test_the_other_ranks_refuse_bad_input_in_silence(lab10, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(labdist, "QUIET_EXIT_DELAY_S", 0)
    with pytest.raises(SystemExit) as exc:
        main(lab10, ["--device", "cpu", "--steps", "1"])
    assert exc.value.code == 2 and capsys.readouterr().err == ""


@pytest.mark.parametrize(("broken", "fragment"), [
    ("tolerance", "DDP differs from one process beyond the stated tolerance: loss"),
    ("replicas", "the replicas are not bit-identical at: after DDP(), step 0, step 1, step 2"),
])
def test_a_broken_promise_is_reported_then_one_line_and_exit_1(lab10, tiny_flags, one_rank, capsys, monkeypatch,
                                                                broken, fragment):
    """A real run in this process (one rank): with a tolerance no result can meet, or replicas
    that never compare equal, the report is printed and the check fails in one line, exit code 1."""
    if broken == "tolerance":
        monkeypatch.setattr(lab10, "TOLERANCE", {"loss": -1.0, "grads": -1.0, "params": -1.0})
    else:
        monkeypatch.setattr(lab10, "replicas_identical", lambda module: False)
    with pytest.raises(SystemExit) as exc:
        main(lab10, [*tiny_flags, "--json"])
    out, err = capsys.readouterr()
    assert exc.value.code == 1
    assert json.loads(out)["world_size"] == 1  # the numbers that broke it are reported first
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "check failed: " + fragment in lines[0], lines


@pytest.mark.cuda
def test_cuda_run_per_rank_agrees_with_the_allocator(lab10):
    """Two ranks: NCCL with two GPUs, gloo when they share one. Over the last step, every byte the
    allocator adds is one the ledger saw, within 5 %."""
    s = labdist.launch(lab10, {"cuda": lab10.Config(device="cuda", steps=3)}, timeout=300)["cuda"]
    assert s["device"].startswith("cuda") and all(s["replicas_identical"][f"step {i}"] for i in range(3))
    assert s["backend"] == ("nccl" if torch.cuda.device_count() >= 2 else "gloo")
    assert all(s["reference"][k]["within"] for k in ("loss", "grads", "params"))
    for m in s["memory"]:
        assert 0.95 <= m["cuda"]["ledger_over_allocator"] <= 1.05, m["cuda"]


# --------------------------------------------------------------------------- one rank of N, in this process
def traced_exactly(lab10, monkeypatch, **fields) -> dict:
    """A --world-size run's summary, with --fake counting exact bytes (block=None), as a CPU run does:
    the 512-byte rounding a --fake run adds is labkit.fake's own, tested there."""
    monkeypatch.setattr(fake, "tensors", functools.partial(fake.tensors, block=None))
    return lab10.run(lab10.Config(**fields)).summary()


def test_a_traced_rank_is_rank_0_of_the_launched_job(lab10, launched, monkeypatch):
    """The two-process gloo run's rank 0, and the same job's rank 0 traced in this process under the
    fake process group on fake tensors: the same model state and buckets, to the byte, at the peak,
    in every phase but the check and at the end; the rest of a peak within the few hundred bytes
    gloo's worker thread moves between ranks too (the test above). Two phases differ: the check
    (the trace has no replicas to compare, so no digests are gathered) and the wrap, where gloo's
    worker frees the flat copy of the weights `DDP(...)` broadcasts (and a few hundred bytes of
    collective buffers) early or late, 4 to 8 B x P of communication at the wrap's peak, and the
    fake group, which has no worker, at once (4 B x P).
    (The trace names AdamW's for-loop, what PyTorch picks on CPU tensors, as the launched run did.)"""
    trace = traced_exactly(lab10, monkeypatch, **TINY, world_size=2, fake=True, adamw="for-loop")
    rank0, mine = launched["copy"]["memory"][0], trace["memory"]
    assert trace["traced"].startswith("traced on fake tensors") and trace["params"] == launched["copy"]["params"]
    p = trace["params"]
    assert mine["peaks_by_phase"]["wrap"]["communication"] == 4 * p
    assert 4 * p <= rank0["peaks_by_phase"]["wrap"]["communication"] <= 8 * p + 1024  # and a small buffer or not
    phases = [phase for phase in rank0["peaks_by_phase"] if phase not in ("check", "wrap")]
    for a, b in [(rank0["peak"], mine["peak"]), (rank0["at_end"], mine["at_end"]),
                 *((rank0["peaks_by_phase"][p], mine["peaks_by_phase"][p]) for p in phases)]:
        assert {c: a[c] for c in MODEL_STATE} == {c: b[c] for c in MODEL_STATE}
        assert sum(abs(a[c] - b[c]) for c in ("activations", "temporaries", "other")) < 1024, (a, b)
    assert trace["buckets"]["bytes"] == [x["bytes"] for x in launched["copy"]["buckets"]["buckets"]]
    assert trace["buckets"]["bytes_match_reverse_order"] and trace["buckets"]["params_match_ready_order"]


def test_fake_and_real_tensors_trace_the_same_rank(lab10, monkeypatch):
    """small-llama, rank 0 of 4, under the fake process group: on real tensors and on fake ones, the
    same peaks by category in every phase, the same events, the same buckets."""
    size = dict(model="small-llama", world_size=4, seq_len=32, batch_size=2, steps=3, adamw="foreach",
                bucket_cap_mb=0.05)
    real = lab10.run(lab10.Config(**size)).summary()
    trace = traced_exactly(lab10, monkeypatch, **size, fake=True)
    assert real["traced"] is None and trace["traced"] and real["params"] == trace["params"]
    assert real["memory"] == trace["memory"] and real["buckets"] == trace["buckets"]
    assert trace["buckets"]["count"] > 1 and trace["buckets"]["ddp_reported_matches"] is True


def test_at_real_size_a_ddp_rank_holds_the_same_bytes_on_8_and_64_ranks(lab10):
    """The page's claim, traced at Llama-3.2-1B (a real model, 4 s a trace instead of 8B's 7),
    4,096 tokens per rank, PyTorch's 25 MiB buckets: rank 0 of 8 and rank 0 of 64 peak at the same
    bytes in every category and phase; the buckets hold every gradient once more (4 B x P), and in
    the optimizer phase foreach AdamW adds a temporary the size of the weights."""
    runs = {n: lab10.run(lab10.Config(model="llama-3.2-1b", fake=True, world_size=n, seq_len=4096, batch_size=1,
                                      steps=2, bucket_cap_mb=25)).summary() for n in (8, 64)}
    assert runs[8]["memory"]["peak"] == runs[64]["memory"]["peak"]
    assert runs[8]["memory"]["peaks_by_phase"] == runs[64]["memory"]["peaks_by_phase"]
    s = runs[64]
    p = s["params"]
    assert s["buckets"]["total_bytes"] == 4 * p == s["memory"]["at_end"]["communication"]
    assert s["buckets"]["bytes_match_reverse_order"] and s["buckets"]["count"] > 50
    step = s["memory"]["peaks_by_phase"]["optimizer"]
    for category in ("parameters", "gradients", "communication", "temporaries"):
        assert 4 * p <= step[category] < 4 * p + 512 * s["param_tensors"], category


@pytest.mark.parametrize(("fields", "fragment"), [
    ({"fake": True}, "--fake traces one rank in this process: give --world-size N"),
    ({"world_size": 8, "device": "cuda"}, "--world-size runs one rank in this process on the CPU"),
    ({"world_size": 8, "ledger_dir": "x"}, "--world-size runs one rank in this process on the CPU"),
])
def test_a_traced_rank_needs_a_world_size_on_the_cpu(lab10, fields, fragment):
    with pytest.raises(lab10.UsageError, match=fragment):
        lab10.Config(**fields)


def test_a_traced_rank_from_the_command_line():
    proc = run_cli(SCRIPT, "--model", "small-llama", "--fake", "--world-size", "64", "--steps", "2")
    assert proc.returncode == 0, proc.stderr
    assert "rank 0 of 64 in one process (fake process group): small-llama" in proc.stdout
    assert "traced on fake tensors" in proc.stdout
    header = proc.stdout.split("The buckets of the last step:")[1].split("---")[0].split()
    assert header.index("bytes") < header.index("as") < header.index("derived")  # a column headed "bytes as derived"
