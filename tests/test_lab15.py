"""Lab 15: LoRA, QLoRA's NF4 weights and the 8-bit AdamW against the libraries people use (PEFT 0.21.2 and
bitsandbytes 0.50.2, both run on this CPU), every byte of the toy's model state by category, Lab 13's traces
of the methods, and bad input as one line and exit code 2."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json

import pytest
import torch
from conftest import assert_clean_usage_error, assert_usage_error_in_process, load_lab, run_cli

from labkit import fake, labs, marks, zoo
from labkit.ledger import Ledger

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")
F = bnb.functional

lab = labs.load(15)
lora, nf4 = labs.load(15, "lora"), labs.load(15, "nf4")
blockwise, adam8bit = labs.load(15, "blockwise"), labs.load(15, "adam8bit")
SCRIPT = "lab-15-fine-tuning/finetune.py"
EXACT = functools.partial(fake.tensors, block=None)


# ---------------------------------------------------------------- the maps and codebooks
def test_nf4_codebook_is_the_normal_quantiles_and_bitsandbytes_table():
    """NF4 derived from its definition equals the published table to float32 rounding (1 ulp); the table
    is bitsandbytes' exactly."""
    assert torch.equal(nf4.NF4, F.get_4bit_type("nf4", device="cpu"))
    assert (nf4.normal_float() - nf4.NF4).abs().max() <= 1.2e-7
    assert nf4.NF4[7] == 0 and nf4.NF4[0] == -1 and nf4.NF4[-1] == 1  # an exact zero, and the absmax itself


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map_is_bitsandbytes_to_the_bit(signed):
    mine = blockwise.dynamic_map(signed)
    assert torch.equal(mine, F.create_dynamic_map(signed=signed))
    assert mine.numel() == 256 and torch.all(mine[1:] > mine[:-1])


def nearest_everywhere(codes, values, book, others):
    """Our codes are each value's nearest; where bitsandbytes' differ, theirs is never nearer."""
    table = book.values
    ours = (values - table[codes.long()]).abs()
    assert torch.all(ours <= (values.unsqueeze(-1) - table).abs().min(-1).values + 1e-12)
    theirs = (values - table[others.long()]).abs()
    assert torch.all(theirs >= ours)
    return (codes != others).float().mean().item()


