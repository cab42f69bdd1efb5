"""Lab 04: checkpointing strategies against no checkpointing: gradients, kept bytes, recompute, the
segment rule, TinyGPT's block seam, CLI."""

from __future__ import annotations

import contextlib
import json
import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_clean_usage_error, assert_usage_error_in_process, load_lab, run_cli
from test_labkit_fake import assert_same_timeline
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from labkit import fake, marks
from labkit.ledger import Ledger

SCRIPT = "lab-04-activation-checkpointing/checkpointing.py"
SIZE = {"device": "cpu", "width": 32, "layers": 4, "heads": 2, "seq_len": 16, "vocab": 64, "batch_size": 4}
SMALL = ["--device", "cpu", "--width", "32", "--layers", "4", "--heads", "2", "--seq-len", "16",
         "--vocab", "64", "--batch-size", "4", "--steps", "1"]  # the same, as a user types it
TOLERANCE = 0.01  # measured against predicted; on a CPU both agree to the byte


@pytest.fixture(scope="module")
def lab04():
    return load_lab(4)


@pytest.fixture(scope="module")
def segments():
    return load_lab(4, "segments")


@pytest.fixture(scope="module")
def small_run(lab04):
    return lab04.run(lab04.Config(**SIZE, every=3, steps=1))


def setup(lab04, **extra):
    config = lab04.Config(**{**SIZE, **extra})
    return config, *lab04.build(config, torch.device("cpu"))


# ---------------------------------------------------------------------- TinyGPT's block seam
def tinygpt_forward_before_the_seam(model, idx, targets):
    """TinyGPT.forward as it was written before it had ``run_blocks`` (labkit/models.py at f6d8bd4)."""
    pos = torch.arange(idx.shape[1], device=idx.device)
    x = model.drop(model.tok(idx) + model.pos(pos))
    for block in model.blocks:
        x = block(x)
    logits = model.head(model.ln_f(x))
    return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_seams_default_runs_the_same_ops_as_the_forward_before_it(lab04):
    """Same aten ops in the same order, forward and backward, the same values and the same ledger
    timeline: the seam changed no byte any lab measures. Under saved-tensor hooks that move every
    saved tensor elsewhere (as Lab 09's do), a tensor lives only as long as a reference to it: the
    timeline is the same there too, so forward holds the block input no longer than the loop did."""
    config, model, x, y = setup(lab04)
    ways = {"default": lambda: model(x, y), "before": lambda: tinygpt_forward_before_the_seam(model, x, y),
            "none": lambda: model(x, y, run_blocks=partial(lab04.run_blocks, strategy="none"))}
    moved = partial(saved_tensors_hooks, lambda t: t.clone(), lambda t: t)  # each saved tensor copied away
    seen = {}
    for name, forward in ways.items():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        with OpLog() as log:
            logits, loss = forward()
            loss.backward()
        timelines = []
        for hooks in (contextlib.nullcontext, moved):
            ledger = Ledger("cpu").track_module(model)
            model.zero_grad(set_to_none=True)
            torch.manual_seed(7)
            with ledger, hooks(), marks.phase("forward", 0):
                forward()[1].backward()
            timelines.append(ledger.timeline().to_dict()["device"])
        seen[name] = (log.ops, logits, loss, [p.grad for p in model.parameters()], timelines)
    ops, logits, loss, grads, timelines = seen["before"]
    for name in ("default", "none"):
        assert seen[name][0] == ops and len(ops) > 100, name
        assert torch.equal(seen[name][1], logits) and torch.equal(seen[name][2], loss), name
        assert all(torch.equal(g, h) for g, h in zip(seen[name][3], grads)), name
    assert seen["default"][4] == timelines  # with and without the hooks
    assert seen["none"][4][0] == timelines[0]  # a partial keeps x for the whole loop: only without hooks


# ---------------------------------------------------------------------- the strategies
@pytest.mark.parametrize("strategy", ["full", "every-k", "save-matmuls"])
def test_gradients_are_bit_identical_with_dropout(small_run, strategy):
    assert small_run.config.dropout > 0
    r = small_run.results[strategy]
    assert r["grads_equal"] and r["max_abs_grad_diff"] == 0.0  # under the ledger
    assert r["grads_equal_without_ledger"]  # and without it: the ledger changes nothing


