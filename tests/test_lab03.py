"""Lab 03: fp16 + GradScaler and bf16 autocast against fp32: loss parity, bytes, the scaler, bad input."""

from __future__ import annotations

import functools
import json
import re

import pytest
import torch
from conftest import assert_clean_usage_error, assert_usage_error_in_process, load_lab, run_cli
from test_labkit_fake import assert_same_timeline

from labkit import cli, fake, marks

SCRIPT = "lab-03-mixed-precision/mixed_precision.py"
SIZE = {"device": "cpu", "width": 32, "layers": 2, "heads": 2, "seq_len": 16, "vocab": 64, "batch_size": 4}
SMALL = ["--device", "cpu", "--width", "32", "--layers", "2", "--heads", "2", "--seq-len", "16",
         "--vocab", "64", "--batch-size", "4"]  # the same, as a user types it


@pytest.fixture(scope="module")
def lab03():
    return load_lab(3)


@pytest.fixture(scope="module")
def harness():
    """The lab's tables, formulas and report (``precision_report.py``, next to the starter)."""
    return load_lab(3, "precision_report")


def train(lab03, **fields):
    return lab03.run(lab03.Config(**{**SIZE, **fields}))


@pytest.fixture(scope="module")
def three(lab03):
    """The three recipes at the lab's default (CPU) model size: the size the stated band is for."""
    result = lab03.run(lab03.Config(device="cpu", steps=8))
    return result, result.summary()


def test_loss_curves_agree_within_the_stated_tolerance(lab03, three):
    _, s = three
    fp32 = s["recipes"]["fp32"]["losses"]
    assert fp32[-1] < fp32[0] - 0.5, "the toy GPT must actually learn, or agreement means nothing"
    for name in ("fp16", "bf16"):
        losses = s["recipes"][name]["losses"]
        assert len(losses) == len(fp32) == 8
        assert all(abs(a - b) <= lab03.LOSS_RTOL * b for a, b in zip(losses, fp32)), name
        assert losses != fp32, f"{name} computed in 16 bits cannot match fp32 bit for bit"
        assert s["vs_fp32"][name]["losses_within_tolerance"]
        assert s["vs_fp32"][name]["max_rel_loss_diff"] == max(abs(a - b) / b for a, b in zip(losses, fp32))
        assert not s["recipes"][name]["skipped_steps"]


def test_model_state_stays_fp32_in_every_recipe(three):
    """Autocast keeps fp32 master weights: parameters, gradients and AdamW state are byte-identical."""
    result, s = three
    P = s["params"]
    states = set()
    for name, run in result.runs.items():
        r = s["recipes"][name]
        assert r["parameter_dtypes"] == ["float32"], name
        opt = r["peak_bytes_by_phase"]["optimizer"]
        assert opt["parameters"] == 4 * P and opt["gradients"] == 4 * P, name
        states |= {opt["optimizer_state"], run.ledger.timeline().at_end()["optimizer_state"]}
    assert len(states) == 1 and states.pop() >= 8 * P


def test_activations_about_halve_within_the_band(lab03, three):
    _, s = three
    lo, hi = lab03.ACTIVATION_BAND
    fp32 = s["recipes"]["fp32"]["activation_bytes"]
    for name in ("fp16", "bf16"):
        ratio = s["recipes"][name]["activation_bytes"] / fp32
        assert lo <= ratio <= hi, (name, ratio)
        assert s["vs_fp32"][name]["activation_ratio"] == pytest.approx(ratio)
        assert s["vs_fp32"][name]["in_band"]


def test_every_identity_of_the_checks_table_holds_to_the_byte(harness, three):
    """What autocast moved to 16 bits is exactly half; the weight copies are 2 B per Linear weight
    element; every activation byte in the ledger is a saved tensor, plus the 4-byte loss."""
    result, s = three
    rows = harness.checks(result).rows
    assert len(rows) == 1 + 2 * 2 + 3  # parameters; copies and halving for fp16 and bf16; the ledger, per recipe
    for quantity, formula, derived, measured in rows:
        assert derived == measured, (quantity, formula)
    base = s["recipes"]["fp32"]["saved_for_backward"]
    assert "16-bit weight copies" not in base
    for name in ("fp16", "bf16"):
        saved = s["recipes"][name]["saved_for_backward"]
        assert saved["int64"] == base["int64"]  # the token ids autocast leaves alone
        assert saved["16-bit weight copies"] == s["recipes"][name]["weight_copy_bytes_derived"] > 0


