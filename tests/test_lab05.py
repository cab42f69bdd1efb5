"""Lab 05: naive, chunked and SDPA attention agree; their bytes follow the formulas; slopes; backends."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_clean_usage_error, assert_usage_error_in_process, load_lab, run_cli

from labkit import cli, fake, marks

SCRIPT = "lab-05-memory-efficient-attention/attention.py"


@pytest.fixture(scope="module")
def lab05():
    return load_lab(5)


@pytest.fixture(scope="module")
def measures():
    return load_lab(5, "attention_measures")


def sweep(lab05, **fields):
    return lab05.run(lab05.Config(device="cpu", **fields))


@pytest.fixture(scope="module")
def default_sweep(lab05):
    """The forward sweep the page shows: the defaults, s = 128 to 2048."""
    return sweep(lab05)


@pytest.fixture(scope="module")
def backward_sweeps(lab05):
    """The page's forward + backward sweeps: every implementation, and chunked with recompute."""
    lengths = (128, 256, 512, 1024)
    return (sweep(lab05, backward=True, seq_lens=lengths),
            sweep(lab05, backward=True, recompute=True, impl="chunked", seq_lens=lengths))


def in_band(value, band) -> bool:
    return band[0] <= value <= band[1]


def qkv(n=200, heads=2, d=32, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, n, d, generator=g).requires_grad_(requires_grad) for _ in range(3)]


# ---------------------------------------------------------------- the same attention
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
    assert not marks.watching()  # no ledger: the step's marks cost nothing
    lab05.train_step(lambda *t: lab05.naive_attention(*t, True), *base, go)
    for attend in (lambda *t: lab05.chunked_attention(*t, 64, True, recompute),
                   lambda *t: F.scaled_dot_product_attention(*t, is_causal=True)):
        other = [t.detach().clone().requires_grad_() for t in base]
        attend(*other).backward(go)
        for a, b in zip(base, other):
            torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=2e-5)


# ---------------------------------------------------------------- bytes against the formulas
def test_forward_peaks_equal_the_formulas_to_the_byte(lab05):
    result = sweep(lab05, seq_lens=(64, 200, 384), chunk=96, heads=3)
    for row in result.rows:
        assert row["peak_bytes"] == row["predicted_bytes"], row
        assert row["within_tolerance"], row
    naive = {r["seq_len"]: r for r in result.rows if r["impl"] == "naive"}
    assert naive[384]["peak_bytes"] > 2 * naive[384]["scores_bytes"]  # scores and probabilities at once
    assert naive[384]["scores_bytes"] == lab05.score_matrix_bytes(384, batch=1, heads=3, e=4) == 3 * 384 * 384 * 4


def test_the_default_sweep_the_page_shows(lab05, measures, default_sweep):
    result = default_sweep
    assert result.config.seq_lens == (128, 256, 512, 1024, 2048) and not result.config.causal
    assert all(r["peak_bytes"] == r["predicted_bytes"] for r in result.rows)  # on CPU, to the byte
    bands, s = measures.SLOPE_BANDS, result.slopes()
    assert in_band(s["naive"], bands["quadratic"]), s
    assert in_band(s["chunked"], bands["linear"]) and in_band(s["sdpa"], bands["linear"]), s
    assert result.backends_ran == ["FLASH_ATTENTION"]  # the CPU flash kernel, named by its aten op
    assert result.outside_tolerance == []
    biggest = {r["impl"]: r["peak_bytes"] for r in result.rows if r["seq_len"] == 2048}
    assert biggest["naive"] > 10 * biggest["chunked"] > 10 * biggest["sdpa"]


def test_pinned_math_backend_is_the_naive_memory(lab05):
    result = sweep(lab05, impl="sdpa", sdpa_backend="math", seq_lens=(128, 512))
    assert result.backends_ran == ["MATH"]
    for row in result.rows:
        bh_out = 2 * row["seq_len"] * 32 * 4
        assert row["peak_bytes"] == 2 * row["scores_bytes"] + bh_out == row["predicted_bytes"]
    flash = sweep(lab05, impl="sdpa", sdpa_backend="flash", seq_lens=(128,))
    assert flash.backends_ran == ["FLASH_ATTENTION"]


def test_backward_keeps_n_squared_unless_blocks_are_recomputed(lab05, measures, backward_sweeps):
    plain, recompute = backward_sweeps
    for result in (plain, recompute):
        assert result.outside_tolerance == []
        for row in result.rows:
            assert row["kept_bytes"] == row["predicted_bytes"], row  # the derived formula, to the byte
    kept = {(r["impl"], r["seq_len"]): r["kept_bytes"] for r in plain.rows}
    for n in (128, 256, 512, 1024):
        assert kept[("chunked", n)] == kept[("naive", n)]  # chunking alone keeps every block's probabilities
    linear = measures.SLOPE_BANDS["linear"]
    assert plain.slopes("kept_bytes")["naive"] > 1.8 and plain.slopes("kept_bytes")["chunked"] > 1.8
    assert in_band(plain.slopes("kept_bytes")["sdpa"], linear)
    assert in_band(recompute.slopes("kept_bytes")["chunked"], linear)
    assert in_band(plain.slopes()["sdpa"], linear) and in_band(recompute.slopes()["chunked"], linear)