def test_segments_that_do_not_divide_the_depth(lab04):
    config, model, x, y = setup(lab04, layers=3)
    assert not marks.watching()  # no ledger: the step's marks cost nothing
    lab04.train_step(model, x, y, "none", 1, seed=3)
    reference = lab04.grads_of(model)
    for k in (2, 3):
        lab04.train_step(model, x, y, "every-k", k, seed=3)
        assert lab04.grads_equal(lab04.grads_of(model), reference)[0], k


def test_kept_bytes_follow_the_segment_count(lab04):
    """A checkpointed segment keeps exactly its input: (n - ceil(n/k)) block inputs fewer than full."""
    config, model, x, y = setup(lab04, layers=5)
    b = config.batch_size * config.seq_len * config.width * 4

    def kept(strategy, k):
        return lab04.activation_memory(lab04.measure_memory(model, x, y, strategy, k).timeline())["kept_bytes"]

    full = kept("full", 1)
    assert kept("every-k", 1) == full
    for k in (2, 3, 5):
        assert full - kept("every-k", k) == (5 - math.ceil(5 / k)) * b, k


def test_every_formula_equals_the_measurement(small_run):
    """The checks table (block_costs against the ledger and the FLOP counter), to the byte on a CPU."""
    checks = load_lab(4, "block_costs").checks(small_run)
    assert len(checks.rows) == 6
    for quantity, formula, derived, measured, _unit in checks.rows:
        assert derived == measured, (quantity, formula)


def test_kept_bytes_per_block_match_the_korthikanti_count(lab04, small_run):
    """34sbh + 5as^2b bytes per layer (2-byte tensors, 1-byte masks), rewritten for fp32 and the 4-byte
    masks of CPU dropout: 72·s·b·h + 12·a·s²·b bytes, plus 16·s·b for the two layer norms' statistics."""
    c = small_run.config
    b, s, h, a = c.batch_size, c.seq_len, c.width, c.heads
    cost = load_lab(4, "block_costs").block_costs(b, s, h, a)
    assert small_run.per_block_bytes == cost["kept"] == 72 * s * b * h + 12 * a * s * s * b + 16 * s * b
    summary = small_run.summary()
    assert summary["per_block_over_input"] == cost["kept"] / (4 * s * b * h) == summary["two_block_segments_pay_beyond"] / 2


class OutputBytes(TorchDispatchMode):
    """Sums the output bytes of the ops the save-matmuls policy saves."""

    def __init__(self, policy):
        super().__init__()
        self.policy, self.saved = policy, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.policy(None, func, *args, **(kwargs or {})) == CheckpointPolicy.MUST_SAVE:
            self.saved += sum(t.untyped_storage().nbytes() for t in torch.utils._pytree.tree_leaves(out)
                              if isinstance(t, torch.Tensor))
        return out


def test_save_matmuls_keeps_exactly_the_matmul_outputs(small_run, lab04):
    n = small_run.config.layers
    block, x = small_run.model.blocks[0], torch.randn(4, 16, 32)
    with torch.no_grad(), OutputBytes(lab04.save_matmuls) as count:
        block(x)
    assert count.saved > 0
    r = small_run.results
    assert r["save-matmuls"]["kept_bytes"] - r["full"]["kept_bytes"] == n * count.saved
    assert r["full"]["activation_peak_bytes"] < r["save-matmuls"]["activation_peak_bytes"] < r["none"]["activation_peak_bytes"]


def test_recompute_flops_are_one_forward_of_the_blocks(small_run):
    model, r = small_run.model, small_run.results
    with FlopCounterMode(display=False) as blocks_fwd:
        h = torch.randn(4, 16, 32)
        for block in model.blocks:
            h = block(h)
    assert r["full"]["recompute_flops"] == blocks_fwd.get_total_flops() > 0
    assert r["every-k"]["recompute_flops"] == blocks_fwd.get_total_flops()
    assert r["save-matmuls"]["recompute_flops"] == 0  # every matmul output was kept
    assert r["none"]["forward_flops"] == r["full"]["forward_flops"] == r["save-matmuls"]["forward_flops"]


def test_recomputed_tensors_are_born_in_backward(small_run):
    """The ledger counts them as temporaries: full's backward holds more temporaries than none's."""
    def backward_temporaries(strategy):
        tl = small_run.ledgers[strategy].timeline()
        span = next(s for s in tl.spans if s.name == "backward")
        return max(tl.device["temporaries"][span.start:span.end])

    assert backward_temporaries("full") > backward_temporaries("none")
    r = small_run.results
    assert r["full"]["kept_bytes"] < r["none"]["kept_bytes"] / 4


