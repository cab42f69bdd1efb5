"""Lab 01: the memory formulas against known figures and against the ledger's bytes; CLI and bad input."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_clean_usage_error, load_lab, run_cli

from labkit import GPTConfig, Ledger, SyntheticTokens, TinyGPT, run_lab

SCRIPT = "lab-01-memory-accounting/memory_accounting.py"
SMALL = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "16", "--batch", "2", "--vocab", "64"]


@pytest.fixture(scope="module")
def lab01():
    return load_lab(SCRIPT)


@pytest.fixture(scope="module")
def toy(lab01):
    import sys

    return sys.modules["toy_gpt"]  # the starter puts its folder on sys.path and imports it


# ---------------------------------------------------------------- model state and ZeRO (derived)
def test_7b_mixed_precision_adamw_is_16_bytes_per_parameter(lab01):
    est = lab01.estimate_bytes(params=7_000_000_000, precision="mixed", optimizer="adamw")
    assert est == {"parameters": 14 * 10**9, "gradients": 14 * 10**9, "master_weights": 28 * 10**9,
                   "optimizer_state": 56 * 10**9}
    assert sum(est.values()) == 112 * 10**9


def test_zero3_across_8_ranks_is_14_gb_per_rank(lab01):
    est = lab01.estimate_bytes(params=7_000_000_000, precision="mixed", zero_stage=3, dp=8)
    assert sum(est.values()) == 14 * 10**9


@pytest.mark.parametrize(("precision", "optimizer", "per_param"), [
    ("fp32", "sgd", 8), ("fp32", "momentum", 12), ("fp32", "adamw", 16),
    ("mixed", "sgd", 8), ("mixed", "momentum", 12), ("mixed", "adamw", 16),
    ("bf16", "sgd", 4), ("bf16", "momentum", 6), ("bf16", "adamw", 8),
])
def test_bytes_per_parameter_by_recipe(lab01, precision, optimizer, per_param):
    assert sum(lab01.model_state_bytes(1000, precision, optimizer).values()) == per_param * 1000


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_zero_stage_shards_its_categories(lab01, stage):
    params, dp = 1001, 8  # not divisible: every rank holds ceil(P / N) elements of a sharded buffer
    full = lab01.model_state_bytes(params, "mixed", "adamw")
    per_rank = lab01.zero_model_state(params, "mixed", "adamw", stage, dp)
    shard = {"parameters": 2 * 126, "gradients": 2 * 126, "master_weights": 4 * 126, "optimizer_state": 8 * 126}
    first_stage = {"optimizer_state": 1, "master_weights": 1, "gradients": 2, "parameters": 3}
    for cat in full:
        assert per_rank[cat] == (shard[cat] if stage >= first_stage[cat] else full[cat]), cat


def test_zero_with_one_rank_changes_nothing(lab01):
    base = lab01.zero_model_state(12345, "fp32", "adamw", 0, 1)
    assert all(lab01.zero_model_state(12345, "fp32", "adamw", s, 1) == base for s in (1, 2, 3))


# ---------------------------------------------------------------- activations and KV cache (derived)
@pytest.mark.parametrize(("s", "b", "h", "a"), [(2048, 1, 4096, 32), (512, 4, 1024, 16), (64, 8, 128, 4)])
def test_paper_formula_is_sbh_times_34_plus_5as_over_h(lab01, s, b, h, a):
    f = lab01.activation_bytes_per_layer
    assert f(s, b, h, a) * h == s * b * h * (34 * h + 5 * a * s)  # s*b*h*(34 + 5as/h), kept in integers
    assert f(s, b, h, a, recompute="selective") == 34 * s * b * h  # attention scores recomputed
    assert f(s, b, h, a, recompute="full") == 2 * s * b * h  # only the layer input is kept
    assert f(s, b, h, a, mask=None) == 32 * s * b * h + 2 * a * s * s * b  # no dropout: no masks, one N x N


def test_kv_cache_of_a_7b_llama_shape(lab01, toy):
    shape = toy.Shape(layers=32, hidden=4096, heads=32, seq=4096, batch=1, vocab=32000)
    assert lab01.kv_cache_bytes(shape, act=2) == 2 * 2**30  # 2 x 32 x 4096 x 32 x 128 x 2 B = 2 GiB
    gqa = toy.Shape(layers=32, hidden=4096, heads=32, seq=4096, batch=1, vocab=32000, kv_heads=8)
    assert lab01.kv_cache_bytes(gqa, act=2) == 2**30 // 2


def test_param_count_and_tensor_count_match_tinygpt(toy):
    shape = toy.Shape(layers=3, hidden=48, heads=4, seq=20, batch=1, vocab=70)
    model = TinyGPT(GPTConfig(vocab=70, seq_len=20, width=48, layers=3, heads=4))
    params = list(model.parameters())
    assert toy.param_count(shape) == sum(p.numel() for p in params)
    assert toy.param_tensors(shape) == len(params)


# ---------------------------------------------------------------- formulas against the ledger (measured, CPU)
def measure(lab01, *extra):
    args = lab01.parse_args(["--device", "cpu", *SMALL, *extra])
    shape = lab01.Shape(**{n: getattr(args, n) for n in lab01.SHAPE_FLAGS})
    est = lab01.estimate_bytes(shape=shape, precision=args.precision, optimizer=args.optimizer,
                               dropout=args.dropout > 0)
    return lab01.measure(args, shape), est


@pytest.mark.parametrize("extra", [
    [], ["--dropout", "0"], ["--optimizer", "sgd"], ["--optimizer", "momentum", "--dropout", "0.2"],
    ["--precision", "bf16"], ["--precision", "bf16", "--dropout", "0", "--optimizer", "momentum"],
    ["--precision", "mixed"], ["--precision", "mixed", "--dropout", "0", "--optimizer", "sgd"],
])
def test_measured_bytes_equal_the_formulas_exactly_on_cpu(lab01, toy, extra):
    run, est = measure(lab01, *extra)
    m = run["measured"]
    for cat in ("parameters", "gradients", "master_weights", "optimizer_state"):
        assert m[cat] == est[cat], cat  # the ledger counts storage.nbytes(): no rounding on CPU
    assert m["optimizer_state_on_host"] == 0  # on CPU the step counters live on the compute device
    assert m["activations"] == run["tinygpt_activations"]["total"]  # every saved tensor accounted for
    # the paper's formula for the layers plus the listed differences is the same number
    assert est["activations"] + sum(n for _, n in run["gap_to_paper"]) == m["activations"]
    assert run["exact"] and run["cuda"] is None


def test_mixed_precision_measures_a_16_bit_working_copy_and_fp32_masters(lab01, toy):
    run, est = measure(lab01, "--precision", "mixed")
    m, shape = run["measured"], lab01.Shape(**{n: getattr(lab01.parse_args(SMALL), n) for n in lab01.SHAPE_FLAGS})
    P, T = toy.param_count(shape), toy.param_tensors(shape)
    assert (m["parameters"], m["gradients"], m["master_weights"]) == (2 * P, 2 * P, 4 * P)
    assert m["optimizer_state"] == 8 * P + 4 * T  # fp32 moments: AdamW updates the fp32 masters
    assert sum(m[c] for c in ("parameters", "gradients", "master_weights", "optimizer_state")) == 16 * P + 4 * T
    assert m["activations"] == run["tinygpt_activations"]["total"] == toy.tinygpt_activation_bytes(
        GPTConfig(vocab=64, seq_len=16, width=32, layers=2, heads=4, dropout=0.1), 2, 2)["total"]


def test_the_mixed_step_updates_the_master_and_copies_it_back(lab01):
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=64, seq_len=16, width=32, layers=1, heads=4)).to(torch.bfloat16)
    masters = [p.detach().float() for p in model.parameters()]
    before = [m.clone() for m in masters]
    x, y = SyntheticTokens(64, 16).batch(0, 2)
    lab01.train_step(model, torch.optim.AdamW(masters, lr=1e-2), x, y, Ledger("cpu"), masters)
    assert all(not torch.equal(a, b) for a, b in zip(before, masters))  # every master moved
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(model.parameters(), masters))
    assert all(m.grad is None for m in masters)  # the fp32 gradient copies were temporaries


@pytest.mark.parametrize(("dropout", "recompute", "formula"), [
    ("0.1", "none", "L x [sbh(16e+2m) + as^2b(2e+m)], e=4, m=1"),
    ("0", "none", "L x [sbh x 16e + as^2b x e], e=4, no dropout"),
    ("0.1", "selective", "L x sbh(16e+2m), e=4, m=1"),
    ("0", "selective", "L x sbh x 16e, e=4, no dropout"),
    ("0", "full", "L x sbh x e, e=4"),
])
def test_the_printed_activation_formula_is_the_one_used(lab01, capsys, dropout, recompute, formula):
    run_lab(lab01.main, [*SMALL, "--dropout", dropout, "--recompute", recompute, "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["formulas"]["activations"] == formula
    L, s, b, h, a, e, m = 2, 16, 2, 32, 4, 4, 1  # SMALL, fp32, 1-byte masks: the formula by hand
    by_hand = {"0.1none": L * (s * b * h * (16 * e + 2 * m) + a * s * s * b * (2 * e + m)),
               "0none": L * (s * b * h * 16 * e + a * s * s * b * e), "0.1selective": L * s * b * h * (16 * e + 2 * m),
               "0selective": L * s * b * h * 16 * e, "0full": L * s * b * h * e}[dropout + recompute]
    assert data["bytes"]["activations"] == by_hand


def test_adamw_state_is_two_moments_and_a_step_counter_per_tensor(lab01):
    run, _ = measure(lab01)
    model_params = [r for r in run["ledger"].records if run["ledger"].category_of(r) == "parameters"]
    n = sum(r.nbytes for r in model_params) // 4
    assert run["measured"]["optimizer_state"] == 8 * n + 4 * len(model_params)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_saved_tensor_list_holds_for_explicit_attention(lab01, toy, dropout):
    """attention='math' materialises the N x N scores: the per-op list must still match to the byte."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=64, seq_len=16, width=32, layers=2, heads=4, dropout=dropout, attention="math")
    model = TinyGPT(cfg)
    x, y = SyntheticTokens(cfg.vocab, cfg.seq_len).batch(0, 3)
    ledger = Ledger("cpu").track_module(model)
    with ledger:
        lab01.train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), x, y, ledger)
    tl = ledger.timeline()
    end = next(s for s in tl.spans if s.name == "forward").end - 1
    assert tl.device["activations"][end] == toy.tinygpt_activation_bytes(cfg, 3)["total"]
    shape = toy.Shape(layers=2, hidden=32, heads=4, seq=16, batch=3, vocab=64)
    paper = lab01.estimate_bytes(shape=shape, dropout=dropout > 0)["activations"]
    assert paper + sum(n for _, n in toy.gap_to_paper(cfg, 3)) == tl.device["activations"][end]


