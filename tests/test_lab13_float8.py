"""Lab 13's --float8 (fit_float8.py): the float8 linear against exact arithmetic and against the bf16 linear,
what it keeps for backward, and its bad input."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, assert_usage_error_in_process, load_lab

from labkit import zoo
from labkit.config import UsageError

# Unit roundoff (half the spacing between neighbours, relative) of each format's normal numbers:
# e4m3 keeps 3 mantissa bits, e5m2 2, bf16 7.
U_E4M3, U_E5M2, U_BF16 = 2.0**-4, 2.0**-3, 2.0**-8


@pytest.fixture(scope="module")
def f8():
    return load_lab(13, "fit_float8")


def magnitudes(*shape, generator):
    """Random signs and magnitudes in [0.01, 1]: every element a normal number of e4m3 and e5m2 once the
    largest is scaled to the format's largest (a ratio of 100, far inside both formats' normal range)."""
    sign = torch.randint(0, 2, shape, generator=generator) * 2 - 1
    return sign * (0.01 + 0.99 * torch.rand(shape, generator=generator, dtype=torch.float64))


def test_a_cast_rounds_each_element_within_the_formats_unit_roundoff(f8):
    g = torch.Generator().manual_seed(0)
    x = magnitudes(64, 48, generator=g).float()
    for dtype, u in ((f8.E4M3, U_E4M3), (f8.E5M2, U_E5M2)):
        bits, inverse = f8.to_float8(x, dtype)
        assert bits.dtype == dtype and bits.float().abs().max() == torch.finfo(dtype).max  # amax lands on the max
        back = bits.float() * inverse
        assert ((back - x).abs() <= u * x.abs() * (1 + 1e-6)).all()
        assert (back != x).any()  # it did round: 23 mantissa bits do not fit in 3 or 2


def test_the_float8_matmuls_are_within_the_bound_of_their_roundings(f8):
    """Output and both gradients of a Float8Linear against float64 arithmetic, norm-wise: each product rounds
    its two operands (relative error u₁ + u₂ + u₁u₂ of |a||b|) and the bf16 result once more. Forward is
    e4m3 × e4m3; both gradients multiply e5m2 (the output's gradient) by e4m3. The error must also exceed
    bf16's own rounding: the float8 roundings happened."""
    g = torch.Generator().manual_seed(1)
    x, w, grad = magnitudes(32, 64, generator=g), magnitudes(48, 64, generator=g), magnitudes(32, 48, generator=g)
    linear = f8.Float8Linear(64, 48, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(w)
    xb = x.to(torch.bfloat16).requires_grad_()
    y = linear(xb)
    y.backward(grad.to(torch.bfloat16))
    xr, wr, gr = xb.detach().double(), linear.weight.detach().double(), grad.to(torch.bfloat16).double()
    checks = {"output": (y, xr @ wr.T, xr.abs() @ wr.abs().T, U_E4M3),
              "input gradient": (xb.grad, gr @ wr, gr.abs() @ wr.abs(), U_E5M2),
              "weight gradient": (linear.weight.grad, gr.T @ xr, gr.abs().T @ xr.abs(), U_E5M2)}
    for name, (got, exact, scale, u) in checks.items():
        products = (u + U_E4M3 + u * U_E4M3) * scale.norm()  # fp32 accumulation adds ~1e-7 of it: the 1.001
        bound = 1.001 * products * (1 + U_BF16) + U_BF16 * exact.norm()
        error = (got.double() - exact).norm()
        assert error <= bound, name
        assert error > U_BF16 * exact.norm(), f"{name}: no float8 rounding seen"


def test_a_small_llama_in_float8_trains_like_the_bf16_one_within_a_stated_tolerance(f8):
    """The whole toy Llama, bf16 weights: loss within 1 % and every gradient within 25 % (norm-wise) of the
    bf16 model's. e5m2's 2 mantissa bits round each element of every output gradient by up to 12.5 %
    (and e4m3's 3 bits the operands by up to 6.25 %); over two blocks that compounds to about 10 % here,
    while the loss, a mean over every token, moves by less than 0.1 %."""
    torch.manual_seed(0)
    plain = zoo.get("small-llama").build().bfloat16()
    converted = copy.deepcopy(plain)
    assert f8.convert(converted) == 14  # 2 blocks x (q, k, v, o, gate, up, down); not the head
    idx = torch.randint(0, plain.spec.vocab, (2, 32))
    results = []
    for model in (plain, converted):
        loss = model(idx, idx)[1]
        loss.backward()
        results.append((loss.float().item(), {n: p.grad.float() for n, p in model.named_parameters()}))
    (want, want_grads), (got, got_grads) = results
    assert abs(got - want) <= 0.01 * abs(want)
    for name, grad in want_grads.items():
        assert (got_grads[name] - grad).norm() <= 0.25 * grad.norm(), name
    assert any(not torch.equal(got_grads[n], g) for n, g in want_grads.items())


class KeepGradients:
    """An optimizer that keeps the gradients its step finds (a copy of each) and changes nothing."""

    def __init__(self, model) -> None:
        self.model, self.grads = model, {}

    def step(self) -> None:
        self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


@pytest.mark.parametrize("precision", ["mixed", "bf16"])
def test_a_float8_pipeline_stage_gives_the_unsplit_float8_models_loss_and_gradients(f8, precision):
    """--float8 tensorwise --pp 2: small-llama's float8 linears cut into two stages. Stage 0 (its embedding and first
    block, fit_pipeline.first_stage) runs Lab 13's own 1F1B schedule over three micro-batches; stage 1 (the second
    block, the final norm, the head, the loss) runs each micro-batch when its gradient is asked for. The loss and every
    gradient equal the same float8 model's run unsplit over the same micro-batches, bit for bit: each op sees the same
    inputs, and each tensorwise scale is the same tensor's largest magnitude (stated tolerance: none)."""
    pipeline, lab03 = load_lab(13, "fit_pipeline"), load_lab(3)
    torch.manual_seed(0)
    weights, recipe = {"mixed": (torch.float32, "bf16"), "bf16": (torch.bfloat16, "fp32")}[precision]
    whole = zoo.get("small-llama").build().to(weights)
    assert f8.convert(whole) == 14
    first, second = copy.deepcopy(whole), copy.deepcopy(whole)
    first.blocks = first.blocks[:1]
    pipeline.first_stage(first)
    idx, micro_batches = torch.randint(0, whole.spec.vocab, (2, 32)), 3
    in_order = lambda blocks, x: functools.reduce(lambda h, block: block(h), blocks, x)  # noqa: E731
    losses = []

    def stage_1(out):  # the next stage: its forward and backward of one micro-batch; the gradient it sends back
        received = out.detach().requires_grad_()
        with lab03.autocast(recipe, idx.device):
            loss = second(idx, idx, run_blocks=lambda blocks, x: in_order(blocks[1:], received))[1]
        (loss / micro_batches).backward()
        losses.append(loss.detach())
        return received.grad

    optimizer = KeepGradients(first)
    pipeline.first_stage_step(first, optimizer, idx, recipe=recipe, blocks=in_order, stages=2,
                              accumulation=micro_batches, receive=stage_1)
    want = []
    for _ in range(micro_batches):
        with lab03.autocast(recipe, idx.device):
            loss = whole(idx, idx)[1]
        (loss / micro_batches).backward()
        want.append(loss.detach())
    assert len(losses) == micro_batches and all(torch.equal(a, b) for a, b in zip(losses, want))
    got = {n: g for n, g in optimizer.grads.items()} | {n: p.grad for n, p in second.named_parameters()
                                                        if p.grad is not None}
    grads = {n: p.grad for n, p in whole.named_parameters()}
    assert set(got) == set(grads) and {n for n, p in second.named_parameters() if p.grad is not None} == \
        {n for n in grads if not n.startswith(("embed", "blocks.0."))}
    for name, grad in grads.items():
        assert torch.equal(got[name], grad), name


def test_a_float8_linear_keeps_what_a_bf16_linear_keeps_and_under_autocast_no_weight_cast():
    """torchao's default saves the high-precision operands. In pure bf16 that is what a plain linear saves: the
    same activations and the same peak. Under torch AMP autocast saves a bf16 cast of every linear's weight for
    backward; the float8 linear saves the fp32 weight itself and the same bf16 input, so the traced weight casts
    at the turn to backward are only the head's."""
    lab13 = load_lab(13)
    for precision in ("bf16", "mixed"):
        config = lab13.Config(model="small-llama", seq=32, batch=2, levers="none", precision=precision,
                              optimizer="adamw-fused")
        plain, float8 = lab13.trace(config), lab13.trace(dataclasses.replace(config, float8="tensorwise"))
        if precision == "bf16":
            assert float8.per_rank_peak_bytes == plain.per_rank_peak_bytes
            assert float8.derived["category_max"] == plain.derived["category_max"]
        else:
            head = 2 * config.spec.vocab * config.spec.width
            assert plain.derived["weight_casts"]["at_activations_max"] > head
            assert float8.derived["weight_casts"]["at_activations_max"] == head
            assert float8.per_rank_peak_bytes < plain.per_rank_peak_bytes


@pytest.mark.parametrize(("args", "fragment"), [
    (["--model", "small-llama", "--float8", "tensorwise", "--precision", "fp32"], "--precision mixed or bf16"),
    (["--model", "code/lab-13-will-it-fit/examples/qwen2.5-0.5b.config.json", "--float8", "tensorwise"],
     "dense zoo Llama"),
])
def test_float8_bad_input_is_one_line_and_exit_2(args, fragment, capsys):
    """In this process (test_lab13 runs one of fit.py's refusals in a fresh interpreter)."""
    assert_usage_error_in_process(load_lab(13), args, capsys, fragment)


@pytest.mark.parametrize(("fields", "fragment"), [
    ({"checkpointing": "save-matmuls"}, "_scaled_mm"), ({"checkpointing": "save-alternate-matmuls"}, "_scaled_mm"),
    ({"task": "infer"}, "--float8 needs a backward"),
    ({"model": "small-mixtral"}, "dense zoo Llama"),
    ({"float8": "tensorwise-all-gather", "tp": 2, "dp": 2, "zero_stage": 3}, "tensorwise-all-gather with --tp is not"),
])
def test_float8_refuses_what_it_does_not_trace(fields, fragment):
    lab13 = load_lab(13)
    with pytest.raises(UsageError, match=re.escape(fragment)):
        lab13.Config(**{"model": "small-llama", "float8": "tensorwise", **fields})


def test_fsdp_float8_all_gather_halves_the_gathered_linears_derived(f8):
    """The derived figure the page gives for torchao's enable_fsdp_float8_all_gather: a block's gathered bytes
    are its linears at 1 B (plus one fp32 scale each) and its two norms at 2 B, against 2 B for all of it;
    counted off the zoo's block, which the zoo's closed-form parameter count confirms."""
    spec = zoo.get("llama-3-8b")
    out = f8.fsdp_float8_all_gather(spec, dp=8)
    per_block = (spec.param_count() - dataclasses.replace(spec, layers=1).param_count()) // (spec.layers - 1)
    assert out["block"] == per_block and out["linears"] == per_block - 2 * spec.width and out["scales"] == 7
    assert out["block_bf16"] == 2 * per_block
    assert out["block_float8"] == out["linears"] + 4 * spec.width + 4 * 7
    assert out["received_float8"] == 2 * spec.layers * out["block_float8"] * 7 // 8


def test_the_float8_step_under_tp_equals_the_one_rank_float8_step(tmp_path):
    """--float8 tensorwise --tp 2, with and without --sp (fit_float8_tp.py: torchao's float8 TP styles, every scale
    the whole tensor's): two real gloo ranks (tests/float8_tp_ranks.py) give the one-rank float8 step's loss and
    gradients. In fp32, where the ranks' partial sums round as one sum does: the loss within 1e-6 and each
    gradient within 1e-5 of its norm (the block linears' to the bit, the norms' within float32 rounding)."""
    out = tmp_path / "ranks.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "float8_tp_ranks.py"), str(out), str(tmp_path / "meet")],
                          cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "code")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result) == {"sp=False", "sp=True"}
    for run in result.values():
        assert run["loss"] <= 1e-6 and len(run["grads"]) > 10
        assert all(d <= 1e-5 for d in run["grads"].values()), run["grads"]
        assert all(d == 0 for n, d in run["grads"].items() if n.endswith("proj.weight") and "blocks" in n)
