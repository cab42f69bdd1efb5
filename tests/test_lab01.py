"""Lab 01: the memory formulas against known figures and against the ledger's bytes; the rules of its
command line."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from conftest import assert_clean_usage_error, assert_usage_error_in_process, run_cli

from labkit import GPTConfig, Ledger, SyntheticTokens, TinyGPT, labs, marks

SCRIPT = "lab-01-memory-accounting/memory_accounting.py"
SMALL = {"layers": 2, "hidden": 32, "heads": 4, "seq": 16, "batch": 2, "vocab": 64}
P7 = 7_000_000_000


@pytest.fixture(scope="module")
def lab01():
    return labs.load(1)


@pytest.fixture(scope="module")
def toy():
    return labs.load(1, "toy_gpt")


@pytest.fixture(scope="module")
def sweeps():
    return labs.load(1, "accounting_sweeps")


@pytest.fixture(scope="module")
def tables():
    return labs.load(1, "accounting_tables")


def measure(lab01, **fields):
    return lab01.run(lab01.Config(device="cpu", measure=True, **{**SMALL, **fields}))


# ---------------------------------------------------------------- model state and ZeRO (derived)
def test_7b_mixed_precision_adamw_is_16_bytes_per_parameter(lab01):
    est = lab01.estimate_bytes(params=P7, precision="mixed", optimizer="adamw")
    assert est == {"parameters": 14 * 10**9, "gradients": 14 * 10**9, "master_weights": 28 * 10**9,
                   "optimizer_state": 56 * 10**9}
    assert sum(est.values()) == 112 * 10**9


@pytest.mark.parametrize(("precision", "optimizer", "per_param"), [
    ("fp32", "sgd", 8), ("fp32", "momentum", 12), ("fp32", "adamw", 16),
    ("mixed", "sgd", 8), ("mixed", "momentum", 12), ("mixed", "adamw", 16),
    ("bf16", "sgd", 4), ("bf16", "momentum", 6), ("bf16", "adamw", 8),
])
def test_bytes_per_parameter_by_recipe(lab01, sweeps, precision, optimizer, per_param):
    assert sum(lab01.model_state_bytes(1000, precision, optimizer).values()) == per_param * 1000
    row = next(r for r in sweeps.recipes_table().rows if r[:2] == [precision, optimizer])
    assert row[6] == per_param and row[7] == per_param * 7  # the published table: B/param, GB for 7B


def test_zero_stages_of_a_7b_model_on_8_ranks(sweeps):
    """The per-rank figures the page and the interview answers quote: 112, 38.5, 26.25, 14 GB."""
    per_rank = sweeps.model_state_per_rank(sweeps.zero_stages(P7, "mixed", "adamw", 8))
    assert per_rank == {0: 112 * 10**9, 1: 38_500_000_000, 2: 26_250_000_000, 3: 14 * 10**9}


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
    assert f(s, b, h, a, mask=None) == 32 * s * b * h + 2 * a * s * s * b  # no dropout: no masks, one s x s


def test_7b_activations_by_sequence(sweeps):
    act = sweeps.activations_by_sequence((2048, 4096, 8192))
    assert act["selective"][0] == 32 * 34 * 2048 * 4096 and act["full"][0] == 32 * 2 * 2048 * 4096
    # scores kept: the activations pass the whole model state just above 4096 tokens (the page says so)
    assert act["none"][1] < sweeps.model_state_of() < act["none"][2]
    assert act["none"][1] > 0.9 * sweeps.model_state_of()


def test_kv_cache_of_a_7b_llama_shape(lab01, toy):
    shape = toy.Shape(layers=32, hidden=4096, heads=32, seq=4096, batch=1, vocab=32000)
    assert lab01.kv_cache_bytes(shape, act=2) == 2 * 2**30  # 2 x 32 x 4096 x 32 x 128 x 2 B = 2 GiB
    gqa = toy.Shape(layers=32, hidden=4096, heads=32, seq=4096, batch=1, vocab=32000, kv_heads=8)
    assert lab01.kv_cache_bytes(gqa, act=2) == 2**30 // 2


def test_gqa_divides_every_kv_cache_by_4(sweeps):
    cases = sweeps.kv_cache_cases()
    assert set(cases) == {f"seq{s}_batch{b}" for s, b in sweeps.KV_CASES}
    for case in cases.values():
        assert case["mha_bytes"] == 4 * case["gqa_bytes"] == 4 * 2 * 32 * case["batch"] * case["seq"] * 8 * 128 * 2
        assert case["weights_gb"] == 14 and case["gqa_over_weights"] == case["gqa_bytes"] / (2 * P7)


def test_param_count_and_tensor_count_match_tinygpt(toy):
    shape = toy.Shape(layers=3, hidden=48, heads=4, seq=20, batch=1, vocab=70)
    model = TinyGPT(GPTConfig(vocab=70, seq_len=20, width=48, layers=3, heads=4))
    params = list(model.parameters())
    assert toy.param_count(shape) == sum(p.numel() for p in params)
    assert toy.param_tensors(shape) == len(params)


# ---------------------------------------------------------------- formulas against the ledger (measured, CPU)
@pytest.mark.parametrize("fields", [
    {}, {"dropout": 0}, {"optimizer": "sgd"}, {"optimizer": "momentum", "dropout": 0.2},
    {"precision": "bf16"}, {"precision": "bf16", "dropout": 0, "optimizer": "momentum"},
    {"precision": "mixed"}, {"precision": "mixed", "dropout": 0, "optimizer": "sgd"},
])
def test_measured_bytes_equal_the_formulas_exactly_on_cpu(lab01, tables, fields):
    result = measure(lab01, **fields)
    m, est = result.measurement, result.derived
    for cat in ("parameters", "gradients", "master_weights", "optimizer_state"):
        assert m.measured[cat] == est[cat], cat  # the ledger counts storage.nbytes(): no rounding on CPU
    assert m.measured["optimizer_state_on_host"] == 0  # on CPU the step counters live on the compute device
    assert m.measured["activations"] == m.tinygpt_activations["total"]  # every saved tensor accounted for
    # the paper's formula for the layers plus the listed differences is the same number
    assert est["activations"] + sum(n for _, n in m.gap_to_paper) == m.measured["activations"]
    assert m.exact and m.cuda is None
    # the published table says so: no gap but the paper's formula for the activations
    gaps = {how: gap for _, _, _, gap, how in tables.measured_table(result).rows}
    assert [how for how, gap in gaps.items() if gap] == [next(h for h in gaps if h.startswith("the paper's"))]
    *_, listed, ledger = tables.gap_table(result).rows
    assert listed[1] == ledger[1] == m.measured["activations"]


def test_mixed_precision_measures_a_16_bit_working_copy_and_fp32_masters(lab01, toy, tables):
    result = measure(lab01, precision="mixed")
    m, shape = result.measurement.measured, result.shape
    P, T = toy.param_count(shape), toy.param_tensors(shape)
    assert (m["parameters"], m["gradients"], m["master_weights"]) == (2 * P, 2 * P, 4 * P)
    assert m["optimizer_state"] == 8 * P + 4 * T  # fp32 moments: AdamW updates the fp32 masters
    total = tables.model_state_table(result).rows[-1]
    assert total[0] == "model state" and total[1] == total[2] == 16 * P + 4 * T
    assert m["activations"] == toy.tinygpt_activation_bytes(
        GPTConfig(vocab=64, seq_len=16, width=32, layers=2, heads=4, dropout=0.1), 2, 2)["total"]


def test_the_mixed_step_updates_the_master_and_copies_it_back(toy):
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=64, seq_len=16, width=32, layers=1, heads=4)).to(torch.bfloat16)
    masters = [p.detach().float() for p in model.parameters()]
    before = [m.clone() for m in masters]
    x, y = SyntheticTokens(64, 16).batch(0, 2)
    assert not marks.watching()  # no ledger: the step's marks cost nothing
    toy.train_step(model, torch.optim.AdamW(masters, lr=1e-2), x, y, masters)
    assert all(not torch.equal(a, b) for a, b in zip(before, masters))  # every master moved
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(model.parameters(), masters))
    assert all(m.grad is None for m in masters)  # the fp32 gradient copies were temporaries


def test_the_timeline_meets_the_derived_levels(lab01, tables):
    """The stack touches parameters + saved tensors when forward ends, and ends on the model state."""
    result = measure(lab01)
    tl = result.measurement.ledger.timeline()
    forward = next(s for s in tl.spans if s.name == "forward")
    total = tl.device_total()
    at_forward_end, after_step = tables.derived_levels(result).values()
    assert total[forward.end - 1] == at_forward_end
    assert total[-1] == after_step  # the loss is gone too
    assert max(total) > at_forward_end  # the peak comes later, in backward


@pytest.mark.parametrize(("dropout", "recompute", "formula"), [
    (0.1, "none", "L x [sbh(16e+2m) + as^2b(2e+m)], e=4, m=1"),
    (0, "none", "L x [sbh x 16e + as^2b x e], e=4, no dropout"),
    (0.1, "selective", "L x sbh(16e+2m), e=4, m=1"),
    (0, "selective", "L x sbh x 16e, e=4, no dropout"),
    (0, "full", "L x sbh x e, e=4"),
])
def test_the_printed_activation_formula_is_the_one_used(lab01, dropout, recompute, formula):
    summary = lab01.run(lab01.Config(**SMALL, dropout=dropout, recompute=recompute)).summary()
    assert summary["formulas"]["activations"] == formula
    L, s, b, h, a, e, m = 2, 16, 2, 32, 4, 4, 1  # SMALL, fp32, 1-byte masks: the formula by hand
    by_hand = {(0.1, "none"): L * (s * b * h * (16 * e + 2 * m) + a * s * s * b * (2 * e + m)),
               (0, "none"): L * (s * b * h * 16 * e + a * s * s * b * e),
               (0.1, "selective"): L * s * b * h * (16 * e + 2 * m),
               (0, "selective"): L * s * b * h * 16 * e, (0, "full"): L * s * b * h * e}[(dropout, recompute)]
    assert summary["derived"]["activations"] == by_hand


def test_adamw_state_is_two_moments_and_a_step_counter_per_tensor(lab01):
    m = measure(lab01).measurement
    model_params = [r for r in m.ledger.records if m.ledger.category_of(r) == "parameters"]
    n = sum(r.nbytes for r in model_params) // 4
    assert m.measured["optimizer_state"] == 8 * n + 4 * len(model_params)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_saved_tensor_list_holds_for_explicit_attention(lab01, toy, dropout):
    """attention='math' materialises the s x s scores: the per-op list must still match to the byte."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=64, seq_len=16, width=32, layers=2, heads=4, dropout=dropout, attention="math")
    model = TinyGPT(cfg)
    x, y = SyntheticTokens(cfg.vocab, cfg.seq_len).batch(0, 3)
    ledger = Ledger("cpu").track_module(model)
    with ledger:
        toy.train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), x, y)
    tl = ledger.timeline()
    end = next(s for s in tl.spans if s.name == "forward").end - 1
    assert tl.device["activations"][end] == toy.tinygpt_activation_bytes(cfg, 3)["total"]
    shape = toy.Shape(layers=2, hidden=32, heads=4, seq=16, batch=3, vocab=64)
    paper = lab01.estimate_bytes(shape=shape, dropout=dropout > 0)["activations"]
    assert paper + sum(n for _, n in toy.gap_to_paper(cfg, 3)) == tl.device["activations"][end]