def test_activations_grow_by_the_same_bytes_per_layer(lab01, toy):
    one, _ = measure(lab01, "--layers", "1")
    three, _ = measure(lab01, "--layers", "3")
    rows = toy.tinygpt_saved_tensors(GPTConfig(vocab=64, seq_len=16, width=32, layers=1, heads=4, dropout=0.1), 2)
    per_layer = sum(n for where, _, n in rows if where == "layer 0")
    assert three["measured"]["activations"] - one["measured"]["activations"] == 2 * per_layer


# ---------------------------------------------------------------- the command line
def test_json_is_one_object_with_integer_bytes_per_rank():
    proc = run_cli(SCRIPT, "--params", "7e9", "--precision", "mixed", "--zero-stage", "3", "--dp", "8", "--json")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    data = json.loads(proc.stdout)
    assert set(data["bytes"]) == {"parameters", "gradients", "master_weights", "optimizer_state"}
    assert all(isinstance(v, int) for v in data["bytes"].values())
    assert data["total_bytes"] == sum(data["bytes"].values()) == 14 * 10**9
    assert data["params"] == 7 * 10**9 and data["dp"] == 8 and data["zero_stage"] == 3
    assert data["formulas"]["optimizer_state"] == "8 B x P / 8"
    assert data["provenance"]["lab"] == "lab-01-memory-accounting"