def test_policy_rules(lab04):
    aten, P = torch.ops.aten, CheckpointPolicy
    q = torch.zeros(1)
    assert lab04.save_matmuls(None, aten.addmm.default, q, q, q) == P.MUST_SAVE
    assert lab04.save_matmuls(None, aten.gelu.default, q) == P.PREFER_RECOMPUTE
    flash = next(iter(lab04.ATTENTION))
    i = lab04.ATTENTION[flash]
    args = [q] * i
    assert lab04.save_matmuls(None, flash, *args, 0.0) == P.MUST_SAVE
    assert lab04.save_matmuls(None, flash, *args, 0.1) == P.MUST_RECOMPUTE
    assert lab04.save_matmuls(None, flash, *args) == P.MUST_SAVE  # dropout_p left at its default


def test_saving_a_random_op_shifts_the_replay():
    """Why the policy never saves attention with dropout: a saved random op is not rerun, so every
    random op after it in the replay draws from a different point of the generator."""
    def f(x):
        x = torch.bernoulli(torch.sigmoid(x)) * x
        return (torch.bernoulli(torch.sigmoid(x)) * x.sin()).sum()

    def grad_of(wrap):
        x = torch.linspace(-2, 2, 64, requires_grad=True)
        torch.manual_seed(0)
        wrap(x).backward()
        return x.grad

    def policy(save_first_random):
        seen = {False: 0, True: 0}  # bernoulli calls seen, per pass

        def p(ctx, op, *args, **kwargs):
            # torch 2.13 asks only in forward; torch 2.11 asks again during the recompute, so the
            # answer must depend on the op's place in its pass, not on calls over both passes
            if op == torch.ops.aten.bernoulli.default:
                seen[ctx.is_recompute] += 1
                if save_first_random and seen[ctx.is_recompute] == 1:
                    return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE
        return partial(create_selective_checkpoint_contexts, p)

    plain = grad_of(f)
    recompute = grad_of(lambda x: checkpoint(f, x, use_reentrant=False, context_fn=policy(False)))
    saved = grad_of(lambda x: checkpoint(f, x, use_reentrant=False, context_fn=policy(True)))
    assert torch.equal(plain, recompute)
    assert not torch.equal(plain, saved)


# ---------------------------------------------------------------------- the segment rule
def assert_rule_holds(rule: dict):
    for k, row in rule["predicted"].items():
        assert abs(row["kept_error"]) <= TOLERANCE and abs(row["peak_error"]) <= TOLERANCE, (k, row)
        assert row["kept"] == rule["measured"][k]["kept_bytes"], k  # to the byte on a CPU
    assert rule["best_k_measured"] == rule["best_k_predicted"]


def test_segment_rule_on_a_chain_of_simple_blocks(segments):
    """Linear + ReLU blocks keep their input's size (K_blk = I_blk): the measured peak is lowest at
    k = sqrt(L)."""
    blocks, width, batch = 16, 16, 8
    block_input = batch * width * 4
    model, x, y = segments.chain(blocks, width, batch, "cpu")
    rule = segments.compare(segments.sweep(model, x, y, [1, 2, 4, 8, 16]), blocks, block_input)
    assert rule["per_block_bytes"] == block_input and rule["k_star"] == 4.0
    assert_rule_holds(rule)
    assert rule["best_k_measured"] == math.isqrt(blocks)
    mem = rule["measured"]
    assert mem[4]["activation_peak_bytes"] < 0.6 * mem[1]["activation_peak_bytes"]  # a real minimum
    uneven = segments.compare(segments.sweep(model, x, y, [1, 3, 5, 6, 7]), blocks, block_input)  # short last segments
    assert_rule_holds(uneven)


def test_segment_rule_on_tinygpt(lab04, segments):
    """A transformer block keeps ~20 times its input (the Korthikanti count): k* < 1, so k = 1 wins."""
    config, model, x, y = setup(lab04, layers=8)
    b, s, h, a = config.batch_size, config.seq_len, config.width, config.heads
    rule = segments.compare(segments.sweep(model, x, y, [1, 2, 4, 8]), 8, 4 * s * b * h)
    assert rule["per_block_bytes"] == 72 * s * b * h + 12 * a * s * s * b + 16 * s * b and rule["k_star"] < 1
    assert_rule_holds(rule)
    assert rule["best_k_measured"] == 1
    found = segments.findings({"TinyGPT": rule, "chain": rule})
    assert found["exact"] and found["worst_error"] == 0