def test_each_measurement_keeps_its_timeline(lab05, backward_sweeps):
    plain, _ = backward_sweeps
    tl = plain.timelines["naive", 1024]
    assert [s.name for s in tl.spans] == ["forward", "backward"]
    row = next(r for r in plain.rows if (r["impl"], r["seq_len"]) == ("naive", 1024))
    assert tl.peak()["total"] == row["peak_bytes"]


def test_causal_masking_stays_within_tolerance(lab05):
    result = sweep(lab05, causal=True, seq_lens=(1024,))
    assert result.outside_tolerance == [] and all(r["predicted_bytes"] is None for r in result.rows)


def test_the_sdpa_kernel_scratch_is_per_thread_and_far_below_n_squared(lab05, measures):
    q, k, v = lab05.make_qkv(2048, lab05.Config(device="cpu"), "cpu")
    before = torch.get_num_threads()
    by_threads = {t: measures.kernel_scratch_bytes(q, k, v, threads=t) for t in (1, 2, 4)}
    assert by_threads[1] < by_threads[2] < by_threads[4], by_threads  # the page: it grows with threads
    assert by_threads[1] < lab05.score_matrix_bytes(2048, batch=1, heads=2, e=4) / 10  # not an s x s buffer
    assert torch.get_num_threads() == before  # the thread count is restored


# ---------------------------------------------------------------- grouped-query attention, and at real size
@pytest.mark.parametrize("fields", [{}, {"backward": True}, {"backward": True, "recompute": True, "impl": "chunked"}],
                         ids=["forward", "backward", "recompute"])
def test_grouped_query_attention_bytes_equal_the_formulas(lab05, fields):
    """Two KV heads for four query heads: naive and chunked repeat k and v to every query head (two
    copies of the output's size), SDPA takes them as they are (enable_gqa); outputs within tolerance."""
    result = sweep(lab05, seq_lens=(64, 200), chunk=96, heads=4, kv_heads=2, **fields)
    assert result.outside_tolerance == [] and all("within_tolerance" in r for r in result.rows)
    for row in result.rows:
        assert row["kept_bytes" if result.config.backward else "peak_bytes"] == row["predicted_bytes"], row


@pytest.mark.parametrize("fields", [{"heads": 4, "kv_heads": 2}, {"model": "small-llama", "dtype": "bfloat16"}],
                         ids=["gqa", "small-llama"])
def test_a_trace_holds_the_bytes_of_the_real_run(lab05, monkeypatch, fields):
    """The sweep on fake tensors against the same sweep on real tensors, forward and backward with
    every implementation: the same live bytes at every event, category by category, and the same
    backend. The trace counts exact bytes here (``fake.tensors(block=None)``, as a CPU ledger does):
    ``--fake`` rounds them to the CUDA allocator's 512-byte blocks, which a CPU run does not."""
    size = dict(seq_lens=(64, 200), chunk=96, backward=True, **fields)
    real = sweep(lab05, **size)
    monkeypatch.setattr(lab05.Config, "tensors", lambda self: fake.tensors(block=None))
    traced = sweep(lab05, fake=True, **size)
    assert len(real.rows) == len(traced.rows) == 6
    for r, t in zip(real.rows, traced.rows):
        assert "max_abs_error" in r and "max_abs_error" not in t  # a trace has no values
        for key in ("impl", "seq_len", "peak_bytes", "kept_bytes", "predicted_bytes", "backend"):
            assert t[key] == r[key], (r["impl"], r["seq_len"], key)
        real_tl, traced_tl = real.timelines[r["impl"], r["seq_len"]], traced.timelines[t["impl"], t["seq_len"]]
        assert traced_tl.device == real_tl.device and traced_tl.peaks_by_phase() == real_tl.peaks_by_phase()


