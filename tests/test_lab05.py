"""Lab 05: naive, chunked and SDPA attention agree; their bytes follow the formulas; slopes; bad input."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_clean_usage_error, load_lab, run_cli

from labkit import run_lab

SCRIPT = "lab-05-memory-efficient-attention/attention.py"
SWEEP = [128, 256, 512, 1024, 2048]  # the default sweep, the one the page shows
SLOPE_BAND = {"quadratic": (1.85, 2.05), "linear": (0.9, 1.1)}  # the bands the notebook asserts too


@pytest.fixture(scope="module")
def lab05():
    return load_lab(SCRIPT)


def args_for(lab05, *extra):
    return lab05.parse_args(["--device", "cpu", "--json", *extra])


def qkv(n=200, heads=2, d=32, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, n, d, generator=g).requires_grad_(requires_grad) for _ in range(3)]


@pytest.mark.parametrize("causal", [False, True])
def test_chunked_and_sdpa_give_the_naive_output(lab05, causal):
    q, k, v = qkv()
    naive = lab05.naive_attention(q, k, v, causal)
    for chunk in (7, 64, 77, 200, 512):  # blocks that do and do not divide N, and one block
        torch.testing.assert_close(lab05.chunked_attention(q, k, v, chunk, causal), naive, rtol=0, atol=1e-6)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(sdpa, naive, rtol=0, atol=1e-5)


def test_one_block_is_the_naive_computation_exactly(lab05):
    q, k, v = qkv(n=96)
    assert torch.equal(lab05.chunked_attention(q, k, v, chunk=96), lab05.naive_attention(q, k, v))


def test_causal_rows_do_not_see_future_keys(lab05):
    q, k, v = qkv(n=64)
    k2, v2 = k.clone(), v.clone()
    k2[..., 40:, :] += 5.0
    v2[..., 40:, :] -= 3.0
    for attend in (lambda *t: lab05.naive_attention(*t, True), lambda *t: lab05.chunked_attention(*t, 16, True)):
        a, b = attend(q, k, v), attend(q, k2, v2)
        assert torch.equal(a[..., :40, :], b[..., :40, :])  # rows before 40 never look at keys 40+
        assert not torch.allclose(a[..., 40:, :], b[..., 40:, :])


@pytest.mark.parametrize("recompute", [False, True])
def test_gradients_match_naive(lab05, recompute):
    base = qkv(n=150, requires_grad=True)
    go = torch.randn(1, 2, 150, 32, generator=torch.Generator().manual_seed(1))
    lab05.naive_attention(*base, True).backward(go)
    for attend in (lambda *t: lab05.chunked_attention(*t, 64, True, recompute),
                   lambda *t: F.scaled_dot_product_attention(*t, is_causal=True)):
        other = [t.detach().clone().requires_grad_() for t in base]
        attend(*other).backward(go)
        for a, b in zip(base, other):
            torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=2e-5)


def test_forward_peaks_equal_the_formulas_to_the_byte(lab05):
    result = lab05.sweep(args_for(lab05, "--seq-lens", "64,200,384", "--chunk", "96", "--heads", "3"))
    for row in result["rows"]:
        assert row["peak_bytes"] == row["predicted_bytes"], row
        assert row["within_tolerance"], row
    naive = {r["seq_len"]: r for r in result["rows"] if r["impl"] == "naive"}
    assert naive[384]["peak_bytes"] > 2 * naive[384]["scores_bytes"]  # scores and probabilities at once


def test_default_sweep_slopes_and_backend(lab05):
    result = lab05.sweep(args_for(lab05))
    assert result["config"]["seq_lens"] == SWEEP and not result["config"]["causal"]
    s = result["slopes"]
    assert SLOPE_BAND["quadratic"][0] <= s["naive"] <= SLOPE_BAND["quadratic"][1], s
    for impl in ("chunked", "sdpa"):
        assert SLOPE_BAND["linear"][0] <= s[impl] <= SLOPE_BAND["linear"][1], s
    assert result["sdpa_backend_ran"] == ["FLASH_ATTENTION"]  # the CPU flash kernel, named by its aten op
    assert result["outside_tolerance"] == []
    biggest = {r["impl"]: r["peak_bytes"] for r in result["rows"] if r["seq_len"] == 2048}
    assert biggest["naive"] > 10 * biggest["chunked"] > 10 * biggest["sdpa"]


def test_pinned_math_backend_is_the_naive_memory(lab05):
    result = lab05.sweep(args_for(lab05, "--impl", "sdpa", "--sdpa-backend", "math", "--seq-lens", "128,512"))
    assert result["sdpa_backend_ran"] == ["MATH"]
    for row in result["rows"]:
        bh_out = 2 * row["seq_len"] * 32 * 4
        assert row["peak_bytes"] == 2 * row["scores_bytes"] + bh_out == row["predicted_bytes"]
    flash = lab05.sweep(args_for(lab05, "--impl", "sdpa", "--sdpa-backend", "flash", "--seq-lens", "128"))
    assert flash["sdpa_backend_ran"] == ["FLASH_ATTENTION"]


def test_backward_keeps_n_squared_unless_blocks_are_recomputed(lab05):
    small = ["--seq-lens", "256,512,1024", "--heads", "1", "--head-dim", "16"]
    plain = lab05.sweep(args_for(lab05, "--backward", *small))
    recompute = lab05.sweep(args_for(lab05, "--backward", "--recompute", "--impl", "chunked", *small))
    for result in (plain, recompute):
        for row in result["rows"]:
            assert row["kept_bytes"] == row["predicted_bytes"], row
            assert row["within_tolerance"], row
    kept = {(r["impl"], r["seq_len"]): r["kept_bytes"] for r in plain["rows"]}
    for n in (256, 512, 1024):
        assert kept[("chunked", n)] == kept[("naive", n)]  # chunking alone keeps every block's probabilities
    assert plain["kept_slopes"]["naive"] > 1.8 and plain["kept_slopes"]["chunked"] > 1.8
    assert 0.95 <= plain["kept_slopes"]["sdpa"] <= 1.05
    assert 0.95 <= recompute["kept_slopes"]["chunked"] <= 1.05
    assert SLOPE_BAND["linear"][0] <= recompute["slopes"]["chunked"] <= SLOPE_BAND["linear"][1]


def test_json_summary_schema():
    proc = run_cli(SCRIPT, "--device", "cpu", "--json", "--seq-lens", "64,128")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)  # exactly one JSON object on stdout
    assert [(r["impl"], r["seq_len"]) for r in data["rows"]] == [
        (i, n) for n in (64, 128) for i in ("naive", "chunked", "sdpa")]
    for row in data["rows"]:
        assert {"peak_bytes", "kept_bytes", "predicted_bytes", "scores_bytes", "backend", "max_abs_error"} <= set(row)
    assert set(data["slopes"]) == {"naive", "chunked", "sdpa"}
    assert data["provenance"]["source_hash"] and data["provenance"]["device_type"] == "cpu"
    assert data["sdpa_backend_ran"] == ["FLASH_ATTENTION"] and data["cuda"] is None
    assert proc.stderr == ""  # no progress bar under --json


def test_human_report(lab05, capsys):
    lab05.main(["--device", "cpu", "--seq-lens", "64,128", "--causal"])
    out = capsys.readouterr().out
    assert "not causal" not in out and "causal" in out
    assert "SDPA ran the FLASH_ATTENTION backend" in out and "| naive | 128 |" in out
    assert "Every output within tolerance of float64: |error| <= 1e-05 x max(1, max |value|)." in out


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--chunk", "0"], "--chunk"),
        (["--chunk", "-8"], "--chunk"),
        (["--seq-lens", ""], "--seq-lens"),
        (["--seq-lens", ",,"], "--seq-lens"),
        (["--seq-lens", "128,abc"], "--seq-lens"),
        (["--seq-lens", "128,0"], "--seq-lens"),
        (["--seq-lens", "1.5"], "--seq-lens"),
        (["--impl", "flash"], "--impl"),
        (["--dtype", "int8"], "--dtype"),
        (["--heads", "0"], "--heads"),
        (["--recompute"], "add --backward"),
        (["--sdpa-backend", "efficient"], "CPU offers auto, math and flash"),
        (["--snapshot", "s.pickle"], "needs a CUDA device"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(lab05, capsys, args, fragment):
    with pytest.raises(SystemExit) as exc:
        run_lab(lab05.main, ["--device", "cpu", "--seq-lens", "64", *args], prog="attention.py")
    assert exc.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and fragment in err[0], err


def test_bad_input_from_the_command_line():
    proc = run_cli(SCRIPT, "--device", "cpu", "--seq-lens", "256,x")
    assert_clean_usage_error(proc, "--seq-lens", "expected whole numbers")


@pytest.mark.cuda
def test_cuda_backends_slopes_and_allocator(lab05, tmp_path):
    snap = tmp_path / "snap.pickle"
    base = ["--device", "cuda", "--json", "--heads", "8", "--head-dim", "64", "--dtype", "float16",
            "--seq-lens", "1024,2048,4096,8192", "--chunk", "512"]
    result = lab05.sweep(lab05.parse_args([*base, "--snapshot", str(snap)]))
    assert result["outside_tolerance"] == [] and snap.is_file()
    assert result["slopes"]["naive"] > 1.8
    assert result["slopes"]["chunked"] < 1.2 and result["slopes"]["sdpa"] < 1.2
    naive_big = next(r for r in result["rows"] if r["impl"] == "naive" and r["seq_len"] == 8192)
    assert 0.95 <= naive_big["peak_bytes"] / naive_big["cuda_peak_bytes"] <= 1.05
    for pin, name in (("efficient", "EFFICIENT_ATTENTION"), ("flash", "FLASH_ATTENTION"), ("math", "MATH")):
        pinned = lab05.sweep(lab05.parse_args([*base, "--impl", "sdpa", "--sdpa-backend", pin]))
        assert pinned["sdpa_backend_ran"] == [name]
        if pin != "math":
            assert pinned["slopes"]["sdpa"] < 1.2