def test_weight_casts_live_in_the_ledger_as_activations_made_by_to_copy(harness, three):
    result, s = three
    for name, run in result.runs.items():
        by_op = harness.activations_by_op(run.ledger)
        assert sum(by_op.values()) == run.forward_activations()  # every activation of step 0, by op
        if name == "fp32":
            assert "_to_copy" not in by_op
        else:  # weight copies plus the 16-bit copies of layer-norm outputs that feed the matmuls
            assert by_op["_to_copy"] > s["recipes"][name]["weight_copy_bytes_derived"]
    ops = harness.ops_table(result)
    assert [row[0] for row in ops.rows][-1] == "_to_copy"  # sorted by fp32 bytes: none in fp32


def test_injected_inf_skips_the_step_and_backs_off_the_scale(lab03, harness):
    plain = train(lab03, recipe="fp16", steps=5).runs["fp16"]
    hit = train(lab03, recipe="fp16", steps=5, inject_inf_at=2).runs["fp16"]
    inj = hit.inject
    assert inj["step"] == 2 and inj["skipped"] and inj["params_unchanged"]
    assert inj["scale_before"] == 2.0**16 and inj["scale_after"] == inj["scale_before"] * 0.5
    assert inj["growth_tracker"] == 0
    assert [s["skipped"] for s in hit.steps] == [False, False, True, False, False]
    assert hit.losses[:3] == plain.losses[:3]  # identical until the lost update
    assert all(a > b for a, b in zip(hit.losses[3:], plain.losses[3:]))  # then the curve lags
    assert hit.scaler.state_dict()["scale"] == 2.0**15 and hit.scaler.state_dict()["_growth_tracker"] == 2
    table = harness.inject_table(hit, without=plain.losses)
    assert [row[1] for row in table.rows] == [False, False, True, False, False]  # the "inf injected" column
    assert [row[-1] for row in table.rows] == plain.losses


def _one_fp16_step(lab03, scaler, inject_inf):
    from labkit.models import GPTConfig, SyntheticTokens, TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=64, seq_len=16, width=32, layers=1, heads=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = SyntheticTokens(64, 16).batch(0, 4)
    assert not marks.watching()  # no ledger: the step's marks cost nothing
    record = lab03.train_step(model, optimizer, scaler, "fp16", x, y, 0, inject_inf=inject_inf)
    return record, all(map(torch.equal, before, model.parameters()))


def test_skipped_is_decided_by_the_step_not_by_the_scale(lab03):
    """A scaler whose scale cannot fall (here: update() does nothing) still skips the step on inf."""
    frozen = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    frozen.update = lambda *args, **kwargs: None
    record, unchanged = _one_fp16_step(lab03, frozen, inject_inf=True)
    assert record["scale_after"] == record["scale_before"]  # the old rule (scale went down) would say: not skipped
    assert record["skipped"] and unchanged
    record, unchanged = _one_fp16_step(lab03, torch.amp.GradScaler("cpu", init_scale=2.0**10), inject_inf=False)
    assert not record["skipped"] and not unchanged


def test_an_infinite_scale_skips_every_step_and_says_so(lab03):
    """The Config refuses an infinite --init-scale; a scaler built by hand with one skips every step."""
    record, unchanged = _one_fp16_step(lab03, torch.amp.GradScaler("cpu", init_scale=float("inf")), inject_inf=False)
    assert record["scale_after"] == record["scale_before"] == float("inf")  # inf x 0.5 is still inf
    assert record["skipped"] and unchanged


def test_with_an_injected_inf_fp16_is_compared_up_to_the_injected_step(lab03):
    """The update of the injected step is lost on purpose: later fp16 losses are another run's."""
    s = train(lab03, steps=6, inject_inf_at=2).summary()
    c, fp32, fp16 = s["vs_fp32"]["fp16"], s["recipes"]["fp32"]["losses"], s["recipes"]["fp16"]["losses"]
    assert c["compared_steps"] == 3  # steps 0, 1, 2: the loss of step 2 was computed before its update was lost
    assert c["max_rel_loss_diff"] == max(abs(a - b) / b for a, b in zip(fp16[:3], fp32[:3]))
    assert c["losses_within_tolerance"]
    assert s["vs_fp32"]["bf16"]["compared_steps"] == 6