def test_activations_grow_by_the_same_bytes_per_layer(lab01, toy):
    one, three = measure(lab01, layers=1), measure(lab01, layers=3)
    rows = toy.tinygpt_saved_tensors(GPTConfig(vocab=64, seq_len=16, width=32, layers=1, heads=4, dropout=0.1), 2)
    per_layer = sum(n for where, _, n in rows if where == "layer 0")
    assert three.measurement.measured["activations"] - one.measurement.measured["activations"] == 2 * per_layer


@pytest.mark.parametrize("dropout", [0.1, 0.0])
def test_the_sequence_sweep_measures_what_tinygpt_lists(lab01, sweeps, dropout):
    points = [sweeps.sweep_point(measure(lab01, hidden=64, seq=s, dropout=dropout)) for s in (32, 64)]
    assert all(measured == listed for _, _, measured, listed, _ in points)
    # the paper's policy: scores kept with dropout (quadratic), none without (linear in the sequence)
    paper = [p[4] for p in points]
    assert (paper[1] > 2 * paper[0]) is bool(dropout) and (paper[1] == 2 * paper[0]) is not bool(dropout)


# ---------------------------------------------------------------- the run and its report
def test_inference_counts_weights_and_kv_cache(lab01):
    result = lab01.run(lab01.Config(layers=32, hidden=4096, heads=32, kv_heads=8, seq=4096, batch=1, vocab=32000,
                                    precision="bf16", inference=True))
    assert set(result.derived) == {"parameters", "kv_cache"} and result.derived["kv_cache"] == 2**29


