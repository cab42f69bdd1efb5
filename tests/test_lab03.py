"""Lab 03: fp16 + GradScaler and bf16 autocast against fp32: loss parity, bytes, the scaler, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_clean_usage_error, load_lab, run_cli

from labkit import run_lab

SCRIPT = "lab-03-mixed-precision/mixed_precision.py"
SMALL = ["--device", "cpu", "--width", "32", "--layers", "2", "--heads", "2", "--seq-len", "16",
         "--vocab", "64", "--batch-size", "4"]


@pytest.fixture(scope="module")
def lab03():
    return load_lab(SCRIPT)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: one thread is as fast, and immune to other processes on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def runs(lab03, *extra, base=SMALL):
    return lab03.run_recipes(lab03.parse_args([*base, "--json", *extra]))


@pytest.fixture(scope="module")
def three(lab03):
    """The three recipes at the lab's default (CPU) model size: the size the stated band is for."""
    rs = runs(lab03, "--steps", "8", base=["--device", "cpu"])
    return rs, lab03.summary(rs)


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
        assert not s["recipes"][name]["skipped_steps"]


def test_model_state_stays_fp32_in_every_recipe(three):
    """Autocast keeps fp32 master weights: parameters, gradients and AdamW state are byte-identical."""
    rs, s = three
    n_tensors = len([k for k in rs["fp32"].ledger.records if k.op == "adopted"])  # parameters and buffers
    assert n_tensors > 0
    P = s["params"]
    for name, run in rs.items():
        r = s["recipes"][name]
        assert r["parameter_dtypes"] == ["float32"], name
        opt = r["peak_bytes_by_phase"]["optimizer"]
        assert opt["parameters"] == 4 * P and opt["gradients"] == 4 * P, name
        assert run.ledger.at_end()["optimizer_state"] == rs["fp32"].ledger.at_end()["optimizer_state"]
    assert rs["fp32"].ledger.at_end()["optimizer_state"] >= 8 * P


def test_activations_about_halve_within_the_band(lab03, three):
    _, s = three
    lo, hi = lab03.ACTIVATION_BAND
    fp32 = s["recipes"]["fp32"]["activation_bytes"]
    for name in ("fp16", "bf16"):
        ratio = s["recipes"][name]["activation_bytes"] / fp32
        assert lo <= ratio <= hi, (name, ratio)
        assert s["vs_fp32"][name]["activation_ratio"] == pytest.approx(ratio)


def test_what_autocast_moves_to_16_bits_is_exactly_half(three):
    """fp32 bytes saved = fp32 left over + 2 x the 16-bit bytes, to the byte; weight copies are extra."""
    rs, s = three
    base = s["recipes"]["fp32"]["saved_for_backward"]
    assert "16-bit weight copies" not in base
    for name, dtype in (("fp16", "float16"), ("bf16", "bfloat16")):
        saved = s["recipes"][name]["saved_for_backward"]
        assert base["float32"] == saved["float32"] + 2 * saved[dtype], name
        assert saved["int64"] == base["int64"]
        assert saved["16-bit weight copies"] == s["recipes"][name]["weight_copy_bytes_derived"] > 0


def test_ledger_activations_are_exactly_what_autograd_saved(three):
    """Every activation byte in the ledger's step 0 is a saved tensor, plus the 4-byte loss we hold."""
    rs, s = three
    for name, run in rs.items():
        tl = run.ledger.timeline()
        end_of_forward = next(sp.end for sp in tl.spans if sp.name == "forward" and sp.step == 0) - 1
        assert tl.device["activations"][end_of_forward] == sum(s["recipes"][name]["saved_for_backward"].values()) + 4


def test_weight_casts_live_in_the_ledger_as_activations_made_by_to_copy(three):
    rs, s = three
    for name, run in rs.items():
        tl = run.ledger.timeline()
        fwd = next(sp for sp in tl.spans if sp.name == "forward" and sp.step == 0)
        casts = sum(r.nbytes for r in run.ledger.records if fwd.start <= r.born < fwd.end and r.op == "_to_copy"
                    and run.ledger.category_of(r) == "activations")
        if name == "fp32":
            assert casts == 0
        else:  # weight copies plus the 16-bit copies of layer-norm outputs that feed the matmuls
            assert casts > s["recipes"][name]["weight_copy_bytes_derived"]