def test_segment_rule_predicts_short_last_segments(segments):
    """k that does not divide L: the last segment is short, and the busiest segment may be another."""
    assert segments.predict(16, 4, 1, 1) == (4, 8)  # 4 inputs, then 4 + 4 at the last segment
    assert segments.predict(16, 5, 1, 1) == (4, 8)  # segments 5, 5, 5, 1: 3 + 5 beats 4 + 1
    assert segments.predict(16, 6, 1, 1, C=10, G=2) == (13, 20)  # 6, 6, 4: 2 + 6 ties 3 + 4 (+ C + G)


# ---------------------------------------------------------------------- at real size, on fake tensors
@pytest.mark.parametrize("fields", [{}, {"model": "small-llama", "dtype": "bfloat16", "dropout": 0.0}],
                         ids=["tinygpt", "small-llama"])
def test_a_trace_holds_the_bytes_and_flops_of_the_real_run(lab04, monkeypatch, fields):
    """The lab's run on fake tensors against the same run on real tensors, strategy by strategy:
    the same allocations in the same order, every phase peak of every category, and the same FLOPs.
    The TinyGPT's real run is the lab's default path (``build``: SyntheticTokens); its trace takes
    the real-scale path (random ids of the same (B, T + 1) storage). The trace counts exact bytes here
    (``fake.tensors(block=None)``, as a CPU ledger does): ``--fake`` rounds them to the CUDA
    allocator's 512-byte blocks, which a real CPU run does not."""
    real = lab04.run(lab04.Config(**SIZE, steps=1, **fields))
    monkeypatch.setattr(lab04.Config, "tensors", lambda self: fake.tensors(block=None))
    traced = lab04.run(lab04.Config(**SIZE, fake=True, **fields))
    assert list(traced.results) == list(lab04.STRATEGIES) and traced.config.fake
    for s, r in real.results.items():
        t = traced.results[s]
        assert "grads_equal" not in t and t["step_time_s"] is None  # no values, no time
        for key in ("kept_bytes", "activation_peak_bytes", "peak_bytes", "forward_flops", "backward_flops"):
            assert t[key] == r[key] > 0, (s, key)
        assert_same_timeline(real.ledgers[s], traced.ledgers[s])


def test_the_trace_rounds_like_the_cuda_allocator_and_says_what_it_is(lab04, capsys):
    result = lab04.run(lab04.Config(**SIZE, model="small-llama", fake=True, strategy="full"))
    lab04.report(result)
    out = capsys.readouterr().out
    assert "traced on fake tensors" in out and "not compared (traced)" in out and "CPU wall clock" not in out
    assert all(result.results[s][k] % 512 == 0 for s in ("none", "full") for k in ("kept_bytes", "peak_bytes"))
    assert result.summary()["traced"].startswith("traced on fake tensors")


def test_cpu_flash_attention_flops_are_counted_with_torchs_formulas(lab04):
    """FlopCounterMode knows CUDA's fused attention, not the CPU flash kernel a trace takes."""
    costs = load_lab(4, "block_costs")
    q = torch.randn(1, 4, 64, 16, requires_grad=True)
    k, v = (torch.randn(1, 2, 64, 16, requires_grad=True) for _ in range(2))  # grouped-query: 2 KV heads
    with FlopCounterMode(display=False) as plain:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
    assert plain.get_total_flops() == 0  # the gap the mapping fills
    with FlopCounterMode(display=False, custom_mapping=costs.CPU_ATTENTION_FLOPS) as counted:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
    forward = flop_counter.sdpa_flop_count(q.shape, k.shape, v.shape)
    assert counted.get_total_flops() == forward + flop_counter.sdpa_backward_flop_count(q.shape, q.shape, k.shape, v.shape)


def test_the_segment_rule_with_the_heads_peak_at_a_real_vocabulary(lab04):
    """The page's claim at real size, on Llama-3.2-1B's blocks and 128k vocabulary (16 blocks, 1,024
    tokens, bf16): the loss head's peak (fp32 logits) sits on every kept block input, so small k
    peak at the head, large k in the recompute window; the rule with both, its constants from none,
    k = 1 and the largest k, gives every other traced k to the byte, and the lowest peak."""
    at_scale, segments = load_lab(4, "at_scale"), load_lab(4, "segments")
    config = at_scale.config("llama-3.2-1b", 1024)
    n, b = config.depth, config.seq_len * 2048 * 2
    with config.tensors():
        model, x, y = lab04.build_for(config, "cpu")
        memory = segments.sweep(model, x, y, [1, 2, 4, 16])
    rule = segments.compare(memory, n, b, head=True)
    assert rule["head_spike_bytes"] > rule["backward_extra_bytes"] + rule["per_block_bytes"]  # the head peaks at k = 1
    for k, row in rule["predicted"].items():
        assert (row["kept"], row["peak"]) == (memory[k]["kept_bytes"], memory[k]["activation_peak_bytes"]), k
    best = rule["best_k_measured"]
    assert best == rule["best_k_predicted"] and 1 < best < n
    assert memory[best]["activation_peak_bytes"] < memory[1]["activation_peak_bytes"]