def test_scaler_state_machine_on_real_fp16_overflows(lab03):
    """A huge first scale overflows fp16 for real (no injection): skip and halve until it fits; double
    after every `growth_interval` clean steps."""
    run = train(lab03, recipe="fp16", steps=14, init_scale=2.0**24, growth_interval=3).runs["fp16"]
    assert run.steps[0]["skipped"], "2**24 should overflow this model's fp16 backward"
    tracker = 0
    for s in run.steps:
        if s["skipped"]:
            assert s["scale_after"] == s["scale_before"] * 0.5 and s["growth_tracker"] == 0
        elif tracker + 1 == 3:
            assert s["scale_after"] == s["scale_before"] * 2.0 and s["growth_tracker"] == 0
        else:
            assert s["scale_after"] == s["scale_before"] and s["growth_tracker"] == tracker + 1
        tracker = s["growth_tracker"]
    assert not all(s["skipped"] for s in run.steps), "the scaler must find a scale that fits"


def test_scaler_state_is_visible_and_only_fp16_has_one(three):
    _, s = three
    fp16 = s["recipes"]["fp16"]
    assert set(fp16["scaler_state"]) >= {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
    assert fp16["scaler_state"]["backoff_factor"] == 0.5
    tensors = fp16["scaler_tensors"]  # private attributes: this torch (2.11 to 2.13) has both, on CPU too
    assert set(tensors) == {"_scale", "_growth_tracker"}, tensors
    assert tensors["_scale"]["dtype"] == "float32" and tensors["_growth_tracker"]["dtype"] == "int32"
    assert tensors["_scale"]["device"] == tensors["_growth_tracker"]["device"] == "cpu"
    assert tensors["_scale"]["value"] == fp16["scaler_state"]["scale"]
    assert tensors["_growth_tracker"]["value"] == fp16["scaler_state"]["_growth_tracker"] == 8  # 8 clean steps
    for name in ("fp32", "bf16"):
        assert s["recipes"][name]["scaler_state"] is None and not s["recipes"][name]["grad_scaler"]


def test_json_summary_schema():
    """One JSON object; the keys bench/training_bench.py reads among them."""
    proc = run_cli(SCRIPT, *SMALL, "--json", "--steps", "3")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)  # exactly one JSON object on stdout
    assert set(data["recipes"]) == {"fp32", "fp16", "bf16"} and set(data["vs_fp32"]) == {"fp16", "bf16"}
    assert data["config"]["width"] == 32
    for r in data["recipes"].values():
        assert len(r["losses"]) == 3 and r["parameter_dtypes"] == ["float32"]
        assert r["step_time_s"] is not None and r["activation_bytes"] > 0 and r["peak_bytes"]["total"] > 0
    for c in data["vs_fp32"].values():
        assert c["speedup_vs_fp32"] > 0 and 0 < c["activation_ratio"] < 1
    assert data["timing"].startswith("CPU timing") and "target" in data["gpu_target"]
    assert data["tolerances"]["loss_rtol"] == 0.02
    assert data["provenance"]["source_hash"] and data["provenance"]["device_type"] == "cpu"
    assert proc.stderr == ""  # no progress bar under --json


def test_the_report_prints_the_scaler_the_skipped_step_and_the_compared_steps(lab03, capsys):
    cli.main(lab03.Config, lab03.run, lab03.report, [*SMALL, "--steps", "4", "--inject-inf-at", "1"], prog="lab")
    printed = capsys.readouterr().out
    out = " ".join(printed.split())  # lines fitted to the terminal: words, not line breaks
    assert "fp16 on CPU runs for real" in out
    assert "over steps 0-1, within the 2% tolerance (the update of step 1 was lost on purpose)" in out
    assert "bf16: activations" in out and "over steps 0-3, within" in out
    assert "injected inf at step 1: scale 65536 -> 32768; step skipped: yes; parameters unchanged: yes" in out
    assert "scaler._scale" in out and "state_dict()['scale']" in out
    # the recipes and saved-for-backward tables, turned to a column per recipe to fit 100 columns
    assert re.search(r"^recipe +fp32 +fp16 +bf16$", printed, re.M) and "16-bit weight copies" in out


@pytest.mark.parametrize(("fields", "fragment"), [
    ({"width": 30, "heads": 4}, "not divisible"),
    ({"recipe": "bf16", "inject_inf_at": 1}, "needs the fp16 recipe"),
    ({"steps": 4, "inject_inf_at": 4}, "past the last step (3)"),
    ({"init_scale": 1e300}, "--init-scale must be 3.40282e+38 or less, got 1e+300"),
    ({"init_scale": 1e-40}, "--init-scale 1e-40 does not fit float32"),
])
def test_the_config_refuses_what_cannot_run(lab03, fields, fragment):
    with pytest.raises(lab03.UsageError, match=re.escape(fragment)):
        lab03.Config(**{**SIZE, **fields})


