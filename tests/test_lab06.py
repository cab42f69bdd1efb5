"""Lab 06: accumulation against the large batch, flat memory, the budget trainer, bad input."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import assert_clean_usage_error, load_lab, run_cli

from labkit import GPTConfig, run_lab

SCRIPT = "lab-06-gradient-accumulation/grad_accumulation.py"
SIZE = ["--width", "32", "--layers", "2", "--heads", "2", "--seq-len", "16", "--vocab", "64"]
SMALL = ["--device", "cpu", *SIZE]
CFG = GPTConfig(vocab=64, seq_len=16, width=32, layers=2, heads=2)
CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread is as fast, and two threads on a busy machine are 10x slower."""
    before, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # for the command-line runs too
    yield
    torch.set_num_threads(before)
    if env is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = env


@pytest.fixture(scope="module")
def lab06():
    return load_lab(SCRIPT)


@pytest.fixture(scope="module")
def probes(lab06):
    """Measured steady-state peaks for batch 8 at every micro-batch size, checkpointing off and on."""
    return {(m, ck): lab06.probe(CFG, CPU, 8, m, ck) for m in (1, 2, 4, 8) for ck in (False, True)}


# ---------------------------------------------------------------- the same gradients
@pytest.mark.parametrize("k", [2, 8])
def test_accumulated_gradients_equal_the_large_batch_within_tolerance(lab06, k):
    gap = lab06.gradient_gap(CFG, 8, k)
    # fp32 sums in another order: a few roundings of the largest gradient, far below the tolerance
    assert gap["max_abs_diff"] <= lab06.TOLERANCE * gap["max_abs_grad"], gap
    assert abs(gap["norm_ratio"] - 1) <= lab06.TOLERANCE


def test_one_micro_batch_is_the_large_batch_bit_for_bit(lab06):
    gap = lab06.gradient_gap(CFG, 8, 1)
    assert gap["bit_exact"] and gap["max_abs_diff"] == 0.0


def test_forgetting_the_1_over_k_multiplies_the_gradient_by_k(lab06):
    gap = lab06.gradient_gap(CFG, 8, 4, scale=False)
    assert abs(gap["norm_ratio"] - 4) <= 4 * lab06.TOLERANCE
    assert gap["max_abs_diff"] > 100 * lab06.TOLERANCE * gap["max_abs_grad"]


def test_checkpointed_blocks_give_identical_gradients(lab06):
    x, y = lab06.samples(lab06.SyntheticTokens(CFG.vocab, CFG.seq_len), 0, 4, "cpu")
    grads = []
    for ckpt in (False, True):
        model = lab06.build_model(CFG, ckpt, "cpu", seed=0)
        assert any(isinstance(b, lab06.CheckpointedBlock) for b in model.blocks) is ckpt
        model(x, y)[1].backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))  # same ops recomputed: exact on CPU


def test_accumulation_trains_like_the_large_batch(lab06):
    acc = lab06.run_steps(CFG, CPU, micro=2, k=4, ckpt=False, steps=3).losses
    large = lab06.run_steps(CFG, CPU, micro=8, k=1, ckpt=False, steps=3).losses
    assert max(abs(a - b) for a, b in zip(acc, large)) <= 1e-5  # AdamW on gradients equal to ~1e-7


def test_the_same_samples_whatever_the_split(lab06):
    data = lab06.SyntheticTokens(CFG.vocab, CFG.seq_len)
    whole = lab06.samples(data, 8, 8, "cpu")
    parts = list(lab06.micro_batches(data, step=1, batch=8, micro=2, device="cpu"))
    assert len(parts) == 4
    assert torch.equal(torch.cat([x for x, _ in parts]), whole[0])
    assert torch.equal(torch.cat([y for _, y in parts]), whole[1])


# ---------------------------------------------------------------- memory
def test_peak_is_flat_in_the_effective_batch_and_the_large_batch_grows(lab06):
    acc = {k: lab06.run_steps(CFG, CPU, 2, k, False, steps=2).ledger.peak() for k in (2, 4, 8)}
    large = {b: lab06.run_steps(CFG, CPU, b, 1, False, steps=2).ledger.peak()["total"] for b in (4, 8, 16)}
    assert acc[2] == acc[4] == acc[8]  # every category, to the byte
    n = sum(p.numel() for p in lab06.build_model(CFG, False, "cpu", 0).parameters())
    assert acc[8]["gradients"] == 4 * n  # a full set of gradients rides under every later micro-batch
    assert large[4] < large[8] < large[16]
    assert large[16] - large[8] == 2 * (large[8] - large[4])  # linear in the batch, exactly on CPU
    assert acc[8]["total"] < large[16]