def test_json_with_measure_and_a_shape(lab01, capsys):
    run_lab(lab01.main, ["--device", "cpu", *SMALL, "--measure", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert set(data["bytes"]) == {"parameters", "gradients", "master_weights", "optimizer_state", "activations"}
    assert data["measure"]["measured"]["parameters"] == data["bytes"]["parameters"]
    assert data["measure"]["tinygpt_activations"]["total"] == data["measure"]["measured"]["activations"]


def test_inference_counts_weights_and_kv_cache(lab01, capsys):
    run_lab(lab01.main, ["--layers", "32", "--hidden", "4096", "--heads", "32", "--kv-heads", "8", "--seq", "4096",
                         "--batch", "1", "--vocab", "32000", "--precision", "bf16", "--inference", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert set(data["bytes"]) == {"parameters", "kv_cache"} and data["bytes"]["kv_cache"] == 2**29


def test_human_report_shows_formulas_and_the_measured_comparison(lab01, capsys):
    run_lab(lab01.main, ["--device", "cpu", *SMALL, "--measure"])
    out = capsys.readouterr().out
    assert "| optimizer state | 8 B x P + 4 B x 29 tensors |" in out
    assert "| parameters | 120,320 | 120,320 | +0 | formula |" in out  # 4 B x 30,080 parameters
    assert "CPU dropout keeps noise in the data's dtype, the paper 1-byte masks" in out


@pytest.mark.parametrize(("args", "fragment"), [
    (["--params", "7e9", "--layers", "32"], "exclude each other"),
    (["--params", "7e9", "--seq", "2048", "--batch", "1"], "activations need the whole shape"),
    (["--params", "7e9", "--recompute", "full"], "--recompute needs a model shape"),
    (["--params", "7e9", "--measure"], "--measure needs a model shape"),
    (["--params", "7e9", "--inference"], "--inference needs a model shape"),
    (["--params", "seven"], "--params"),
    (["--params", "1.5"], "whole number"),
    (["--params", "inf"], "whole number"),
    (["--params", "0"], "whole number"),
    (["--hidden", "100", "--heads", "8"], "does not divide --hidden"),
    (["--kv-heads", "3"], "does not divide --heads"),
    (["--dp", "0"], "--dp"),
    (["--zero-stage", "4"], "--zero-stage"),
    (["--precision", "fp8"], "--precision"),
    (["--optimizer", "lion"], "--optimizer"),
    (["--measure", "--dp", "2"], "--measure runs one process"),
    (["--inference", "--zero-stage", "1"], "--inference"),
    (["--snapshot", "s.pickle"], "--snapshot records the --measure run"),
    (["--measure", "--device", "cpu", "--snapshot", "s.pickle"], "needs a CUDA device"),
    (["--measure", "--device", "cpu", "--layers", "48", "--hidden", "4096", "--heads", "32"], "toy shapes"),
])
def test_bad_input_is_one_line_and_exit_2(lab01, capsys, args, fragment):
    with pytest.raises(SystemExit) as exc:
        run_lab(lab01.main, args, prog="memory_accounting.py")
    assert exc.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and fragment in err[0], err


def test_params_with_a_shape_from_the_command_line():
    proc = run_cli(SCRIPT, "--params", "7e9", "--layers", "32", "--hidden", "4096")
    assert_clean_usage_error(proc, "--params and a model shape (--layers --hidden) exclude each other")


# ---------------------------------------------------------------- GPU only
@pytest.mark.cuda
def test_cuda_measure_rounds_each_tensor_to_512_bytes(lab01):
    from labkit.ledger import counted_bytes

    args = lab01.parse_args(["--device", "cuda", *SMALL, "--measure"])
    shape = lab01.Shape(**{n: getattr(args, n) for n in lab01.SHAPE_FLAGS})
    run = lab01.measure(args, shape)
    model = TinyGPT(GPTConfig(vocab=64, seq_len=16, width=32, layers=2, heads=4))
    device = torch.device(run["device"])
    rounded = sum(counted_bytes(p.numel() * 4, device) for p in model.parameters())
    assert run["measured"]["parameters"] == rounded  # the formula, rounded up to 512-byte blocks per tensor
    assert run["measured"]["gradients"] == rounded
    # AdamW keeps its step counters on the host for CUDA parameters unless capturable or fused
    # (torch/optim/adam.py): the device holds the two moments only, not 8 B x P + 4 B x tensors.
    assert run["measured"]["optimizer_state"] == 2 * rounded
    assert run["measured"]["optimizer_state_on_host"] == 4 * len(list(model.parameters()))  # the counters, on the host
    assert run["cuda"]["max_memory_allocated"] >= run["peak_bytes"] - run["measured"]["activations"]