def test_the_toy_shape_is_the_default(lab01):
    assert lab01.Config(seq=32).shape == replace(lab01.TOY, seq=32)
    assert lab01.Config(params=P7).shape is None


def test_human_report_shows_formulas_and_the_measured_comparison(lab01, capsys):
    lab01.report(measure(lab01))
    lines = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]
    assert "optimizer state 8 B x P + 4 B x 29 tensors 240,756 B 0.000 0.000" in lines  # the derived ledger
    assert "parameters 120,320 B 120,320 B +0 B 4 B x P" in lines  # measured, derived: 4 B x 30,080 parameters
    assert any(line.startswith("+ CPU dropout keeps noise in the data's dtype, the paper 1-byte masks") for line in lines)


def test_json_is_one_object_with_integer_bytes_per_rank():
    proc = run_cli(SCRIPT, "--params", "7e9", "--precision", "mixed", "--zero-stage", "3", "--dp", "8", "--json")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    data = json.loads(proc.stdout)
    assert set(data["derived"]) == {"parameters", "gradients", "master_weights", "optimizer_state"}
    assert all(isinstance(v, int) for v in data["derived"].values())
    assert data["total_bytes"] == sum(data["derived"].values()) == 14 * 10**9
    assert data["params"] == 7 * 10**9 and data["dp"] == 8 and data["zero_stage"] == 3
    assert data["formulas"]["optimizer_state"] == "8 B x P / 8"
    assert data["provenance"]["lab"] == "lab-01-memory-accounting"


