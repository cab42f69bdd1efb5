"""Lab 14, the budget as an engine sizes it: quantized weights (real int4 and int8 code, exact bytes),
vLLM's budget terms one by one, CUDA graphs, speculative decoding, latent attention (MLA), the 24 GB
cards, real model names, the decode bound, and the budget held against published vLLM logs."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_usage_error_in_process

from labkit import fake, labs, marks, zoo
from labkit.ledger import Ledger

lab = labs.load(14)
quantize = labs.load(14, "quantize")
budget = labs.load(14, "serving_budget")
report = labs.load(14, "serving_report")
speed = labs.load(14, "serving_speed")
logs = labs.load(14, "serving_logs")
pk = labs.load(14, "paged_kv")
fit_gpus = labs.load(13, "fit_gpus")
GIB = 2**30
L8B = zoo.get("llama-3-8b")


# ---------------------------------------------------------------------- quantized weights, real code
@pytest.mark.parametrize(("fmt", "group"), [("int4-awq", 128), ("int4-awq", 32), ("int4-gptq", 64), ("int8", None)])
def test_quantized_weights_are_within_half_a_step_their_bytes_are_the_formats_and_the_product_is_exact(fmt, group):
    """A real (out, in) matrix through the lab's quantizer: every stored tensor's bytes add up to what the
    format lists (vLLM's create_weights), each dequantized weight is within half a quantization step of
    the original (rounding to the nearest level; plus the fp16 scale's own rounding), and the group-wise
    product equals F.linear on the
    dequantized matrix within 1e-5 of its largest output (float32 summation order)."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(96, 512, generator=g), torch.randn(7, 512, generator=g)
    t = quantize.quantize(w, fmt, group)
    assert sum(v.nbytes for v in t.values()) == quantize.FORMATS[fmt].nbytes(96, 512, group)
    assert {k: v.dtype for k, v in t.items()} == {k: d for k, (_, d) in quantize.FORMATS[fmt].tensors(96, 512, group).items()}
    deq = quantize.QUANTIZERS[fmt][1](t)
    # half a step; an int4 scale is stored in fp16, off by at most 2**-11 of a step, 15 steps from the zero
    assert ((w - deq).abs() <= quantize.error_bound(t) + 15 * 2**-11 * 2 * quantize.error_bound(t) + 1e-7).all()
    ref = F.linear(x, deq)
    assert (quantize.linear(x, t) - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_packing_four_bits_is_lossless_and_the_bytes_per_weight_are_the_formats():
    q = torch.randint(0, 16, (5, 64))
    assert torch.equal(quantize.unpack4(quantize.pack4(q)), q)
    f = quantize.FORMATS
    per_weight = {name: f[name].nbytes(4096, 4096) / 4096**2 for name in f}
    assert per_weight["bf16"] == 2 and per_weight["fp8"] == 1 + 4 / 4096**2
    assert per_weight["int4-awq"] == 0.5 + (2 + 0.5) / 128  # a 4-bit zero and an fp16 scale per 128 weights
    assert per_weight["int4-gptq"] == per_weight["int4-awq"] + 4 / 4096  # and g_idx, an int32 per input
    assert per_weight["nvfp4"] == 0.5 + 1 / 16 + 8 / 4096**2  # an fp8 scale per 16, two fp32 scales per matrix
    assert per_weight["int8"] == 1 + 4 / 4096


def test_llama_3_8b_in_int4_keeps_its_embedding_and_head_in_bf16_and_the_count_is_every_tensors():
    with torch.device("meta"):
        model = L8B.build()
    picked = quantize.quantized_linears(model)
    assert len(picked) == 7 * 32 and not any(n in ("head",) for n, *_ in picked)
    table = L8B.vocab * L8B.width
    expected = 2 * (2 * table + 65 * L8B.width) + 32 * sum(
        quantize.FORMATS["int4-awq"].nbytes(o, i) for _, o, i in picked[:7])
    assert quantize.model_bytes(model, "int4-awq") == expected
    assert 5 * GIB < budget.weight_bytes(L8B, weights="int4-awq") < 5.5 * GIB < 8 * GIB < budget.weight_bytes(
        L8B, weights="fp8") < 9 * GIB


def test_the_counted_weights_are_the_traced_ones():
    """The budget counts bf16 weights from the model's shapes (each tensor in 512-byte blocks): the same
    bytes the ledger traces on fake tensors for the whole model."""
    for spec, tp in ((L8B, 1), (zoo.get("llama-3-70b"), 4), (zoo.get("small-deepseek"), 1)):
        with fake.tensors():
            model = fake.materialize(budget.per_gpu_spec(spec, tp).build, dtype=torch.bfloat16)
            ledger = Ledger("cpu").track_module(model)
            with ledger, marks.phase("loaded"):
                torch.zeros(1)
        assert budget.weight_bytes(spec, tp=tp) == ledger.timeline().peaks_by_phase()["loaded"]["parameters"], spec.name


@pytest.mark.parametrize("name", ["small-llama", "small-deepseek", "small-mixtral"])
def test_a_trace_of_two_blocks_has_the_whole_models_activation_peak(name):
    spec = dataclasses.replace(zoo.get(name), layers=5)
    for kwargs in (dict(batch=1, context=100, new=100), dict(batch=1, context=100, new=48),
                   dict(batch=3, context=100, new=1)):
        whole, two = (budget.trace_step(spec, whole=w, tensors=lambda: fake.tensors(block=None), **kwargs)
                      for w in (True, False))
        assert whole["activations"] == two["activations"] > 0, kwargs


def test_quantized_weights_give_their_bytes_to_the_kv_pool():
    """int4 AWQ on Llama-3-8B: the weights' saving goes to the pool, byte for byte (the rest is unchanged)."""
    bf16, int4 = (budget.plan(L8B, seq_len=8192, weights=w) for w in ("bf16", "int4-awq"))
    assert int4.kv_pool_bytes - bf16.kv_pool_bytes == bf16.weights_bytes - int4.weights_bytes > 9 * GIB
    assert int4.prefill_peak_bytes == bf16.prefill_peak_bytes and int4.cuda_graph_bytes == bf16.cuda_graph_bytes


@pytest.mark.parametrize(("argv", "fragment"), [
    (["--weights", "int4-awq", "--group-size", "100"], "a group size of 100 does not divide its input dimension 4096"),
    (["--weights", "fp8", "--group-size", "64"], "--weights fp8 has none to set"),
    (["--draft-model", "llama-3-70b"], "is not smaller than llama-3-8b"),
    (["--draft-model", "mixtral-8x7b"], "is not smaller"),
    (["--draft-model", "small-llama"], "its vocabulary (256) is not llama-3-8b's"),
    (["--kv-layout", "latent"], "llama-3-8b has none"),
    (["--model", "deepseek-v2-lite", "--tp", "3"], "--tp 3 does not split"),
])
def test_a_format_draft_or_layout_the_model_cannot_take_is_one_line(capsys, argv, fragment):
    base = [] if "--model" in argv else ["--model", "llama-3-8b"]
    assert_usage_error_in_process(lab, ["--device", "cpu", *base, *argv], capsys, fragment)


# ---------------------------------------------------------------------- vLLM's budget, term by term
@pytest.fixture(scope="module")
def h100():
    return budget.plan(L8B, seq_len=8192)


def test_the_engine_may_use_the_cards_total_times_the_flag_and_the_context_stays_outside(h100):
    """vLLM's requested memory is total x gpu_memory_utilization (the total, not what is free); the CUDA
    context and NCCL, made before its baseline snapshot, live in the share the flag leaves out."""
    assert h100.usable_bytes == int(fit_gpus.GPUS["h100-80gb"].total_bytes * 0.9)
    assert h100.outside_bytes == h100.gpu_bytes - h100.usable_bytes
    assert h100.kv_pool_bytes == (h100.usable_bytes - h100.weights_bytes - h100.prefill_peak_bytes
                                  - h100.non_torch_bytes - h100.cuda_graph_bytes)
    assert fit_gpus.CUDA_CONTEXT_BYTES < h100.outside_bytes  # Lab 13's context fits the share left out


def test_each_term_moves_the_pool_by_its_own_bytes(h100):
    more = budget.plan(L8B, seq_len=8192, non_torch_bytes=budget.NON_TORCH_BYTES + GIB)
    assert h100.kv_pool_bytes - more.kv_pool_bytes == GIB
    eager = budget.plan(L8B, seq_len=8192, cuda_graphs=False)
    assert eager.kv_pool_bytes - h100.kv_pool_bytes == h100.cuda_graph_bytes > 0 == eager.cuda_graphs
    tighter = budget.plan(L8B, seq_len=8192, utilization=0.8)
    assert h100.kv_pool_bytes - tighter.kv_pool_bytes == h100.usable_bytes - tighter.usable_bytes


def test_vllms_capture_sizes_are_the_ones_its_logs_count():
    """Default max_num_seqs 256: 51 piecewise graphs up to 512 tokens and 35 full ones up to 256 (a vLLM
    log: 'PIECEWISE=51, FULL=35'); max_num_seqs 8 with 3 speculative tokens: 'PIECEWISE=9 (largest=64),
    FULL=5 (largest=32)' (vLLM 0.22.0's log, quoted in serving_budget's sources)."""
    piecewise, full = budget.capture_sizes(256)
    assert (len(piecewise), max(piecewise), len(full), max(full)) == (51, 512, 35, 256)
    piecewise, full = budget.capture_sizes(8, speculative_tokens=3, max_batched_tokens=32768)
    assert (len(piecewise), max(piecewise), len(full), max(full)) == (9, 64, 5, 32)


def test_cuda_graph_memory_is_the_first_captures_traced_forward_and_a_floor_per_further_graph(h100):
    first = budget.trace_step(L8B, batch=512, context=16, new=1, logits=False)["activations"]
    assert h100.cuda_graph_bytes == first + (51 - 1 + 35 - 1) * budget.GRAPH_FLOOR
    assert h100.cuda_graphs == 86 and h100.largest_graph == 512
    few = budget.plan(L8B, seq_len=8192, max_num_seqs=8)
    assert few.cuda_graph_bytes < h100.cuda_graph_bytes and few.largest_graph == 16


def test_the_24_gb_cards_are_accepted_and_a_real_models_name_serves_at_real_size():
    run = lab.run(lab.Config(model="llama-3-8b", gpu="l4-24gb", requests=20, output_lens=(16, 64)))
    b = run.budget
    assert b.gpu_bytes == fit_gpus.GPUS["l4-24gb"].total_bytes and 0 < b.kv_pool_bytes < 5 * GIB
    assert run.config.real_size and run.pool_tokens == b.max_tokens_in_flight and run.identical_tokens() is None
    assert lab.GPUS == tuple(fit_gpus.GPUS)  # every card of Lab 13's table
    for gpu in ("a10-24gb", "rtx4090-24gb"):
        assert lab.Config(model="llama-3-8b", gpu=gpu, weights="int4-awq").gpu == gpu


# ---------------------------------------------------------------------- speculative decoding, MLA, bandwidth
def test_a_draft_models_weights_and_kv_join_the_budget():
    target, draft = zoo.get("llama-3.1-8b"), zoo.get("llama-3.2-1b")
    alone = budget.plan(target, seq_len=8192)
    paired = budget.plan(target, seq_len=8192, draft=draft, speculative_tokens=3)
    assert paired.draft_weights_bytes == budget.weight_bytes(draft)
    assert paired.kv_bytes_per_token == alone.kv_bytes_per_token + draft.kv_bytes_per_token(2)
    assert paired.largest_graph == 512 and paired.cuda_graphs > alone.cuda_graphs  # sizes rounded to 4s, more FULL
    assert paired.sequences(8192) < alone.sequences(8192)


def test_deepseek_caches_a_latent_far_smaller_than_grouped_query_kv():
    ds = zoo.get("deepseek-v2-lite")
    assert ds.kv_bytes_per_token(2) == 27 * (512 + 64) * 2  # 30.4 KiB a token, against Llama-3-8B's 128 KiB
    latent = budget.plan(ds, seq_len=4096)
    expanded = budget.plan(ds, seq_len=4096, kv_layout="per-head")
    assert latent.kv_layout == "latent" and latent.kv_bytes_per_token == ds.kv_bytes_per_token(2)
    assert expanded.kv_bytes_per_token == 27 * 16 * (128 + 64 + 128) * 2
    assert latent.max_tokens_in_flight > 7 * expanded.max_tokens_in_flight
    assert budget.plan(ds, seq_len=4096, tp=2).kv_bytes_per_token == latent.kv_bytes_per_token  # replicated


def test_the_decode_bound_beside_each_budget_is_bandwidth_over_bytes_read(h100):
    one, full = report.decode_bounds(h100)
    bw = speed.BANDWIDTHS["h100-80gb"].value
    n = h100.sequences(8192)
    assert h100.read_bytes == h100.weights_bytes  # a dense model reads every weight
    assert one == bw / (h100.weights_bytes + 8192 * h100.kv_bytes_per_token)
    assert full == n * bw / (h100.weights_bytes + n * 8192 * h100.kv_bytes_per_token) > 10 * one
    int4 = budget.plan(L8B, seq_len=8192, weights="int4-awq")
    assert report.decode_bounds(int4)[0] > 1.5 * one  # fewer bytes a step: faster decode
    mixtral = budget.plan(zoo.get("mixtral-8x7b"), gpu="h200-141gb", seq_len=4096)
    expert = 3 * 4096 * 14336 * 2  # bf16, one SwiGLU expert
    assert mixtral.weights_bytes - mixtral.read_bytes == 32 * (8 - 2) * expert  # a token reads 2 of 8 experts
    assert set(speed.BANDWIDTHS) == set(fit_gpus.GPUS)
    assert all(re.match(r"https://[\w.]*(nvidia|amd)\.com/", c.sources[0]) for c in speed.BANDWIDTHS.values())  # the maker's


# ---------------------------------------------------------------------- held against vLLM's logs
def test_the_budget_against_published_vllm_logs():
    """Every log's pool gap is the sum of its terms' gaps (the same sum, term by term); weights within
    0.25 % in bf16 and int8, and within 2 % for Meta's FP8 checkpoint once its own recipe is followed; at
    least five logs on two card sizes."""
    assert len(logs.LOGS) >= 5 and len({log.card for log in logs.LOGS if log.total_gib}) >= 2
    _, _, plans = logs.compare()
    for b, log in zip(plans, [log for log in logs.LOGS if log.kv_gib is not None]):
        terms = ((log.weights_gib * GIB - b.weights_bytes) + (log.activations_gib * GIB - b.prefill_peak_bytes)
                 + (log.non_torch_gib * GIB - b.non_torch_bytes))
        assert abs((b.kv_pool_bytes - log.kv_gib * GIB) - terms) < 0.02 * GIB, log  # the logs print two decimals
        assert log.mechanisms and all(m in logs.MECHANISMS for m in log.mechanisms)
    weights = {row[0] + row[2] + str(row[3]): row for row in logs.weights_table().rows}
    for row in weights.values():
        assert abs(row[8]) < (0.02 if row[4] == "fp8" else 0.0025), row