def test_probe_measures_the_peak_of_a_longer_run_exactly(lab06, probes):
    run = lab06.run_steps(CFG, CPU, 2, 4, False, steps=3)
    assert run.ledger.peak()["total"] == probes[2, False]
    assert run.ledger.peak()["total"] == lab06.probe(CFG, CPU, 8, 2, False)  # deterministic


def test_checkpointing_lowers_every_probe(probes):
    for m in (1, 2, 4, 8):
        assert probes[m, True] < probes[m, False]
    for ck in (False, True):
        assert probes[1, ck] < probes[2, ck] < probes[4, ck] < probes[8, ck]


# ---------------------------------------------------------------- the budget trainer
def budget_run(lab06, budget: int, *extra: str):
    args = lab06.parse_args([*SMALL, "--json", "--batch", "8", "--steps", "2", "--budget", str(budget), *extra])
    run = lab06.train(args)
    return run, lab06.summary(run, args)


def test_generous_budget_takes_the_large_batch(lab06, probes):
    run, s = budget_run(lab06, probes[8, False])
    assert (run.micro_batch, run.accum_steps, run.checkpoint) == (8, 1, False)
    assert s["within_budget"] and s["peak_bytes"]["total"] <= probes[8, False]


def test_middle_budget_accumulates_without_checkpointing(lab06, probes):
    run, s = budget_run(lab06, probes[4, False] - 1)  # one byte short of micro-batch 4
    assert (run.micro_batch, run.accum_steps, run.checkpoint) == (2, 4, False)
    assert s["peak_bytes"]["total"] == probes[2, False] <= s["budget_bytes"]
    assert [(p["micro_batch"], p["checkpoint"], p["fits"]) for p in s["probes"]] == [
        (1, True, True), (1, False, True), (2, False, True), (4, False, False)]


def test_tight_budget_turns_checkpointing_on(lab06, probes):
    assert probes[1, True] < probes[1, False]
    run, s = budget_run(lab06, probes[1, False] - 1)
    assert run.checkpoint and run.micro_batch >= 1 and s["within_budget"]
    assert s["peak_bytes"]["total"] == probes[run.micro_batch, True]
    fits = [m for m in (1, 2, 4, 8) if probes[m, True] <= probes[1, False] - 1]
    assert run.micro_batch == max(fits)


def test_checkpoint_off_restricts_the_search(lab06, probes, capsys):
    with pytest.raises(SystemExit) as exc:
        run_lab(lab06.main, [*SMALL, "--budget", str(probes[1, False] - 1), "--checkpoint", "off"], prog="x")
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpointing off" in err[0] and f"{probes[1, False]:,} B" in err[0]


def test_impossible_budget_names_the_smallest_measured_peak():
    proc = run_cli(SCRIPT, *SMALL, "--budget", "64KiB")
    assert_clean_usage_error(proc, "cannot be met", "micro-batch 1, checkpointing on", "measured")
    assert proc.stdout == ""


def test_json_summary_schema_with_a_budget():
    proc = run_cli(SCRIPT, *SMALL, "--json", "--batch", "4", "--steps", "2", "--budget", "1GiB")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)  # exactly one JSON object
    assert data["budget_bytes"] == 1 << 30 and data["within_budget"] is True
    assert (data["micro_batch"], data["accum_steps"], data["batch"], data["checkpoint"]) == (4, 1, 4, False)
    assert len(data["losses"]) == 2 and data["steps"] == 2
    assert {"micro_batch", "accum_steps", "checkpoint", "peak_bytes", "fits"} == set(data["probes"][0])
    assert [(p["micro_batch"], p["checkpoint"]) for p in data["probes"]] == [(1, True), (1, False), (2, False), (4, False)]
    assert data["peak_bytes"]["total"] == data["probes"][-1]["peak_bytes"] <= data["budget_bytes"]
    assert {"zero_grad", "forward", "backward", "optimizer"} == set(data["peak_bytes_by_phase"])
    assert data["provenance"]["source_hash"] and data["provenance"]["device_type"] == "cpu"
    assert proc.stderr == ""