def test_json_with_measure_and_a_shape():
    proc = run_cli(SCRIPT, "--device", "cpu", "--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "16",
                   "--batch", "2", "--vocab", "64", "--measure", "--json")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    data = json.loads(proc.stdout)
    assert set(data["derived"]) == {"parameters", "gradients", "master_weights", "optimizer_state", "activations"}
    assert data["measured"]["parameters"] == data["derived"]["parameters"]
    assert data["tinygpt_activations"]["total"] == data["measured"]["activations"]


# ---------------------------------------------------------------- what the command line refuses
@pytest.mark.parametrize(("fields", "fragment"), [
    ({"params": P7, "layers": 32}, "exclude each other"),
    ({"params": P7, "seq": 2048, "batch": 1}, "activations need the whole shape"),
    ({"params": P7, "recompute": "full"}, "--recompute needs a model shape"),
    ({"params": P7, "measure": True}, "--measure needs a model shape"),
    ({"params": P7, "inference": True}, "--inference needs a model shape"),
    ({"hidden": 100, "heads": 8}, "--heads 8 does not divide --hidden 100"),
    ({"kv_heads": 3}, "--kv-heads 3 does not divide --heads 4"),
    ({"measure": True, "dp": 2}, "--measure runs one process"),
    ({"measure": True, "zero_stage": 1}, "--measure runs one process"),
    ({"inference": True, "zero_stage": 1}, "--inference counts weights and KV cache"),
    ({"snapshot": "s.pickle"}, "--snapshot records the --measure run"),
])
def test_the_config_refuses_what_cannot_run(lab01, fields, fragment):
    with pytest.raises(lab01.UsageError, match=fragment):
        lab01.Config(**fields)


@pytest.mark.parametrize(("text", "fragment"), [
    ("1.5", "whole number"), ("inf", "whole number"), ("0", "whole number"), ("seven", "such as 7e9")])
def test_params_must_be_a_whole_count(lab01, text, fragment):
    assert lab01.parameter_count("7e9") == P7
    with pytest.raises(ValueError, match=fragment):
        lab01.parameter_count(text)


@pytest.mark.parametrize(("argv", "fragment"), [
    (["--measure", "--device", "cpu", "--snapshot", "s.pickle"], "needs a CUDA device"),
    (["--measure", "--device", "cpu", "--layers", "48", "--hidden", "4096", "--heads", "32"], "toy shapes"),
])
def test_run_time_refusals_are_one_line(lab01, capsys, tmp_path, monkeypatch, argv, fragment):
    monkeypatch.chdir(tmp_path)
    assert_usage_error_in_process(lab01, argv, capsys, fragment)
    assert not list(tmp_path.iterdir())  # refused before anything ran or was written