@pytest.mark.parametrize("block", [256, 2048])
def test_blockwise_8bit_equals_bitsandbytes_but_for_its_search(block):
    """The same absmax per block, bit for bit. Each code is the nearest map value; bitsandbytes' CPU and
    CUDA kernels search the map in a way that lands one value off now and then: never nearer than ours."""
    torch.manual_seed(0)
    x = torch.randn(50_003) * torch.logspace(-6, 0, 50_003)  # values over six decades, as a moment has
    book = blockwise.Codebook.of(blockwise.dynamic_map(True))
    q = blockwise.quantize_blockwise(x, block, book)
    codes, state = F.quantize_blockwise(x, code=book.values, blocksize=block)
    assert torch.equal(q.absmax, state.absmax)
    scaled = (x.view(-1)[: x.numel() // block * block].view(-1, block) / q.absmax[: x.numel() // block, None]).view(-1)
    n = scaled.numel()
    assert nearest_everywhere(q.codes[:n], scaled, book, codes[:n]) < 0.005
    back = blockwise.dequantize_blockwise(q, book)
    assert (back - x).abs().max() <= q.absmax.max() * 0.01


# ---------------------------------------------------------------- NF4 against bitsandbytes
@pytest.mark.parametrize("shape", [(192, 256), (7, 45)])  # whole blocks; a partial last block and an odd count
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nf4_codes_and_absmax_equal_bitsandbytes(shape, dtype):
    torch.manual_seed(1)
    w = (torch.randn(shape) * 0.02).to(dtype)
    q = nf4.quantize_nf4(w)
    packed, plain = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
    assert torch.equal(q.codes, packed.view(-1))  # two 4-bit codes per byte, the first in the high nibble
    double, nested = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    assert torch.equal(q.codes, double.view(-1))
    assert torch.equal(q.offset, nested.offset) and torch.equal(q.absmax.absmax, nested.state2.absmax)
    centred = plain.absmax - nested.offset  # what double quantization stores in 8 bits
    rows = torch.nn.functional.pad(centred, (0, -centred.numel() % 256)).view(-1, 256)
    scaled = (rows / q.absmax.absmax[:, None]).view(-1)[: centred.numel()]
    nearest_everywhere(q.absmax.codes, scaled, nf4.DYNAMIC, nested.absmax)


def test_nf4_reads_back_as_bitsandbytes_and_within_the_codebooks_bound():
    """Given the same constants, dequantization equals bitsandbytes' in float32 and in bf16; each weight is
    within half the largest gap between NF4 values of its block's absmax, plus the absmax's own rounding."""
    torch.manual_seed(2)
    w = torch.randn(300, 256) * 0.02
    q = nf4.quantize_nf4(w)
    packed, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    state.absmax = q.absmax.codes.clone()  # bitsandbytes' search put a few elsewhere: the same constants here
    assert torch.equal(nf4.dequantize_nf4(q, torch.float32), F.dequantize_4bit(packed, state))
    assert torch.equal(nf4.dequantize_nf4(q, torch.bfloat16), F.dequantize_4bit(packed, state).bfloat16())
    exact = w.view(-1, 64).abs().amax(1)  # the float32 absmax before double quantization
    read = blockwise.dequantize_blockwise(q.absmax, nf4.DYNAMIC) + q.offset
    half_gap = (nf4.NF4[1:] - nf4.NF4[:-1]).max() / 2
    err = (nf4.dequantize_nf4(q, torch.float32) - w).abs().view(-1, 64)
    assert torch.all(err <= (exact * half_gap + (exact - read).abs())[:, None] * (1 + 1e-6))


def test_a_quantized_layer_keeps_nothing_and_passes_the_gradient_to_its_input():
    torch.manual_seed(3)
    linear = torch.nn.Linear(128, 64, bias=False).bfloat16()
    layer = nf4.Linear4bit(linear)
    x = torch.randn(4, 128, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layer(x)
    y.sum().backward()
    w = layer.weight_bf16()
    assert not saved and not any(t.requires_grad for t in layer.buffers())
    assert torch.equal(y, x.detach() @ w.t()) and torch.equal(x.grad, torch.ones_like(y) @ w)


def test_a_quantized_layer_counts_its_weight_read_back_as_dequantized_bytes():
    """One linear read back: its bf16 weight, the absmax read back (4 B per block), and the working copies
    of a chunk (int64 indices of the packed bytes, float32 values: 8 B per value)."""
    layer = nf4.Linear4bit(torch.nn.Linear(256, 128, bias=False))
    ledger = Ledger("cpu")
    with ledger, marks.phase("forward", 0):
        layer(torch.randn(2, 256, dtype=torch.bfloat16))
    n = 256 * 128
    assert max(ledger.timeline().device["dequantized"]) == 2 * n + 4 * (n // 64) + 8 * n


# ---------------------------------------------------------------- LoRA against PEFT
TARGETS = lora.ALL


def peft_twins(base, targets=TARGETS, rank=4, alpha=8.0, dtype=None):
    """Our LoRA and PEFT's on copies of ``base``, with the same A and a random B."""
    return adapters_on(copy.deepcopy(base), copy.deepcopy(base), targets, rank, alpha, dtype)


def adapters_on(ours, theirs, targets, rank, alpha, dtype):
    """Our adapters on ``ours``, PEFT's on ``theirs`` (the same base weights), with the same A and a random B."""
    lora.inject(ours, targets, rank, alpha, dtype=dtype)
    wrapped = peft.get_peft_model(theirs, peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0,
                                                          target_modules=[lora.TARGETS[t] for t in targets]))
    theirs_by = dict(wrapped.named_modules())
    pairs = [(m, theirs_by["base_model.model." + n]) for n, m in ours.named_modules() if isinstance(m, lora.LoRALinear)]
    with torch.no_grad():
        for mine, other in pairs:
            other.lora_B["default"].weight.normal_()
            mine.lora_A.weight.copy_(other.lora_A["default"].weight)
            mine.lora_B.weight.copy_(other.lora_B["default"].weight)
    return ours, wrapped, pairs


def step_ledger(model, idx):
    ledger = Ledger("cpu").track_module(model)
    with ledger:
        with marks.phase("forward", 0):
            logits, loss = model(idx, idx)
        with marks.phase("backward", 0):
            loss.backward()
    return logits, ledger.timeline().peaks_by_phase()


@pytest.mark.parametrize("targets", [TARGETS, ("q", "v")])
def test_lora_gives_peft_outputs_gradients_and_bytes(targets):
    """The zoo's small Llama with our adapters and with PEFT's (same rank, alpha, targets and values):
    equal logits, equal gradients of A and B, and the ledger equal at every phase's peak."""
    torch.manual_seed(4)
    ours, theirs, pairs = peft_twins(zoo.get("small-llama").build(), targets)
    idx = torch.randint(0, 256, (2, 16))
    mine, my_peaks = step_ledger(ours, idx)
    other, their_peaks = step_ledger(theirs, idx)
    assert len(pairs) == 2 * len(targets) and torch.equal(mine, other)
    for m, o in pairs:
        assert torch.equal(m.lora_A.weight.grad, o.lora_A["default"].weight.grad)
        assert torch.equal(m.lora_B.weight.grad, o.lora_B["default"].weight.grad)
    assert my_peaks == their_peaks


def test_qlora_gives_peft_on_bitsandbytes_linear4bit_outputs_and_gradients():
    """bitsandbytes' Linear4bit (NF4, double quantization, bf16 compute) under PEFT's LoRA (fp32 adapters, as
    PEFT makes them on a bf16 base) against our Linear4bit and LoRALinear given the same constants: equal
    logits and equal adapter gradients."""
    torch.manual_seed(5)
    base = zoo.get("small-llama").build().bfloat16()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    for parent in list(theirs.blocks.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=False, compute_dtype=torch.bfloat16,
                                      quant_type="nf4", compress_statistics=True)
                q.weight = bnb.nn.Params4bit(child.weight.data.clone(), requires_grad=False, quant_type="nf4",
                                             compress_statistics=True, blocksize=64)
                setattr(parent, name, q.to("cpu"))
    layers = nf4.quantize_linears(ours.blocks)
    theirs_layers = [m for m in theirs.blocks.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for mine, other in zip(layers, theirs_layers, strict=True):
        assert torch.equal(mine.codes, other.weight.data.view(-1))
        mine.absmax_codes.copy_(other.weight.quant_state.absmax)
    ours, wrapped, pairs = adapters_on(ours, theirs, TARGETS, 4, 8.0, torch.float32)
    idx = torch.randint(0, 256, (2, 16))
    (mine, my_loss), (other, their_loss) = ours(idx, idx), wrapped(idx, idx)
    assert torch.equal(mine, other)
    my_loss.backward()
    their_loss.backward()
    for m, o in pairs:
        assert torch.equal(m.lora_A.weight.grad, o.lora_A["default"].weight.grad)
        assert torch.equal(m.lora_B.weight.grad, o.lora_B["default"].weight.grad)


def test_merge_gives_the_unmerged_output_and_unmerge_restores_the_weight():
    """In float32, up to rounding: the merged layer's output within 1e-5 of the unmerged one's, and W + ΔW - ΔW
    within 2 ulps of |W| + |ΔW| of W."""
    torch.manual_seed(6)
    linear = torch.nn.Linear(64, 48)
    layer = lora.LoRALinear(linear, rank=8, alpha=16)
    torch.nn.init.normal_(layer.lora_B.weight)
    w, delta = linear.weight.detach().clone(), layer.delta().detach()
    x = torch.randn(5, 64)
    before = layer(x)
    layer.merge()
    assert layer.merged and torch.allclose(layer(x), before, atol=1e-5, rtol=0)
    layer.unmerge()
    bound = 2 * torch.finfo(torch.float32).eps * (w.abs() + delta.abs())
    assert not layer.merged and torch.all((linear.weight - w).abs() <= bound)
    assert torch.allclose(layer(x), before, atol=1e-5, rtol=0)
    with pytest.raises(TypeError):
        lora.LoRALinear(nf4.Linear4bit(torch.nn.Linear(64, 48, bias=False)), 8, 16).merge()


# ---------------------------------------------------------------- the 8-bit AdamW
def test_first_8bit_step_equals_bitsandbytes_adamw8bit():
    """From zero state, one step of ours (blocks of 256, as bitsandbytes' kernels) against bnb.optim.AdamW8bit:
    the same parameters bit for bit, the same absmax per block; each code is the nearest and bitsandbytes'
    never nearer."""
    torch.manual_seed(7)
    p1 = torch.nn.Parameter(torch.randn(64, 128))
    p2 = torch.nn.Parameter(p1.detach().clone())
    g = torch.randn(64, 128)
    p1.grad, p2.grad = g.clone(), g.clone()
    ours, theirs = adam8bit.AdamW8bit([p1], lr=1e-2, weight_decay=0.01, block=256), \
        bnb.optim.AdamW8bit([p2], lr=1e-2, weight_decay=0.01)
    ours.step()
    theirs.step()
    state = theirs.state[p2]
    assert torch.equal(p1, p2)
    assert torch.equal(ours.state[p1]["m_absmax"], state["absmax1"]) and torch.equal(ours.state[p1]["v_absmax"], state["absmax2"])
    for name, book, moment, codes, absmax in (("m", adam8bit.SIGNED, 0.1 * g, state["state1"], state["absmax1"]),
                                               ("v", adam8bit.UNSIGNED, 0.001 * g * g, state["state2"], state["absmax2"])):
        scaled = (moment.view(-1, 256) / absmax[:, None]).view(-1)
        nearest_everywhere(ours.state[p1][name].view(-1), scaled, book, codes.view(-1))


def test_8bit_adamw_tracks_fp32_adamw_over_40_steps():
    """The toy Llama fully fine-tuned in fp32 for 40 steps (lr 1e-3, batch 8) with torch's AdamW and with ours
    (the paper's 2,048 blocks): every step's loss within 1 % of fp32 AdamW's, and both learn. (The embedding's
    rows that get no gradient are where 8-bit moments drift most: the paper's stable embedding layer keeps
    32-bit state there.)"""
    def run(optimizer):
        return lab.run(lab.Config(method="full", precision="fp32", optimizer=optimizer, steps=40, lr=1e-3, width=64,
                                  ffn=128, batch_size=8, seq_len=32, device="cpu"))

    exact, eight = run("adamw"), run("adamw8bit")
    assert eight.losses[-1] < eight.losses[0] - 1.0 and exact.losses[-1] < exact.losses[0] - 1.0
    for a, b in zip(exact.losses, eight.losses, strict=True):
        assert abs(a - b) <= 0.01 * a


def test_the_8bit_updates_working_copies_are_what_the_formula_says():
    """adam8bit.working_bytes (the calculator's optimizer temporaries): the ledger's most in the step, for a
    tensor smaller than a chunk and one larger, with float32 and bf16 weights."""
    for dtype, n in ((torch.float32, 40_960), (torch.bfloat16, 40_960), (torch.float32, 2048 * 300)):
        p = torch.nn.Parameter(torch.zeros(n, dtype=dtype))
        p.grad = torch.ones_like(p)
        opt = adam8bit.AdamW8bit([p])
        opt.step()
        ledger = Ledger("cpu").track_module(torch.nn.ParameterList([p])).track_optimizer(opt)
        with ledger, marks.phase("optimizer", 1):
            opt.step()
        chunk = min(n, adam8bit.BLOCK * adam8bit.CHUNK_BLOCKS)
        assert max(ledger.timeline().device["temporaries"]) == adam8bit.working_bytes(chunk, p.element_size())
        assert ledger.current()["optimizer_state"] == adam8bit.state_bytes(n)


# ---------------------------------------------------------------- the toy, every category
@pytest.mark.parametrize("fields", [
    {},  # QLoRA, bf16, 8-bit AdamW: the default run
    {"method": "lora", "precision": "fp32", "optimizer": "adamw", "lora_targets": ("q", "v")},
    {"method": "lora", "precision": "mixed", "lora_dropout": 0.1},
    {"method": "full", "precision": "bf16"},
])
def test_every_model_state_category_of_the_toy_is_exact(fields):
    """Each category's formula against the ledger in the optimizer phase, to the byte; the dequantized
    weights at their most are one linear's read back (the largest); the report names them all."""
    result = lab.run(lab.Config(device="cpu", steps=2, **fields))
    rows = result.checks().rows
    assert rows and all(derived == measured for _, _, derived, measured in rows), rows
    names = {r[0] for r in rows}
    trained = ("trained weights", "gradients") if result.config.method == "full" else ("adapters", "adapter gradients")
    assert {*trained, "optimizer state"} <= names
    quantized = [m for m in result.model.modules() if isinstance(m, nf4.Linear4bit)]
    deq = max(result.ledger.timeline().device["dequantized"])
    if quantized:
        assert {"frozen weights", "quantization constants"} <= names
        n = max(m.in_features * m.out_features for m in quantized)
        assert deq == 2 * n + 4 * (n // 64) + 8 * n
    else:
        assert deq == 0


def test_activations_scale_with_tokens_not_with_the_rank():
    """The lab's point: QLoRA's activations grow with tokens x hidden size; the rank barely moves them."""
    def acts(**fields):
        return max(lab.run(lab.Config(device="cpu", steps=1, **fields)).ledger.timeline().device["activations"])

    base = acts(seq_len=32)
    assert acts(seq_len=64) > 1.9 * base
    assert acts(seq_len=32, lora_rank=32) < 1.2 * base


# ---------------------------------------------------------------- at real size, through Lab 13
@pytest.mark.parametrize("fields", [
    {"method": "lora"}, {"method": "qlora", "precision": "bf16", "checkpointing": "full"},
    {"method": "lora", "lora_dropout": 0.1, "lora_targets": ("q", "v")},
    {"optimizer": "adamw8bit", "precision": "bf16"},
], ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_lab13s_trace_of_each_method_is_the_real_step(fields):
    """Lab 13's step with Lab 15's methods on real CPU tensors and on fake ones: every allocation, every
    category at every phase's peak."""
    from test_labkit_fake import assert_same_timeline

    lab13 = labs.load(13)
    config = lab13.Config(model="small-llama", seq=32, batch=2, levers="none", **fields)
    real = lab13.trace(config, tensors=contextlib.nullcontext)
    traced = lab13.trace(config, tensors=EXACT)
    assert_same_timeline(real.ledger, traced.ledger)
    assert real.derived == traced.derived


def hf_llama3_8b(layers: int) -> dict:
    """Meta-Llama-3-8B's config.json (https://huggingface.co/meta-llama/Meta-Llama-3-8B), the keys that size
    it, with fewer layers."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
            "num_attention_heads": 32, "num_hidden_layers": layers, "num_key_value_heads": 8, "vocab_size": 128256,
            "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
            "hidden_act": "silu"}


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_a_hugging_face_config_traces_the_bytes_of_the_zoos_model(method, tmp_path):
    """Transformers' own Llama built from Llama-3-8B's config (two blocks), our adapters on the modules PEFT
    targets: every category at the peak within 1 % of the zoo's Llama traced the same way."""
    lab13 = labs.load(13)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf_llama3_8b(2)))
    hf = lab13.trace(lab13.Config(model=str(path), method=method, precision="bf16", seq=512, levers="none"))
    config = lab13.Config(model="llama-3-8b", method=method, precision="bf16", seq=512, levers="none")
    config.__dict__["spec"] = dataclasses.replace(zoo.get("llama-3-8b"), layers=2)
    ours = lab13.trace(config)
    a, b = hf.derived["peak"], ours.derived["peak"]
    assert abs(a["total"] - b["total"]) <= 0.01 * b["total"], (a, b)
    for k in ("parameters", "frozen_weights", "quant_constants", "optimizer_state", "activations"):
        assert abs(a[k] - b[k]) <= 0.01 * b["total"], (k, a[k], b[k])


def test_our_targets_are_the_modules_peft_wraps_in_a_hugging_face_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in hf_llama3_8b(2).items() if k not in ("architectures", "model_type")}
                         | {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                            "num_key_value_heads": 2, "vocab_size": 256})
    for targets in (TARGETS, ("q", "v"), ("gate", "down")):
        ours, theirs = LlamaForCausalLM(config), LlamaForCausalLM(config)
        wrapped_here = lora.inject(ours, targets, rank=2)
        mine = {n for n, m in ours.named_modules() if any(m is w for w in wrapped_here)}
        wrapped = peft.get_peft_model(theirs, peft.LoraConfig(r=2, target_modules=[lora.TARGETS[t] for t in targets]))
        peft_names = {n.removeprefix("base_model.model.") for n, m in wrapped.named_modules()
                      if isinstance(m, peft.tuners.lora.LoraLayer)}
        assert mine == peft_names and len(mine) == 2 * len(targets)


# ---------------------------------------------------------------- the command line
def test_the_default_run_reports_every_category_and_its_check():
    proc = run_cli(SCRIPT, "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    for name in ("frozen weights", "quantization constants", "adapters", "adapter gradients", "optimizer state",
                 "Dequantized weights at their most"):
        assert name in proc.stdout, name
    summary = json.loads(run_cli(SCRIPT, "--device", "cpu", "--steps", "1", "--json").stdout)
    assert summary["model_state"]["frozen_weights"] > 0 and summary["config"]["method"] == "qlora"


@pytest.mark.parametrize(("args", "fragment"), [
    (["--lora-rank", "0"], "--lora-rank must be in [1,"),
    (["--lora-rank", "65"], "larger than min(in, out) = 64 of the k projection"),
    (["--lora-targets", "q,w"], "unknown: w"),
    (["--method", "qlora", "--precision", "fp32"], "--precision bf16 or mixed"),
    (["--nf4-block", "0"], "--nf4-block must be in [1,"),
    (["--optimizer-block", "0"], "--optimizer-block must be in [1,"),
])
def test_bad_input_is_one_line_and_exit_2(args, fragment, capsys):
    """The first case in a fresh interpreter, the rest in this process."""
    if args == ["--lora-rank", "0"]:
        assert_clean_usage_error(run_cli(SCRIPT, "--device", "cpu", *args), fragment)
    else:
        assert_usage_error_in_process(load_lab(15), ["--device", "cpu", *args], capsys, fragment)


@pytest.mark.parametrize(("args", "fragment"), [
    (["--method", "lora", "--lora-rank", "0"], "--lora-rank must be in [1,"),
    (["--method", "lora", "--lora-rank", "1025"], "larger than min(in, out) = 1024"),
    (["--method", "qlora", "--lora-targets", "q,x"], "unknown: x"),
    (["--method", "qlora", "--precision", "fp32"], "--precision bf16 or mixed"),
    (["--method", "lora", "--model", "gpt-3-175b"], "which has none"),
    (["--lora-dropout", "0.1"], "needs --method lora or qlora"),
    (["--method", "lora", "--task", "infer"], "--task infer"),
])
def test_lab13_refuses_the_same_in_one_line(args, fragment, capsys):
    assert_usage_error_in_process(load_lab(13), ["--model", "llama-3-8b", *args], capsys, fragment)