def test_human_report(lab06, capsys):
    run_lab(lab06.main, [*SMALL, "--batch", "2", "--steps", "1", "--budget", "1GiB"], prog="x")
    out = capsys.readouterr().out
    assert "| micro-batch | accumulation steps | checkpointing | measured peak | fits |" in out
    assert "chosen: 1 x micro-batch 2, checkpointing off" in out
    assert "is within the budget of 1,073,741,824 B" in out


# ---------------------------------------------------------------- flags
@pytest.mark.parametrize(("text", "expected"), [
    ("123", 123), ("512KiB", 512 << 10), ("64MiB", 64 << 20), ("1.5GiB", 3 << 29), ("64mib", 64 << 20),
    (" 2 MiB ", 2 << 20), ("10B", 10)])
def test_parse_bytes(lab06, text, expected):
    assert lab06.parse_bytes(text) == expected


@pytest.mark.parametrize(("argv", "split"), [
    ([], (4, 4, 16)),
    (["--batch", "8"], (8, 1, 8)),
    (["--batch", "16", "--micro-batch", "4"], (4, 4, 16)),
    (["--batch", "16", "--accum-steps", "2"], (8, 2, 16)),
    (["--micro-batch", "3", "--accum-steps", "5"], (3, 5, 15)),
    (["--micro-batch", "2"], (2, 4, 8)),
    (["--batch", "12", "--micro-batch", "3", "--accum-steps", "4"], (3, 4, 12)),
])
def test_batch_flags_resolve(lab06, argv, split):
    a = lab06.parse_args(argv)
    assert (a.micro_batch, a.accum_steps, a.batch) == split


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--batch", "10", "--micro-batch", "4"], "not a multiple of --micro-batch 4"),
        (["--batch", "10", "--accum-steps", "3"], "not a multiple of --accum-steps 3"),
        (["--batch", "10", "--micro-batch", "4", "--accum-steps", "4"], "= 16, but --batch is 10"),
        (["--budget", "64MB"], "ambiguous"),
        (["--budget", "lots"], "--budget"),
        (["--budget", "0"], "--budget"),
        (["--budget", "-5MiB"], "--budget"),
        (["--budget", "10MiB", "--micro-batch", "2"], "--budget chooses the micro-batch"),
        (["--checkpoint", "maybe"], "--checkpoint"),
        (["--micro-batch", "0"], "--micro-batch"),
        (["--steps", "-1"], "--steps"),
        (["--width", "30", "--heads", "4"], "not divisible"),
        (["--device", "tpu"], "--device"),
        (["--snapshot", "s.pickle"], "needs a CUDA device"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(lab06, capsys, args, fragment):
    if "--snapshot" in args and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit) as exc:
        run_lab(lab06.main, [*SMALL, "--steps", "1", *args], prog="grad_accumulation.py")
    assert exc.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and fragment in err[0], err


# ---------------------------------------------------------------- GPU
@pytest.mark.cuda
def test_cuda_budget_run_agrees_with_the_allocator(lab06, tmp_path):
    snap = tmp_path / "snap.pickle"
    args = lab06.parse_args(["--device", "cuda", "--json", "--batch", "16", "--steps", "2", "--budget", "2GiB",
                             "--width", "512", "--layers", "4", "--heads", "8", "--seq-len", "256",
                             "--snapshot", str(snap)])
    run = lab06.train(args)
    s = lab06.summary(run, args)
    assert s["within_budget"] and s["cuda"]["max_memory_allocated"] <= 1.05 * args.budget
    assert 0.95 <= s["cuda"]["ledger_over_allocator"] <= 1.05, s["cuda"]
    assert snap.is_file() and snap.stat().st_size > 0
    assert s["provenance"]["device_type"] == "cuda" and s["provenance"]["device_name"]


@pytest.mark.cuda
def test_cuda_accumulation_peak_is_flat(lab06):
    cfg = GPTConfig(vocab=256, seq_len=256, width=512, layers=4, heads=8)
    dev = torch.device("cuda")
    peaks = [lab06.run_steps(cfg, dev, 4, k, False, steps=2).ledger.peak()["total"] for k in (2, 4, 8)]
    assert peaks[0] == peaks[1] == peaks[2]
    large = [lab06.run_steps(cfg, dev, b, 1, False, steps=2).ledger.peak()["total"] for b in (8, 16, 32)]
    assert large[0] < large[1] < large[2]