def test_params_with_a_shape_from_the_command_line():
    proc = run_cli(SCRIPT, "--params", "7e9", "--layers", "32", "--hidden", "4096")
    assert_clean_usage_error(proc, "--params and a model shape (--layers --hidden) exclude each other")


# ---------------------------------------------------------------- GPU only
@pytest.mark.cuda
def test_cuda_measure_rounds_each_tensor_to_512_bytes(lab01):
    from labkit.ledger import counted_bytes

    result = lab01.run(lab01.Config(device="cuda", measure=True, **SMALL))
    m = result.measurement
    model = TinyGPT(GPTConfig(vocab=64, seq_len=16, width=32, layers=2, heads=4))
    rounded = sum(counted_bytes(p.numel() * 4, m.device) for p in model.parameters())
    assert m.measured["parameters"] == rounded  # the formula, rounded up to 512-byte blocks per tensor
    assert m.measured["gradients"] == rounded
    # AdamW keeps its step counters on the host for CUDA parameters unless capturable or fused
    # (torch/optim/adam.py): the device holds the two moments only, not 8 B x P + 4 B x tensors.
    assert m.measured["optimizer_state"] == 2 * rounded
    assert m.measured["optimizer_state_on_host"] == 4 * len(list(model.parameters()))  # the counters, on the host
    assert m.cuda["max_memory_allocated"] >= m.ledger.peak()["total"] - m.measured["activations"]