def test_the_score_matrix_at_128k_tokens_is_traced_not_allocated(lab05, capsys):
    """The page's headline: Llama-3-8B's attention (32 query heads, 8 KV heads, head dim 128), bf16,
    131,072 tokens. One s x s score matrix is 32 x 131,072² x 2 B = 1 TiB; naive attention keeps it for
    backward (the probabilities), the fused kernel keeps the output and a float32 log-sum-exp per row."""
    config = lab05.Config(model="llama-3-8b", fake=True, dtype="bfloat16", seq_lens=(131072,), backward=True,
                          impl="naive")
    assert (config.heads, config.key_value_heads, config.head_dim) == (32, 8, 128)
    naive = lab05.run(config).rows[0]
    sdpa = lab05.run(replace(config, impl="sdpa")).rows[0]
    assert naive["scores_bytes"] == 2**40 and naive["kept_bytes"] == naive["predicted_bytes"] > 2**40
    out = 32 * 131072 * 128 * 2
    assert sdpa["kept_bytes"] == sdpa["predicted_bytes"] == out + 32 * 131072 * 4 and sdpa["backend"] == "FLASH_ATTENTION"
    assert naive["peak_bytes"] > 500 * sdpa["peak_bytes"]  # 3 TiB against 3.5 GiB
    lab05.report(lab05.run(replace(config, backward=False, impl="all", seq_lens=(8192,))))
    report = capsys.readouterr().out
    assert "llama-3-8b's attention" in report and "(8 key/value heads)" in report and "traced on fake tensors" in report


def test_grouped_query_shapes_are_checked(lab05):
    with pytest.raises(lab05.UsageError, match="--heads 4 is not a multiple of --kv-heads 3"):
        lab05.Config(heads=4, kv_heads=3)
    assert lab05.Config(heads=4).key_value_heads == 4


# ---------------------------------------------------------------- the command line
def test_json_summary_schema():
    proc = run_cli(SCRIPT, "--device", "cpu", "--json", "--seq-lens", "64,128")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)  # exactly one JSON object on stdout
    assert [(r["impl"], r["seq_len"]) for r in data["rows"]] == [
        (i, n) for n in (64, 128) for i in ("naive", "chunked", "sdpa")]
    for row in data["rows"]:
        assert {"peak_bytes", "kept_bytes", "predicted_bytes", "scores_bytes", "backend", "max_abs_error"} <= set(row)
    assert set(data["slopes"]) == {"naive", "chunked", "sdpa"} and data["config"]["seq_lens"] == [64, 128]
    assert data["provenance"]["source_hash"] and data["provenance"]["device_type"] == "cpu"
    assert data["sdpa_backend_ran"] == ["FLASH_ATTENTION"] and data["cuda"] is None
    assert proc.stderr == ""  # no progress bar under --json


def test_human_report(lab05, capsys):
    cli.main(lab05.Config, lab05.run, lab05.report, ["--device", "cpu", "--seq-lens", "128,64", "--causal"])
    out = capsys.readouterr().out
    assert "not causal" not in out and "causal" in out
    assert "SDPA ran the FLASH_ATTENTION backend" in out and "\nnaive    128" in out
    assert "Every output within tolerance of float64: |error| <= 1e-05 x max(1, max |value|)." in out


def test_the_config_sorts_the_lengths_and_refuses_recompute_without_backward(lab05):
    assert lab05.Config(seq_lens=(256, 128, 256)).seq_lens == (128, 256)
    with pytest.raises(lab05.UsageError, match="--recompute only changes the backward pass: add --backward"):
        lab05.Config(recompute=True)


@pytest.mark.parametrize(("argv", "fragment"), [
    (["--sdpa-backend", "efficient"], "CPU offers auto, math and flash"),
    (["--snapshot", "s.pickle"], "needs a CUDA device"),
])
def test_what_this_machine_cannot_run_is_refused_before_the_sweep(lab05, capsys, argv, fragment):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert_usage_error_in_process(lab05, ["--device", "cpu", "--seq-lens", "64", *argv], capsys, fragment)


def test_bad_input_from_the_command_line():
    proc = run_cli(SCRIPT, "--device", "cpu", "--seq-lens", "256,x")
    assert_clean_usage_error(proc, "--seq-lens", "expected a whole number")


@pytest.mark.cuda
def test_cuda_backends_slopes_and_allocator(lab05, tmp_path):
    snap = tmp_path / "snap.pickle"
    size = dict(device="cuda", heads=8, head_dim=64, dtype="float16", seq_lens=(1024, 2048, 4096, 8192), chunk=512)
    result = lab05.run(lab05.Config(**size, snapshot=snap))
    assert result.outside_tolerance == [] and snap.is_file()
    slopes = result.slopes()
    assert slopes["naive"] > 1.8 and slopes["chunked"] < 1.2 and slopes["sdpa"] < 1.2
    naive_big = next(r for r in result.rows if r["impl"] == "naive" and r["seq_len"] == 8192)
    assert 0.95 <= naive_big["peak_bytes"] / naive_big["cuda_peak_bytes"] <= 1.05
    for pin, name in (("efficient", "EFFICIENT_ATTENTION"), ("flash", "FLASH_ATTENTION"), ("math", "MATH")):
        pinned = lab05.run(lab05.Config(**size, impl="sdpa", sdpa_backend=pin))
        assert pinned.backends_ran == [name]
        if pin != "math":
            assert pinned.slopes()["sdpa"] < 1.2