def test_injected_inf_skips_the_step_and_backs_off_the_scale(lab03):
    plain = [s["loss"] for s in runs(lab03, "--recipe", "fp16", "--steps", "5")["fp16"].steps]
    hit = runs(lab03, "--recipe", "fp16", "--steps", "5", "--inject-inf-at", "2")["fp16"]
    losses = [s["loss"] for s in hit.steps]
    inj = hit.inject
    assert inj["step"] == 2 and inj["skipped"] and inj["params_unchanged"]
    assert inj["scale_before"] == 2.0**16 and inj["scale_after"] == inj["scale_before"] * 0.5
    assert inj["growth_tracker"] == 0
    assert [s["skipped"] for s in hit.steps] == [False, False, True, False, False]
    assert losses[:3] == plain[:3]  # identical until the lost update
    assert losses[3] != plain[3]
    assert hit.scaler.state_dict()["scale"] == 2.0**15 and hit.scaler.state_dict()["_growth_tracker"] == 2


def _one_fp16_step(lab03, scaler, inject_inf):
    from labkit import GPTConfig, Ledger, SyntheticTokens, TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=64, seq_len=16, width=32, layers=1, heads=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = SyntheticTokens(64, 16).batch(0, 4)
    rec = lab03.train_step(model, optimizer, scaler, "fp16", x, y, Ledger("cpu"), 0, inject_inf=inject_inf)
    return rec, all(map(torch.equal, before, model.parameters()))


def test_skipped_is_decided_by_the_step_not_by_the_scale(lab03):
    """A scaler whose scale cannot fall (here: update() does nothing) still skips the step on inf."""
    frozen = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    frozen.update = lambda *args, **kwargs: None
    rec, unchanged = _one_fp16_step(lab03, frozen, inject_inf=True)
    assert rec["scale_after"] == rec["scale_before"]  # the old rule (scale went down) would say: not skipped
    assert rec["skipped"] and unchanged
    rec, unchanged = _one_fp16_step(lab03, torch.amp.GradScaler("cpu", init_scale=2.0**10), inject_inf=False)
    assert not rec["skipped"] and not unchanged


def test_an_infinite_scale_skips_every_step_and_says_so(lab03):
    rec, unchanged = _one_fp16_step(lab03, torch.amp.GradScaler("cpu", init_scale=float("inf")), inject_inf=False)
    assert rec["scale_after"] == rec["scale_before"] == float("inf")  # inf x 0.5 is still inf
    assert rec["skipped"] and unchanged


def test_with_an_injected_inf_fp16_is_compared_up_to_the_injected_step(lab03):
    """The update of the injected step is lost on purpose: later fp16 losses are another run's."""
    rs = runs(lab03, "--steps", "6", "--inject-inf-at", "2")
    s = lab03.summary(rs)
    c, fp32, fp16 = s["vs_fp32"]["fp16"], s["recipes"]["fp32"]["losses"], s["recipes"]["fp16"]["losses"]
    assert c["compared_steps"] == 3  # steps 0, 1, 2: the loss of step 2 was computed before its update was lost
    assert c["max_rel_loss_diff"] == max(abs(a - b) / b for a, b in zip(fp16[:3], fp32[:3]))
    assert c["losses_within_tolerance"]
    assert s["vs_fp32"]["bf16"]["compared_steps"] == 6


def test_the_report_says_which_steps_were_compared(lab03, capsys):
    run_lab(lab03.main, [*SMALL, "--steps", "4", "--inject-inf-at", "1"])
    out = capsys.readouterr().out
    assert "within, steps 0-1 (the update of step 1 was lost on purpose)" in out


def test_scaler_state_machine_on_real_fp16_overflows(lab03):
    """A huge first scale overflows fp16 for real (no injection): skip and halve until it fits; double
    after every `growth_interval` clean steps."""
    run = runs(lab03, "--recipe", "fp16", "--steps", "14", "--init-scale", str(2.0**24), "--growth-interval", "3")["fp16"]
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