# ---------------------------------------------------------------------- the command line
def test_json_summary_schema():
    proc = run_cli(SCRIPT, *SMALL, "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)  # exactly one JSON object on stdout
    assert data["strategies"] == ["none", "full", "every-k", "save-matmuls"] and data["every"] == 2
    for name, r in data["results"].items():
        for key in ("kept_bytes", "activation_peak_bytes", "peak_bytes", "forward_flops", "backward_flops",
                    "recompute_flops"):
            assert isinstance(r[key], int) and r[key] >= 0, (name, key)
        assert r["grads_equal"] is True and len(r["step_times_s"]) == 1 and r["step_time_s"] > 0
        assert -1 < r["activation_reduction"] < 1
    assert data["results"]["none"]["activation_reduction"] == 0
    assert set(data["gpu_targets"]) <= set(data["strategies"])  # targets for the GPU run, named by strategy
    assert data["provenance"]["source_hash"] and data["provenance"]["device_type"] == "cpu"
    assert proc.stderr == ""  # no progress bar under --json


def test_one_strategy_runs_against_none(lab04, capsys):
    lab04.report(lab04.run(lab04.Config(**SIZE, strategy="save-matmuls", steps=1)))
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines() if line.startswith(("none ", "save-matmuls "))]
    assert rows == ["none", "save-matmuls"] and "identical" in out and "CPU wall clock" in out
    assert "Formula against measurement" not in out  # the checks need all four strategies


@pytest.mark.parametrize(("fields", "fragment"), [
    ({"every": 5}, "--every 5 is larger than --layers 4"),
    ({"every": 3, "model": "small-llama", "layers": 8}, "--every 3 is larger than the 2 blocks of --model small-llama"),
    ({"width": 30, "heads": 4}, "not divisible"),
])
def test_the_config_refuses_what_cannot_run(lab04, fields, fragment):
    with pytest.raises(lab04.UsageError, match=fragment):
        lab04.Config(**{**SIZE, **fields})


def test_snapshot_on_cpu_is_refused(lab04, capsys, tmp_path):
    assert_usage_error_in_process(lab04, [*SMALL, "--snapshot", str(tmp_path / "s.pickle")], capsys,
                                  "needs a CUDA device")


def test_bad_input_from_the_command_line():
    assert_clean_usage_error(run_cli(SCRIPT, "--layers", "2", "--every", "3"), "larger than --layers 2")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_gpu_is_one_line(lab04, capsys):
    assert_usage_error_in_process(lab04, ["--device", "cuda"], capsys, "no CUDA GPU")


GPU = {"device": "cuda", "width": 1024, "layers": 16, "heads": 16, "seq_len": 1024, "batch_size": 8, "steps": 10}


@pytest.mark.cuda
def test_cuda_gradients_and_ledger_against_the_allocator(lab04):
    """On a GPU the attention kernel draws its dropout mask itself: the policy must recompute it."""
    size = {"width": 512, "layers": 4, "heads": 8, "seq_len": 512, "batch_size": 8}  # workspaces << peak
    result = lab04.run(lab04.Config(device="cuda", steps=2, **size))
    for name, r in result.summary()["results"].items():
        assert r["grads_equal"] and r["grads_equal_without_ledger"], name
        assert 0.95 <= r["cuda"]["ledger_over_allocator"] <= 1.05, name


@pytest.mark.cuda
def test_cuda_targets_of_the_issue(lab04):
    """The GPU targets in GPU_TARGETS: full >= 60 % activation reduction at <= 35 % overhead;
    save-matmuls >= 40 % at <= 10 %."""
    r = lab04.run(lab04.Config(**GPU)).results
    for name, target in lab04.GPU_TARGETS.items():
        assert r[name]["activation_reduction"] >= target["min_activation_reduction"], (name, r[name])
        assert r[name]["time_overhead"] <= target["max_time_overhead"], (name, r[name])