def test_zoo_model_state_uses_the_exact_published_parameter_counts():
    sweeps = labs.load(1, "accounting_sweeps")
    models = sweeps.zoo_model_state(("llama-3-8b", "llama-3-70b"))
    assert models["llama-3-8b"]["params"] == 8_030_261_248
    assert models["llama-3-70b"]["params"] == 70_553_706_496
    assert models["llama-3-8b"]["mixed_adamw"] == 16 * 8_030_261_248
    assert models["llama-3-8b"]["zero3_per_rank"] == 16 * -(-8_030_261_248 // 8)
    assert models["llama-3-8b"]["kv_bf16_per_token"] == 2 * 32 * 8 * 128 * 2  # 128 KiB per token


# ---------------------------------------------------------------- model parallelism (derived: Korthikanti et al. 2022)
# arXiv 2205.05198. Its Table 2 gives the bytes one layer keeps per GPU; its section 5 and Table 3
# give the worked numbers below. s, b, h, a, L, t, p as in the paper (and the handbook's notation).
GPT3 = {"seq": 2048, "batch": 1, "hidden": 12288, "heads": 96}  # section 5 and Table 3: 175B, 96 layers
MTNLG = {"seq": 2048, "batch": 1, "hidden": 20480, "heads": 128}  # section 5: 530B
TABLE_3 = {"22B": (64, 6144, 48), "175B": (96, 12288, 96), "530B": (128, 20480, 105), "1T": (160, 25600, 128)}


model_parallel = labs.load(1, "model_parallel")  # Layout, params_per_rank, total_params
tp_trace = labs.load(1, "tp_trace")  # a layer split by DTensor, traced on one GPU of t


def per_layer(lab01, shape, **kw):
    return lab01.activation_bytes_per_layer(shape["seq"], shape["batch"], shape["hidden"], shape["heads"], **kw)


@pytest.mark.parametrize("t", [2, 4, 8])
@pytest.mark.parametrize("shape", [GPT3, MTNLG, {"seq": 512, "batch": 4, "hidden": 1024, "heads": 16}])
def test_each_row_of_table_2(lab01, shape, t):
    """Table 2, row by row, in integers (each side multiplied by h*t where the paper divides)."""
    s, b, h, a = shape["seq"], shape["batch"], shape["hidden"], shape["heads"]
    sbh = s * b * h
    assert per_layer(lab01, shape, tp=t) * h * t == sbh * (10 * h * t + 24 * h + 5 * a * s)  # tensor parallel (Eq. 2)
    assert per_layer(lab01, shape, tp=t, sp=True) * h * t == sbh * (34 * h + 5 * a * s)  # + sequence parallel (Eq. 4)
    assert per_layer(lab01, shape, tp=t, recompute="selective") * t == sbh * (10 * t + 24)  # TP + selective
    assert per_layer(lab01, shape, tp=t, sp=True, recompute="selective") * t == 34 * sbh  # TP + SP + selective
    assert per_layer(lab01, shape, tp=t, recompute="full") == 2 * sbh  # full recomputation: the layer's input
    # with SP the layer's input is itself split along s: 2sbh/t (section 5 names this option for TP alone)
    assert per_layer(lab01, shape, tp=t, sp=True, recompute="full") * t == 2 * sbh
    # Eq. 4 is Eq. 1 divided by t; context parallelism divides everything by its size too
    assert per_layer(lab01, shape, tp=t, sp=True) * t == per_layer(lab01, shape)
    assert per_layer(lab01, shape, cp=2) * 2 == per_layer(lab01, shape)


@pytest.mark.parametrize(("shape", "attention_term", "saving_pct"), [(GPT3, 80, 70), (MTNLG, 64, 65)])
def test_section_5_selective_recomputation_saves_70_and_65_percent(lab01, shape, attention_term, saving_pct):
    """Section 5: 5as/h = 80 for GPT-3 and 64 for MT-NLG, so selective recomputation saves 70 % and 65 %."""
    s, h, a = shape["seq"], shape["hidden"], shape["heads"]
    assert 5 * a * s // h == attention_term and 5 * a * s % h == 0
    for kw in ({}, {"tp": 8, "sp": True}):  # the share is the same on one GPU and under TP + SP
        full, kept = per_layer(lab01, shape, **kw), per_layer(lab01, shape, recompute="selective", **kw)
        assert round(100 * (full - kept) / full) == saving_pct


def test_figure_7_sp_and_selective_together_cut_about_5x(lab01):
    """Section 6.1 / Figure 7, for Table 3's models at s = 2048, t = 8: SP and selective recomputation
    together keep about a fifth of Eq. 2 (the figure's bars also hold Appendix B's saving, so the check
    is 'about'), full recomputation at most a tenth."""
    for a, h, _ in TABLE_3.values():
        shape = {"seq": 2048, "batch": 1, "hidden": h, "heads": a}
        baseline = per_layer(lab01, shape, tp=8)
        both = per_layer(lab01, shape, tp=8, sp=True, recompute="selective")
        assert 4.5 < baseline / both < 6.5
        assert per_layer(lab01, shape, tp=8, recompute="full") <= baseline / 10


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_pipeline_stage_0_holds_L_layers_of_activations_whatever_p(lab01, recompute):
    """Section 4.2.3, Eq. 5 and 6: under 1F1B stage 0 keeps p micro-batches of its L/p layers, so its
    activations are sbhL/t (34 + 5as/h) (selective: 34 sbhL/t) for every p; GPT-3 as in Table 3."""
    s, b, h, a, L, t = 2048, 1, 12288, 96, 96, 8
    attention = 5 * a * s // h if recompute == "none" else 0
    by_p = {}
    for p in (1, 2, 8, 96):
        result = lab01.run(lab01.Config(layers=L, hidden=h, heads=a, seq=s, batch=b, vocab=51200, precision="mixed",
                                        tp=t, sp=True, pp=p, recompute=recompute))
        by_p[p] = result
        assert result.derived["activations"] == s * b * h * L * (34 + attention) // t
    # the weights do shrink with p: stage 0 holds L/p layers (and the embeddings)
    assert by_p[8].derived["parameters"] < by_p[1].derived["parameters"] / 7


# ---------------------------------------------------------------- parameters per GPU
@pytest.mark.parametrize("shape", [dict(SMALL), {"layers": 4, "hidden": 96, "heads": 6, "seq": 10, "batch": 1, "vocab": 70}])
def test_one_gpu_holds_tinygpts_whole_count(toy, shape):
    s = toy.Shape(**shape)
    mine = model_parallel.params_per_rank(s)
    assert mine == {"dense": toy.param_count(s), "experts": 0, "tensors": toy.param_tensors(s)}
    assert model_parallel.total_params(s) == toy.param_count(s)


def test_tensor_and_pipeline_parallel_parameters_per_gpu(toy):
    """Megatron's split: matrices (and column-parallel biases) / t, norms and row-parallel biases whole,
    the vocabulary / t; stage 0 holds L/p layers and the embeddings, the last stage the head."""
    L, h, s, V = 8, 64, 32, 1000
    shape = toy.Shape(layers=L, hidden=h, heads=8, seq=s, batch=1, vocab=V)
    layer_split, layer_whole = 12 * h * h + 7 * h, 6 * h
    for t in (1, 2, 8):
        vocab = -(-V // t) * h  # 1000 / 8 = 125 rows: no padding here; 1000 / 3 would pad
        mine = model_parallel.params_per_rank(shape, model_parallel.Layout(tp=t))
        assert mine["dense"] == L * (layer_split // t + layer_whole) + 2 * vocab + s * h + 2 * h
        stage0 = model_parallel.params_per_rank(shape, model_parallel.Layout(tp=t, pp=4))
        assert stage0["dense"] == L // 4 * (layer_split // t + layer_whole) + vocab + s * h
        assert stage0["tensors"] == 12 * L // 4 + 2
    # the t GPUs together hold every split parameter once and the whole ones t times
    split = model_parallel.params_per_rank(shape, model_parallel.Layout(tp=8))["dense"]
    assert 8 * split - 7 * (L * layer_whole + s * h + 2 * h) == toy.param_count(shape)


def test_expert_parallelism_divides_only_the_experts(lab01, toy):
    L, h, E = 4, 64, 8
    shape = toy.Shape(layers=L, hidden=h, heads=4, seq=16, batch=1, vocab=100)
    expert = 8 * h * h + 5 * h  # each expert: the dense MLP (fc1 weight and bias, fc2 weight and bias)
    assert model_parallel.total_params(shape, E) == toy.param_count(shape) + L * ((E - 1) * expert + h * E)
    for ep in (1, 2, 8):
        mine = model_parallel.params_per_rank(shape, model_parallel.Layout(experts=E, ep=ep))
        assert mine["experts"] == L * E // ep * expert
        assert mine["dense"] == toy.param_count(shape) - L * expert + L * h * E  # the router stays whole
    # ZeRO shards the dense state over dp x cp GPUs and the experts over the dp x cp / ep that share them
    config = lab01.Config(layers=L, hidden=h, heads=4, seq=16, batch=1, vocab=100, precision="mixed", experts=E,
                          ep=4, dp=4, cp=2, zero_stage=3)
    mine = model_parallel.params_per_rank(shape, config.layout)
    assert lab01.run(config).derived["parameters"] == 2 * (-(-mine["dense"] // 8) + -(-mine["experts"] // 2))


def test_kv_cache_is_split_by_head_and_by_stage(lab01, toy):
    """Serving a Llama-3-70B-shaped model (8 KV heads) with tensor parallelism: each GPU holds its
    heads' keys and values; past 8 GPUs a KV head is copied, not split further."""
    shape = toy.Shape(layers=80, hidden=8192, heads=64, seq=8192, batch=1, vocab=128256, kv_heads=8)
    whole = lab01.kv_cache_bytes(shape)
    assert whole == 2 * 80 * 8192 * 8 * 128 * 2  # 320 KiB per token, 2.5 GiB per 8k sequence
    assert lab01.kv_cache_bytes(shape, tp=8) == whole // 8 == lab01.kv_cache_bytes(shape, tp=16)
    assert lab01.kv_cache_bytes(shape, tp=8, pp=4) == whole // 32


# ---------------------------------------------------------------- the command line, split
def test_the_report_and_json_say_the_split(lab01, tables, capsys):
    config = lab01.Config(layers=80, hidden=8192, heads=64, seq=8192, batch=1, vocab=128256, precision="mixed",
                          tp=8, sp=True, pp=4, recompute="selective")
    result = lab01.run(config)
    summary = result.summary()
    assert summary["layout"] == {"tp": 8, "sp": True, "pp": 4, "cp": 1, "experts": 0, "ep": 1}
    assert summary["params_per_gpu"]["dense"] * 2 == summary["derived"]["parameters"]
    assert summary["derived"]["activations"] == 80 * 34 * 8192 * 8192 // 8  # 34 sbhL/t, Eq. 6
    assert summary["formulas"]["activations"] == ("L x [sbh(4e+2m)/t + sbh x 12e/t], t=8, e=2, m=1; "
                                                  "stage 0 of p=4: p micro-batches x L/p layers")
    assert summary["formulas"]["parameters"] == "2 B x P_gpu"
    tables.report(result)
    out = capsys.readouterr().out
    assert "split: TP 8 + SP, PP 4 (stage 0, 1F1B); this GPU holds P_gpu = " in out


@pytest.mark.parametrize(("fields", "fragment"), [
    ({"params": P7, "tp": 8}, "--tp needs a model shape"),
    ({"params": P7, "sp": True}, "--sp needs a model shape"),
    ({"tp": 3}, "--tp 3 must divide --heads 4"),
    ({"heads": 12, "kv_heads": 3, "tp": 2, "hidden": 48}, "divide or be a multiple of the 3 KV heads"),
    ({"heads": 8, "kv_heads": 4, "tp": 8, "hidden": 64, "layers": 4}, None),  # 8 GPUs, 4 KV heads: each copied twice
    ({"pp": 3}, "--pp 3 does not divide --layers 2"),
    ({"cp": 3}, "--cp 3 does not divide --seq 64"),
    ({"sp": True}, "--sp splits the 64 tokens"),
    ({"sp": True, "tp": 4, "seq": 66, "heads": 4}, "--sp splits the 66 tokens"),
    ({"ep": 2}, "--ep 2 must divide --experts (none"),
    ({"experts": 6, "ep": 4, "dp": 4}, "--ep 4 must divide --experts (6)"),
    ({"experts": 8, "ep": 4, "dp": 2}, "--ep 4 must divide --dp x --cp = 2"),
    ({"inference": True, "tp": 2, "sp": True}, "--sp and --cp split training activations"),
    ({"measure": True, "tp": 2}, "--measure runs one process of TinyGPT"),
])
def test_the_config_refuses_a_split_that_cannot_be(lab01, fields, fragment):
    if fragment is None:
        assert lab01.Config(**fields).layout.tp == 8
        return
    with pytest.raises(lab01.UsageError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        lab01.Config(**fields)


def test_a_bad_split_is_one_line_from_the_command_line(lab01, capsys):
    assert_usage_error_in_process(lab01, ["--layers", "32", "--heads", "32", "--hidden", "4096", "--tp", "3"], capsys,
                                  "--tp 3 must divide --heads 32")


# ---------------------------------------------------------------- tensor parallelism traced (DTensor, fake process group)
def trace(*args, **kw):
    return tp_trace.trace_block(*args, **kw)  # the fake process group is in torch 2.11 and 2.13


@pytest.mark.parametrize(("t", "sp"), [(1, False), (2, False), (4, False), (2, True), (4, True)])
def test_dtensor_tensor_parallelism_keeps_the_formulas_terms(lab01, toy, t, sp):
    """One GPU of t, as PyTorch's ColwiseParallel/RowwiseParallel (and SequenceParallel) run a plain
    transformer layer, traced on fake tensors under the fake process group: its weights are the
    lab's per-GPU split of one layer, and what it keeps for backward is the paper's formula for a
    layer without dropout whose attention keeps no scores (recompute="selective", mask=None) plus
    the terms gap_to_formula names: the norms' statistics, flash attention's log-sum-exp and, with
    SP, the all-gathered inputs PyTorch saves whole where Megatron keeps a shard."""
    h, a, s, b = 64, 8, 32, 2
    traced = trace(h, a, s, b, t, sp)
    one_layer = [model_parallel.params_per_rank(toy.Shape(layers=n, hidden=h, heads=a, seq=s, batch=b, vocab=64),
                                                model_parallel.Layout(tp=t))["dense"] for n in (1, 2)]
    assert traced.parameters == 4 * (one_layer[1] - one_layer[0]) == 4 * ((12 * h * h + 7 * h) // t + 6 * h)
    formula = lab01.activation_bytes_per_layer(s, b, h, a, act=4, mask=None, recompute="selective", tp=t, sp=sp)
    gap = tp_trace.gap_to_formula(h, a, s, b, t, sp, elem=4)
    assert traced.activations == formula + sum(n for _, n in gap) == sum(n for _, n in traced.saved)
    # the split terms shrink by t: Q, K, V and the attention output (a/t heads), the MLP's 4h/t columns
    split_ops = [n for op, n in traced.saved if op in ("addmm", "gelu", "_scaled_dot_product_flash_attention_for_cpu")]
    assert sum(split_ops) == 12 * s * b * h * 4 // t + a // t * b * s * 4


def test_dtensor_sequence_parallelism_leaves_two_gathered_inputs_whole():
    """What PyTorch's SP keeps that Megatron's does not: with t = 4 the layer keeps two all-gathered
    s x b x h inputs (one per sublayer, 'cat' in the trace) at full size on every GPU."""
    h, a, s, b = 64, 8, 32, 2
    traced = trace(h, a, s, b, 4, sp=True)
    gathered = [n for op, n in traced.saved if op == "cat"]
    assert gathered == [s * b * h * 4] * 2