def test_json_summary_schema(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # tiny model; immune to a busy machine
    proc = run_cli(SCRIPT, *SMALL, "--json", "--steps", "3")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)  # exactly one JSON object on stdout
    assert set(data["recipes"]) == {"fp32", "fp16", "bf16"} and set(data["vs_fp32"]) == {"fp16", "bf16"}
    for r in data["recipes"].values():
        assert len(r["losses"]) == 3 and r["parameter_dtypes"] == ["float32"]
        assert r["step_time_s"] is not None and r["activation_bytes"] > 0
    assert data["timing"].startswith("CPU timing") and "target" in data["gpu_target"]
    assert data["tolerances"]["loss_rtol"] == 0.02
    assert data["provenance"]["source_hash"] and data["provenance"]["device_type"] == "cpu"
    assert proc.stderr == ""  # no progress bar under --json


def test_human_report_prints_the_scaler_and_the_skipped_step(lab03, capsys):
    run_lab(lab03.main, [*SMALL, "--recipe", "fp16", "--steps", "3", "--inject-inf-at", "1"])
    out = capsys.readouterr().out
    assert "fp16 on CPU runs for real" in out
    assert "injected inf at step 1: scale 65536 -> 32768; step skipped: yes; parameters unchanged: yes" in out
    assert "scaler._scale" in out and "GradScaler.state_dict()" in out
    assert "| fp16 | float32 |" in out


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--steps", "0"], "--steps"),
        (["--recipe", "fp8"], "--recipe"),
        (["--device", "tpu"], "--device"),
        (["--inject-inf-at", "-1"], "--inject-inf-at"),
        (["--steps", "4", "--inject-inf-at", "4"], "past the last step"),
        (["--recipe", "bf16", "--inject-inf-at", "1"], "needs the fp16 recipe"),
        (["--init-scale", "0"], "--init-scale"),
        (["--growth-interval", "0"], "--growth-interval"),
        (["--width", "30", "--heads", "4"], "not divisible"),
        (["--ledger-steps", "x"], "--ledger-steps"),
        (["--ledger-steps", "0"], "--ledger-steps"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(lab03, capsys, args, fragment):
    with pytest.raises(SystemExit) as exc:
        run_lab(lab03.main, [*SMALL, *args], prog="mixed_precision.py")
    assert exc.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and fragment in err[0], err


def test_bad_recipe_through_the_command_line():
    assert_clean_usage_error(run_cli(SCRIPT, "--recipe", "int8"), "--recipe", "invalid choice")


def test_snapshot_on_cpu_is_refused(lab03, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        run_lab(lab03.main, [*SMALL, "--steps", "1", "--snapshot", str(tmp_path / "s.pickle")], prog="x")
    assert exc.value.code == 2
    assert "needs a CUDA device" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_gpu_is_one_line(lab03, capsys):
    with pytest.raises(SystemExit) as exc:
        run_lab(lab03.main, ["--device", "cuda", "--steps", "1"], prog="x")
    assert exc.value.code == 2
    assert "no CUDA GPU" in capsys.readouterr().err


GPU_SIZE = ["--device", "cuda", "--width", "1024", "--layers", "8", "--heads", "16", "--seq-len", "512",
            "--batch-size", "16"]


@pytest.mark.cuda
def test_cuda_recipes_agree_and_fp16_skips_on_inf(lab03, tmp_path):
    snap = tmp_path / "snap.pickle"
    rs = runs(lab03, "--steps", "12", "--inject-inf-at", "11", "--snapshot", str(snap), base=GPU_SIZE)
    s = lab03.summary(rs)
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
    rs = runs(lab03, "--recipe", "fp32", "--steps", "12", base=GPU_SIZE)
    rs |= runs(lab03, "--recipe", "bf16", "--steps", "12", base=GPU_SIZE)
    speedup = rs["fp32"].step_times_s and lab03.summary(rs)["vs_fp32"]["bf16"]["speedup_vs_fp32"]
    assert speedup >= 1.8, speedup
