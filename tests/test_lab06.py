"""Lab 06: accumulation against the large batch, flat memory, the budget trainer, the split rules."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from conftest import assert_clean_usage_error, assert_usage_error_in_process, load_lab, run_cli
from test_labkit_fake import assert_same_timeline

from labkit import GPTConfig, cli, fake, labs, marks

SCRIPT = "lab-06-gradient-accumulation/grad_accumulation.py"
SIZE = {"device": "cpu", "width": 32, "layers": 2, "heads": 2, "seq_len": 16, "vocab": 64}
SMALL = ["--device", "cpu", "--width", "32", "--layers", "2", "--heads", "2", "--seq-len", "16",
         "--vocab", "64"]  # the same, as a user types it
CFG = GPTConfig(vocab=64, seq_len=16, width=32, layers=2, heads=2)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def lab06():
    return load_lab(6)


@pytest.fixture(scope="module")
def derived():
    return load_lab(6, "accumulation_math")


def train(lab06, **fields):
    return lab06.run(lab06.Config(**SIZE, **fields))


@pytest.fixture(scope="module")
def peaks(lab06):
    """Measured steady-state peaks for batch 8 at every micro-batch size, checkpointing off and on."""
    config = lab06.Config(**SIZE)
    assert config.model_config() == CFG
    return {(m, ck): lab06.measure_peak(config, CPU, 8, m, ck) for m in (1, 2, 4, 8) for ck in (False, True)}


# ---------------------------------------------------------------- the same gradients
@pytest.mark.parametrize("k", [2, 8])
def test_accumulated_gradients_equal_the_large_batch_within_tolerance(lab06, derived, k):
    gap = lab06.gradient_gap(CFG, 8, k)
    # fp32 sums in another order: a few roundings of the largest gradient, far below the tolerance
    assert derived.relative_gap(gap) <= lab06.TOLERANCE, gap
    assert 0 < derived.gap_in_ulps(gap) < 100
    assert abs(gap["norm_ratio"] - 1) <= lab06.TOLERANCE


def test_one_micro_batch_is_the_large_batch_bit_for_bit(lab06):
    assert not marks.watching()  # no ledger: accumulate's marks cost nothing
    gap = lab06.gradient_gap(CFG, 8, 1)
    assert gap["bit_exact"] and gap["max_abs_diff"] == 0.0


def test_forgetting_the_1_over_k_multiplies_the_gradient_by_k(lab06, derived):
    gap = lab06.gradient_gap(CFG, 8, 4, scale=False)
    assert abs(gap["norm_ratio"] - 4) <= 4 * lab06.TOLERANCE
    assert derived.relative_gap(gap) > 100 * lab06.TOLERANCE


def test_gap_in_ulps_counts_units_of_the_last_place(derived):
    assert derived.gap_in_ulps({"max_abs_diff": 2.0 ** -23, "max_abs_grad": 1.5}) == 1.0
    assert derived.gap_in_ulps({"max_abs_diff": 2.0 ** -24, "max_abs_grad": 0.75}) == 1.0


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
    acc = train(lab06, micro_batch=2, accum_steps=4, steps=3).losses
    large = train(lab06, batch=8, steps=3).losses
    assert max(abs(a - b) for a, b in zip(acc, large)) <= 1e-5  # AdamW on gradients equal to ~1e-7


def test_the_same_samples_whatever_the_split(lab06):
    data = lab06.SyntheticTokens(CFG.vocab, CFG.seq_len)
    whole = lab06.samples(data, 8, 8, "cpu")
    parts = list(lab06.micro_batches(data, step=1, batch=8, micro=2, device="cpu"))
    assert len(parts) == 4
    assert torch.equal(torch.cat([x for x, _ in parts]), whole[0])
    assert torch.equal(torch.cat([y for _, y in parts]), whole[1])


# ---------------------------------------------------------------- memory
def test_peak_is_flat_in_the_effective_batch_and_the_large_batch_grows(lab06, derived):
    acc = {k: train(lab06, micro_batch=2, accum_steps=k, steps=2).ledger.peak() for k in (1, 2, 4, 8)}
    large = {b: train(lab06, batch=b, steps=2).ledger.peak()["total"] for b in (4, 8, 16)}
    assert acc[2] == acc[4] == acc[8]  # every category, to the byte
    assert acc[1]["total"] < acc[2]["total"]  # k = 1 has no full gradients under its activations
    run = train(lab06, micro_batch=2, accum_steps=8, steps=1)
    n, tensors = run.params, len(list(run.model.parameters()))
    assert acc[8]["gradients"] == 4 * n  # a full set of gradients rides under every later micro-batch
    assert acc[8]["optimizer_state"] == 8 * n + 4 * tensors  # AdamW's moments and step counters
    assert acc[8]["parameters"] + acc[8]["gradients"] + acc[8]["optimizer_state"] == derived.model_state_floor(
        n, tensors)
    batches = sorted(large)
    slope, line = derived.line_through_first_two(batches, [large[b] for b in batches])
    assert slope > 0 and line == [large[b] for b in batches]  # linear in the batch, exactly on CPU
    assert acc[8]["total"] < large[16]


def test_every_micro_batch_after_the_first_peaks_the_same(lab06):
    tl = train(lab06, micro_batch=2, accum_steps=4, steps=2).ledger.timeline()
    total = tl.device_total()
    peaks = [max(total[s.start:s.end]) for s in tl.spans if s.name == "backward" and s.step == 1]
    assert len(peaks) == 4 and len(set(peaks[1:])) == 1


def test_the_peak_measured_for_a_candidate_is_the_peak_of_a_longer_run(lab06, peaks):
    run = train(lab06, micro_batch=2, accum_steps=4, steps=3)
    assert run.ledger.peak()["total"] == peaks[2, False]
    assert run.ledger.peak()["total"] == lab06.measure_peak(lab06.Config(**SIZE), CPU, 8, 2, False)  # deterministic


def test_checkpointing_lowers_every_candidate(peaks):
    for m in (1, 2, 4, 8):
        assert peaks[m, True] < peaks[m, False]
    for ck in (False, True):
        assert peaks[1, ck] < peaks[2, ck] < peaks[4, ck] < peaks[8, ck]


# ---------------------------------------------------------------- the budget trainer
def budget_run(lab06, budget: int, **fields):
    return train(lab06, batch=8, steps=2, budget=budget, **fields)


def test_generous_budget_takes_the_large_batch(lab06, peaks):
    run = budget_run(lab06, peaks[8, False])
    s = run.summary()
    assert (run.micro_batch, run.accum_steps, run.checkpoint) == (8, 1, False)
    assert s["within_budget"] and s["peak_bytes"]["total"] <= peaks[8, False]


def test_middle_budget_accumulates_without_checkpointing(lab06, peaks):
    run = budget_run(lab06, peaks[4, False] - 1)  # one byte short of micro-batch 4
    s = run.summary()
    assert (run.micro_batch, run.accum_steps, run.checkpoint) == (2, 4, False)
    assert s["peak_bytes"]["total"] == peaks[2, False] <= s["budget_bytes"]  # the candidate measured this run
    assert [(c["micro_batch"], c["checkpoint"], c["fits"]) for c in s["candidates"]] == [
        (1, True, True), (1, False, True), (2, False, True), (4, False, False)]


def test_tight_budget_turns_checkpointing_on(lab06, peaks):
    assert peaks[1, True] < peaks[1, False]
    run = budget_run(lab06, peaks[1, False] - 1)
    s = run.summary()
    assert run.checkpoint and run.micro_batch >= 1 and s["within_budget"]
    assert s["peak_bytes"]["total"] == peaks[run.micro_batch, True]
    fits = [m for m in (1, 2, 4, 8) if peaks[m, True] <= peaks[1, False] - 1]
    assert run.micro_batch == max(fits)


def test_checkpoint_off_restricts_the_search(lab06, peaks, capsys):
    line = assert_usage_error_in_process(
        lab06, [*SMALL, "--budget", str(peaks[1, False] - 1), "--checkpoint", "off"], capsys, "checkpointing off")
    assert f"{peaks[1, False]:,} B" in line


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
    assert {"micro_batch", "accum_steps", "checkpoint", "peak_bytes", "fits"} == set(data["candidates"][0])
    assert [(c["micro_batch"], c["checkpoint"]) for c in data["candidates"]] == [
        (1, True), (1, False), (2, False), (4, False)]
    assert data["peak_bytes"]["total"] == data["candidates"][-1]["peak_bytes"] <= data["budget_bytes"]
    assert {"zero_grad", "forward", "backward", "optimizer"} == set(data["peak_bytes_by_phase"])
    assert data["provenance"]["source_hash"] and data["provenance"]["device_type"] == "cpu"
    assert proc.stderr == ""


def test_human_report(lab06, capsys):
    cli.main(lab06.Config, lab06.run, lab06.report, [*SMALL, "--batch", "2", "--steps", "1", "--budget", "1GiB"])
    out = capsys.readouterr().out
    assert "micro-batch  accumulation steps  checkpointing  measured peak  fits" in out
    assert "chosen: 1 x micro-batch 2, checkpointing off" in out
    assert "is within the budget of 1,073,741,824 B" in out


# ---------------------------------------------------------------- flags
@pytest.mark.parametrize(("text", "expected"), [
    ("123", 123), ("512KiB", 512 << 10), ("64MiB", 64 << 20), ("1.5GiB", 3 << 29), ("64mib", 64 << 20),
    (" 2 MiB ", 2 << 20), ("10B", 10)])
def test_parse_bytes(lab06, text, expected):
    assert lab06.parse_bytes(text) == expected


@pytest.mark.parametrize(("fields", "split"), [
    ({}, (4, 4)),
    ({"batch": 8}, (8, 1)),
    ({"batch": 16, "micro_batch": 4}, (4, 4)),
    ({"batch": 16, "accum_steps": 2}, (8, 2)),
    ({"micro_batch": 3, "accum_steps": 5}, (3, 5)),
    ({"micro_batch": 2}, (2, 4)),
    ({"batch": 12, "micro_batch": 3, "accum_steps": 4}, (3, 4)),
])
def test_batch_flags_resolve(lab06, fields, split):
    assert lab06.Config(**fields).split() == split


@pytest.mark.parametrize(("fields", "fragment"), [
    ({"batch": 10, "micro_batch": 4}, "not a multiple of --micro-batch 4"),
    ({"batch": 10, "accum_steps": 3}, "not a multiple of --accum-steps 3"),
    ({"batch": 10, "micro_batch": 4, "accum_steps": 4}, "= 16, but --batch is 10"),
    ({"budget": 10 << 20, "micro_batch": 2}, "--budget chooses the micro-batch"),
    ({"width": 30, "heads": 4}, "not divisible"),
])
def test_the_config_refuses_what_cannot_run(lab06, fields, fragment):
    with pytest.raises(lab06.UsageError, match=fragment):
        lab06.Config(**fields)


def test_an_ambiguous_unit_is_refused_on_the_command_line():
    proc = run_cli(SCRIPT, *SMALL, "--budget", "64MB")
    assert_clean_usage_error(proc, "--budget", "ambiguous")


def test_snapshot_on_cpu_is_refused(lab06, capsys, tmp_path):
    assert_usage_error_in_process(lab06, [*SMALL, "--steps", "1", "--snapshot", str(tmp_path / "s.pickle")],
                                  capsys, "needs a CUDA device")


# ---------------------------------------------------------------- GPU
@pytest.mark.cuda
def test_cuda_budget_run_agrees_with_the_allocator(lab06, tmp_path):
    snap = tmp_path / "snap.pickle"
    run = lab06.run(lab06.Config(device="cuda", batch=16, steps=2, budget=2 << 30, width=512, layers=4, heads=8,
                                 seq_len=256, snapshot=snap))
    s = run.summary()
    assert s["within_budget"] and s["cuda"]["max_memory_allocated"] <= 1.05 * run.config.budget
    assert 0.95 <= s["cuda"]["ledger_over_allocator"] <= 1.05, s["cuda"]
    assert snap.is_file() and snap.stat().st_size > 0
    assert s["provenance"]["device_type"] == "cuda" and s["provenance"]["device_name"]


@pytest.mark.cuda
def test_cuda_accumulation_peak_is_flat(lab06):
    size = dict(device="cuda", vocab=256, seq_len=256, width=512, layers=4, heads=8, steps=2)
    peaks = [lab06.run(lab06.Config(**size, micro_batch=4, accum_steps=k)).ledger.peak()["total"] for k in (2, 4, 8)]
    assert peaks[0] == peaks[1] == peaks[2]
    large = [lab06.run(lab06.Config(**size, batch=b)).ledger.peak()["total"] for b in (8, 16, 32)]
    assert large[0] < large[1] < large[2]


# ---------------------------------------------------------------- at real size, on fake tensors
GIB = 2**30


@pytest.mark.parametrize("split", [{"micro_batch": 2, "accum_steps": 2}, {"batch": 4}])
def test_a_traced_accumulation_is_the_real_one_to_the_byte(lab06, monkeypatch, split):
    """The lab's own trainer on small-llama, on real tensors and with --fake: the same allocations and
    frees in order, the same peaks by phase and category, for 2 micro-batches of 2 and one batch of
    4. Exact bytes on both sides (block=None): the CPU run does not round."""
    size = dict(model="small-llama", adamw="foreach", seq_len=32, steps=2, device="cpu", **split)
    real = lab06.run(lab06.Config(**size))
    monkeypatch.setattr(fake, "tensors", functools.partial(fake.tensors, block=None))
    traced = lab06.run(lab06.Config(**size, fake=True))
    assert_same_timeline(real.ledger, traced.ledger)
    assert traced.losses == [] and len(real.losses) == 2 and traced.params == real.params


def test_at_real_size_accumulation_keeps_one_micro_batch_of_activations_and_a_full_gradient_buffer(lab06):
    """The page's claim, at Llama-3.2-1B and 4,096 tokens per sequence (one step, traced): 2
    micro-batches of 1 hold half the activations of one batch of 2, and under the second micro-batch
    a full fp32 gradient, 4 B per parameter (each tensor rounded to 512 B), rides along."""
    size = dict(model="llama-3.2-1b", fake=True, seq_len=4096, steps=1)
    acc = lab06.run(lab06.Config(**size, micro_batch=1, accum_steps=2))
    large = lab06.run(lab06.Config(**size, batch=2))
    h = labs.load(2, "scale_harness")
    tl = acc.ledger.timeline()
    second = max((s for s in tl.spans if s.name == "backward"), key=lambda s: s.start)  # micro-batch 2's
    at = max(range(second.start - 1, second.end), key=tl.device_total().__getitem__)
    tensors = len(list(acc.model.parameters()))
    assert 4 * acc.params <= tl.device["gradients"][at] < 4 * acc.params + 512 * tensors
    acts = {name: max(r.ledger.timeline().device["activations"]) for name, r in (("acc", acc), ("large", large))}
    assert 0.49 < acts["acc"] / acts["large"] <= 0.5 + 1e-3
    assert h.peak_phase(tl).endswith("backward")