def test_a_scale_beyond_float32_is_one_line_not_a_traceback():
    """It used to reach GradScaler and end in 'value cannot be converted to type float without overflow'."""
    proc = run_cli(SCRIPT, *SMALL, "--recipe", "fp16", "--steps", "1", "--init-scale", "1e300")
    assert_clean_usage_error(proc, "--init-scale must be 3.40282e+38 or less")


def test_the_ends_of_the_float32_range_train(lab03):
    for scale in (lab03.FP32.max, lab03.FP32.tiny):
        run = train(lab03, recipe="fp16", steps=2, init_scale=scale).runs["fp16"]
        assert run.steps[0]["scale_before"] == scale
        assert run.steps[0]["skipped"] is (scale > 1)  # the largest overflows and backs off; the smallest steps


def test_snapshot_on_cpu_is_refused(lab03, capsys, tmp_path):
    assert_usage_error_in_process(lab03, [*SMALL, "--steps", "1", "--snapshot", str(tmp_path / "s.pickle")], capsys,
                                  "needs a CUDA device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_gpu_is_one_line(lab03, capsys):
    assert_usage_error_in_process(lab03, ["--device", "cuda", "--steps", "1"], capsys, "no CUDA GPU")


GPU_SIZE = {"device": "cuda", "width": 1024, "layers": 8, "heads": 16, "seq_len": 512, "batch_size": 16}


@pytest.mark.cuda
def test_cuda_recipes_agree_and_fp16_skips_on_inf(lab03, tmp_path):
    snap = tmp_path / "snap.pickle"
    s = lab03.run(lab03.Config(**GPU_SIZE, steps=12, inject_inf_at=11, snapshot=snap)).summary()
    for name in ("fp16", "bf16"):
        rel = [abs(a - b) / b for a, b in zip(s["recipes"][name]["losses"][:11], s["recipes"]["fp32"]["losses"][:11])]
        assert max(rel) <= lab03.LOSS_RTOL, (name, max(rel))
        assert s["recipes"][name]["parameter_dtypes"] == ["float32"]
        assert s["vs_fp32"][name]["activation_ratio"] < 0.8
        saved = s["recipes"][name]["saved_for_backward"]
        assert saved["16-bit weight copies"] == s["recipes"][name]["weight_copy_bytes_derived"]
    for r in s["recipes"].values():
        assert 0.95 <= r["cuda"]["ledger_over_allocator"] <= 1.05
    inj = s["recipes"]["fp16"]["inject"]
    assert inj["skipped"] and inj["params_unchanged"] and inj["scale_after"] == inj["scale_before"] * 0.5
    assert snap.is_file() and snap.stat().st_size > 0
    assert s["provenance"]["device_type"] == "cuda"


@pytest.mark.cuda
def test_cuda_bf16_speed_target_on_an_h100_class_gpu(lab03):
    """The issue's target for the GPU run: a bf16 step at least 1.8x faster than fp32 (H100 class)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the 1.8x target is stated for an H100-class GPU (compute capability 9.0 or newer)")
    fp32 = lab03.run(lab03.Config(**GPU_SIZE, recipe="fp32", steps=12))
    bf16 = lab03.run(lab03.Config(**GPU_SIZE, recipe="bf16", steps=12))
    speedup = fp32.runs["fp32"].summary()["step_time_s"] / bf16.runs["bf16"].summary()["step_time_s"]
    assert speedup >= 1.8, speedup


# ---------------------------------------------------------------------- at real size, on fake tensors
GIB = 2**30


@pytest.mark.parametrize("recipe", ["fp32", "bf16", "pure-bf16"])
def test_a_traced_recipe_is_the_real_recipe_to_the_byte(lab03, monkeypatch, recipe):
    """The lab's own run of a recipe on small-llama, on real tensors and with --fake: the same
    allocations and frees in order, the same peaks, and the same saved-for-backward census (weight
    copies found through autograd on fake tensors too). Exact bytes on both sides (block=None): the
    CPU run does not round; labkit.fake's own test covers the 512-byte rounding."""
    size = dict(model="small-llama", recipe=recipe, adamw="foreach", seq_len=32, batch_size=2, steps=2, device="cpu")
    real = lab03.run(lab03.Config(**size)).runs[recipe]
    monkeypatch.setattr(fake, "tensors", functools.partial(fake.tensors, block=None))
    traced = lab03.run(lab03.Config(**size, fake=True)).runs[recipe]
    assert_same_timeline(real.ledger, traced.ledger)
    assert traced.saved == real.saved and traced.linear_weights == real.linear_weights
    assert traced.param_dtypes == real.param_dtypes == (["bfloat16"] if recipe == "pure-bf16" else ["float32"])
    assert traced.losses == [] and len(real.losses) == 2


def test_cpu_autocast_gives_every_op_of_the_traced_step_the_dtype_cuda_autocast_would(lab03):
    """The page says so of its bf16 trace: the CPU autocast the trace runs and CUDA's agree on every
    call of the lab's step on the zoo's Llama (labkit.fake.autocast_audit checks CUDA's op lists)."""
    with fake.autocast_audit() as differs:
        lab03.run(lab03.Config(model="small-llama", fake=True, recipe="bf16", seq_len=32, batch_size=2, steps=2))
    assert differs == {}


@pytest.fixture(scope="module")
def traced_8b(lab03):
    """Llama-3-8B, one sequence of 4,096 tokens, one step of each recipe, traced (about 4 s each here)."""
    return {recipe: lab03.run(lab03.Config(model="llama-3-8b", fake=True, seq_len=4096, batch_size=1,
                                           recipe=recipe, steps=1)).runs[recipe]
            for recipe in ("fp32", "bf16", "pure-bf16")}


def _at_backward(run, step=0):
    tl = run.ledger.timeline()
    return next(tl.row(s.start) for s in tl.spans if s.name == "backward" and s.step == step)


def test_at_8b_autocast_saves_a_bf16_copy_of_every_weight_and_keeps_fp32_log_probs(harness, traced_8b):
    """The page's claim: bf16 autocast over fp32 weights keeps almost as many activation bytes as fp32
    (within 5 %), because every Linear weight's bf16 copy (2 B each) is saved for backward; every
    recipe keeps the loss's float32 log-probabilities, 4 B x 4,096 tokens x 128,256."""
    fp32, bf16, pure = (traced_8b[r] for r in ("fp32", "bf16", "pure-bf16"))
    assert bf16.saved["16-bit weight copies"] == 2 * bf16.linear_weights > 13 * GIB
    assert "16-bit weight copies" not in fp32.saved and "16-bit weight copies" not in pure.saved
    acts = {r: _at_backward(run)["activations"] for r, run in traced_8b.items()}
    assert 0.95 * acts["fp32"] < acts["bf16"] < acts["fp32"]
    assert acts["pure-bf16"] < 0.6 * acts["fp32"]
    for run in traced_8b.values():
        assert harness.activations_by_op(run.ledger)["_log_softmax"] == 4 * 4096 * 128_256


def test_at_8b_only_pure_bf16_fits_and_it_halves_the_peak(traced_8b):
    peak = {r: run.ledger.timeline().peak()["total"] for r, run in traced_8b.items()}
    assert peak["bf16"] == peak["fp32"] > 80 * GIB  # the optimizer phase sets both: fp32 weights, AdamW, foreach
    assert peak["pure-bf16"] < 80 * GIB and peak["pure-bf16"] <= 0.51 * peak["fp32"]


def test_a_fake_run_injects_no_inf(lab03):
    with pytest.raises(lab03.UsageError, match="--inject-inf-at needs values"):
        lab03.Config(model="small-llama", fake=True, recipe="fp16", inject_inf_at=1)


def test_pure_bf16_keeps_no_fp32_copy_of_the_model(lab03):
    """Weights, gradients and AdamW's moments all bf16: 2 + 2 + 4 B per parameter (+ a step counter per tensor)."""
    summary = lab03.run(lab03.Config(**SIZE, recipe="pure-bf16", steps=2)).summary()
    s, P = summary["recipes"]["pure-bf16"], summary["params"]
    opt = s["peak_bytes_by_phase"]["optimizer"]
    assert s["parameter_dtypes"] == ["bfloat16"] and s["autocast_dtype"] is None and not s["grad_scaler"]
    assert opt["parameters"] == opt["gradients"] == 2 * P and 4 * P < opt["optimizer_state"] < 8 * P
