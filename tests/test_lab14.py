"""Lab 14: the paged KV cache (allocator, block tables, prefix sharing, copy-on-write), gather attention
equal to contiguous attention, the three caches giving the same tokens, continuous batching with
preemption and rejection, the waste bound at every step, trace files, and the serving budget."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import re
from pathlib import Path

import pytest
import torch
from conftest import assert_usage_error_in_process, run_cli

from labkit import fake, labs, marks, zoo
from labkit.ledger import Ledger
from labkit.table import format_bytes

lab = labs.load(14)
pk = labs.load(14, "paged_kv")
base = labs.load(14, "kv_baselines")
sm = labs.load(14, "serving_model")
trace = labs.load(14, "serving_trace")
budget = labs.load(14, "serving_budget")
report = labs.load(14, "serving_report")
ROOT = Path(__file__).resolve().parents[1]

SCRIPT = "lab-14-serving-memory/serve_memory.py"
SMALL = dict(device="cpu", requests=12, prompt_lens=(4, 24), output_lens=(2, 20), pool_tokens=288)
SPEC = zoo.get("small-llama")


def store(slots=64, kv_heads=2, head_dim=8, layers=1, kv_dtype="fp32"):
    return pk.KVStore(layers=layers, slots=slots, kv_heads=kv_heads, head_dim=head_dim, kv_dtype=kv_dtype)


def recount(cache) -> int:
    """Slots holding tokens, counted from the block tables (a shared block once)."""
    seen, total = set(), 0
    for seq, table in cache.tables.items():
        for i, block in enumerate(table):
            if block not in seen:
                seen.add(block)
                total += min(cache.block_size, cache.lengths[seq] - i * cache.block_size)
    return total


# ---------------------------------------------------------------------- the allocator and the block tables
def test_blocks_are_handed_out_and_return_when_their_last_holder_lets_go():
    a = pk.BlockAllocator(3)
    first, second = a.allocate(), a.allocate()
    a.share(first)
    a.release(first)
    assert first not in a.free and a.refs[first] == 1
    a.release(first)
    a.release(second)
    assert sorted(a.free) == [0, 1, 2] and a.refs == [0, 0, 0]
    for _ in range(3):
        a.allocate()
    with pytest.raises(pk.NoFreeBlock):
        a.allocate()


def test_decode_appends_a_block_only_when_the_last_one_is_full_and_finish_frees_them():
    cache = pk.PagedKVCache(store(slots=32), block_size=4)
    assert cache.admit(0, 5) == 0 and len(cache.tables[0]) == 2
    for length in range(6, 9):
        assert cache.grow(0) and len(cache.tables[0]) == 2, length
    assert cache.grow(0) and len(cache.tables[0]) == 3 and cache.lengths[0] == 9
    assert cache.held_slots() == 12 and cache.stored_slots() == 9 == recount(cache) and cache.waste() == (3, 0)
    cache.free(0)
    assert len(cache.allocator.free) == 8 and cache.held_slots() == cache.stored_slots() == 0


def test_a_full_pool_refuses_without_changing_anything():
    cache = pk.PagedKVCache(store(slots=8), block_size=4)
    assert cache.admit(0, 8) == 0
    assert cache.admit(1, 1) is None and 1 not in cache.tables
    assert not cache.grow(0) and cache.lengths[0] == 8 and len(cache.tables[0]) == 2


def test_copy_on_write_copies_a_shared_partial_block_before_appending_and_keeps_the_parents_tokens():
    s = store(slots=32)
    cache = pk.PagedKVCache(s, block_size=4)
    cache.admit(0, 6)
    k = torch.randn(6, 2, 8)
    s.write(0, torch.tensor(cache.slots(0, 0, 6)), k, -k)
    cache.fork(0, 1)  # both hold blocks (a, b); b is partly filled
    shared_tail = cache.tables[0][-1]
    assert cache.allocator.refs[shared_tail] == 2 and cache.held_slots() == 8
    assert cache.grow(1)  # the child appends into the shared tail: it gets its own copy first
    assert cache.tables[1][-1] != shared_tail and cache.tables[1][0] == cache.tables[0][0]
    assert cache.allocator.refs[shared_tail] == 1
    new = torch.full((1, 2, 8), 9.0)
    s.write(0, torch.tensor(cache.slots(1, 6, 7)), new, new)
    parent, _ = s.read(0, torch.tensor(cache.slots(0, 0, 6)), torch.float32)
    child, _ = s.read(0, torch.tensor(cache.slots(1, 0, 7)), torch.float32)
    assert torch.equal(parent, k) and torch.equal(child[:6], k) and torch.equal(child[6:], new)
    assert cache.stored_slots() == recount(cache) == 6 + 7 - 4  # the first block is shared, counted once


def test_requests_with_a_common_prefix_share_its_full_blocks_until_the_last_one_finishes():
    cache = pk.PagedKVCache(store(slots=64), block_size=4)
    assert cache.admit(0, 14, ("sys", 10)) == 0  # nothing cached yet
    cache.publish_prefix(0, ("sys", 10))  # its first 10 // 4 = 2 blocks are offered
    assert cache.admit(1, 12, ("sys", 10)) == 8  # 8 tokens already in the cache
    shared = cache.tables[0][:2]
    assert cache.tables[1][:2] == shared and all(cache.allocator.refs[b] == 3 for b in shared)
    assert cache.held_slots() == 4 * (4 + 1) and cache.stored_slots() == recount(cache) == 14 + 12 - 8
    cache.free(0)
    assert all(cache.allocator.refs[b] == 2 for b in shared) and "sys" in cache.prefixes
    cache.free(1)
    assert "sys" not in cache.prefixes and len(cache.allocator.free) == 16
    unshared = pk.PagedKVCache(store(slots=64), block_size=4, share_prefixes=False)
    unshared.admit(0, 14, ("sys", 10))
    unshared.publish_prefix(0, ("sys", 10))
    assert unshared.admit(1, 12, ("sys", 10)) == 0


# ---------------------------------------------------------------------- attention through the block table
def write_ragged(cache, s, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = {}
    for seq, n in enumerate(lengths):
        assert cache.admit(seq, n) == 0
        k, v = (torch.randn(n, s.keys[0].shape[1], s.keys[0].shape[2], generator=g) for _ in range(2))
        s.write(0, torch.tensor(cache.slots(seq, 0, n)), k, v)
        kv[seq] = (k, v)
    return kv


def contiguous(kv, lengths):
    """Each sequence's keys and values as one contiguous tensor, zero-padded to the longest."""
    longest, (k0, _) = max(lengths), kv[0]
    keys, values = (torch.zeros(len(lengths), longest, *k0.shape[1:]) for _ in range(2))
    for seq, n in enumerate(lengths):
        keys[seq, :n], values[seq, :n] = kv[seq]
    return keys, values


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (4, 4), (8, 1)], ids=["GQA", "MHA", "MQA"])
def test_gather_attention_equals_contiguous_attention_exactly_for_ragged_lengths(heads, kv_heads):
    s = store(slots=64, kv_heads=kv_heads)
    cache = pk.PagedKVCache(s, block_size=4)
    random.Random(1).shuffle(cache.allocator.free)  # blocks anywhere in the pool, in any order
    lengths = [3, 17, 9]
    kv = write_ragged(cache, s, lengths)
    assert any(b - a != 1 for a, b in zip(cache.tables[1], cache.tables[1][1:]))  # really scattered
    q = torch.randn(3, 1, heads, 8, generator=torch.Generator().manual_seed(2))
    index, valid = pk.batch_index(cache, [0, 1, 2], 1)
    paged = pk.attend(q, *s.read(0, index, torch.float32), valid)
    assert torch.equal(paged, pk.attend(q, *contiguous(kv, lengths), valid))  # exact, fp32, CPU
    for seq in range(len(lengths)):  # and the textbook formula, sequence by sequence
        k, v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in kv[seq])
        scores = torch.einsum("hd,lhd->hl", q[seq, 0], k) / 8 ** 0.5
        expected = torch.einsum("hl,lhd->hd", scores.softmax(-1), v).flatten()
        torch.testing.assert_close(paged[seq, 0], expected, rtol=1e-5, atol=1e-6)


def test_gather_attention_with_a_shared_prefix_equals_each_sequences_contiguous_attention():
    s = store(slots=64)
    cache = pk.PagedKVCache(s, block_size=4)
    kv = write_ragged(cache, s, [10])
    cache.publish_prefix(0, ("p", 8))
    own = {}
    for seq, n in ((1, 13), (2, 9)):
        assert cache.admit(seq, n, ("p", 8)) == 8
        k, v = torch.randn(n - 8, 2, 8), torch.randn(n - 8, 2, 8)
        s.write(0, torch.tensor(cache.slots(seq, 8, n)), k, v)
        own[seq] = (torch.cat([kv[0][0][:8], k]), torch.cat([kv[0][1][:8], v]))
    q = torch.randn(2, 1, 4, 8)
    index, valid = pk.batch_index(cache, [1, 2], 1)
    paged = pk.attend(q, *s.read(0, index, torch.float32), valid)
    assert torch.equal(paged, pk.attend(q, *contiguous({0: own[1], 1: own[2]}, [13, 9]), valid))


def test_each_kv_dtype_stays_close_and_stores_its_scales_where_it_says():
    k = torch.randn(16, 2, 8)
    for kind, tolerance in (("int8", 0.02), ("fp8", 0.1), ("fp8-per-head", 0.1), ("fp8-per-token", 0.1),
                            ("bf16", 0.01)):
        s = store(kv_dtype=kind)
        s.write(0, torch.arange(16), k, k)
        got, _ = s.read(0, torch.arange(16), torch.float32)
        assert ((got - k).abs().amax(-1) / k.abs().amax(-1)).max() < tolerance, kind
    assert store(kv_dtype="int8").bytes_per_token == store(kv_dtype="fp8-per-token").bytes_per_token == 2 * 1 * 2 * (8 + 4)
    assert store(kv_dtype="bf16").bytes_per_token == 2 * 1 * 2 * 8 * 2  # K and V, 1 layer, 2 heads of 8, 2 bytes
    assert store(kv_dtype="fp8").bytes_per_token * 2 == store(kv_dtype="bf16").bytes_per_token  # exactly half
    assert [t.shape for t in store(kv_dtype="fp8").tensors()] == [(64, 2, 8)] * 2 + [(1, 1)] * 2
    assert [t.shape for t in store(kv_dtype="fp8-per-head").tensors()][2:] == [(2, 1)] * 2


def test_a_per_tensor_scale_is_set_once_from_the_first_write_and_later_values_saturate():
    """vLLM's default fp8 scheme: one scale per layer for K (and one for V), from the first batch it sees
    (calculate_kv_scales); a later key beyond that range is clamped to the format's largest value."""
    s = store(kv_dtype="fp8")
    first = torch.randn(4, 2, 8)
    s.write(0, torch.arange(4), first, first)
    scale = s.key_scales[0].clone()
    assert torch.equal(scale, first.abs().amax().reshape(1, 1) / 448)
    big = torch.full((1, 2, 8), 100.0)
    s.write(0, torch.tensor([4]), big, big)
    assert torch.equal(s.key_scales[0], scale)  # not recalibrated
    got, _ = s.read(0, torch.tensor([4]), torch.float32)
    assert torch.allclose(got, torch.full_like(got, 448 * float(scale)))


def test_the_fp8_pool_is_half_the_bf16_pool_to_the_byte_and_holds_twice_the_tokens():
    """Measured: the ledger counts an fp8 pool (one scale per layer) at half the bf16 pool's bytes plus its
    2 x layers scales; traced: Llama-3-8B's budget on an H100 holds twice the tokens in fp8, and 1.94x with
    this lab's per-token scales."""
    def pool_bytes(kind):
        with Ledger("cpu") as ledger, marks.category("kv_cache"):
            pk.KVStore(layers=SPEC.layers, slots=256, kv_heads=SPEC.kv_heads, head_dim=SPEC.head_dim, kv_dtype=kind)
        return ledger.peak()["kv_cache"]
    assert pool_bytes("fp8") == pool_bytes("bf16") // 2 + 2 * SPEC.layers * 4  # a float32 scale each for K and V
    spec = zoo.get("llama-3-8b")
    tokens = {kind: budget.plan(spec, seq_len=8192, kv_dtype=kind).max_tokens_in_flight
              for kind in ("bf16", "fp8", "fp8-per-token")}
    assert 1.995 < tokens["fp8"] / tokens["bf16"] < 2.005
    assert abs(tokens["fp8-per-token"] / tokens["bf16"] - 2 * 128 / 132) < 0.005


# ---------------------------------------------------------------------- the serving forward
@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return sm.ServingLlama(SPEC.build().eval())


def test_the_serving_forward_gives_the_zoo_models_logits_and_greedy_tokens(model):
    for cache in (pk.PagedKVCache(store(128, 2, 16, 2), 4), base.StaticKVCache(store(128, 2, 16, 2), 64),
                  base.GrowingKVCache(store(128, 2, 16, 2))):
        prompt = random.Random(3).choices(range(SPEC.vocab), k=11)
        cache.admit(0, len(prompt))
        seq = prompt + [model.prefill(cache, 0, prompt)]
        for _ in range(4):
            with torch.no_grad():
                logits = model.model(torch.tensor([seq]))[0][0, -1]
            assert cache.grow(0)
            torch.testing.assert_close(model.forward(cache, [0], torch.tensor([[seq[-1]]]))[0], logits,
                                       rtol=1e-5, atol=1e-5)
            seq.append(int(logits.argmax()))


# ---------------------------------------------------------------------- continuous batching
@pytest.fixture(scope="module")
def small_run():
    return lab.run(lab.Config(**SMALL))


def test_the_three_caches_generate_identical_tokens(small_run):
    assert small_run.identical_tokens() is True
    outputs = [s.outputs for s in small_run.served.values()]
    assert all(set(o) == set(range(12)) for o in outputs)  # nobody rejected, every request finished
    assert all(len(o[r.id]) == r.output_len for o in outputs for r in small_run.requests)


def test_every_step_adds_up_and_paged_waste_is_under_one_block_per_sequence(small_run):
    bs = small_run.config.block_size
    for name, served in small_run.served.items():
        assert served.records, name
        for r in served.records:
            assert r.stored + r.internal + r.reservation == r.held <= served.pool_slots, (name, r)
            assert r.logical == r.stored  # no shared prefix in this trace: every token is stored once
            assert r.held + r.fragmentation <= served.pool_slots
            if name == "paged":
                assert r.internal <= r.running * (bs - 1), r  # the paged cache's waste bound
                assert r.reservation == r.fragmentation == 0
    static = small_run.served["static"].records
    assert max(r.held for r in static) == 2 * SPEC.context  # two regions of max_len fit 288 slots
    assert all(r.held == r.running * SPEC.context for r in static)


def test_a_small_pool_preempts_and_recomputes_and_still_gives_the_same_tokens(small_run):
    m = {k: s.metrics() for k, s in small_run.served.items()}
    assert m["paged"]["preemptions"] > 0 and m["static"]["preemptions"] == 0
    assert m["paged"]["max_concurrent"] > m["static"]["max_concurrent"]
    assert m["static"]["waste_fraction"] > 0.5 > m["paged"]["waste_fraction"]


def test_the_ledger_counts_the_pool_as_kv_cache(small_run):
    pool_bytes = small_run.pool_tokens * pk.kv_bytes_per_token(SPEC.layers, SPEC.kv_heads, SPEC.head_dim, "bf16")
    assert small_run.pool_bytes == pool_bytes
    for ledger in small_run.ledgers.values():
        assert ledger.peak()["kv_cache"] == pool_bytes
        assert ledger.timeline().peaks_by_phase()["decode"]["kv_cache"] == pool_bytes


def test_bookkeeping_alone_schedules_exactly_like_the_model_run(small_run):
    """Memory depends on lengths only, so the real-size run (no tensors, no tokens) is the same schedule."""
    for name, served in small_run.served.items():
        s = pk.KVStore(layers=SPEC.layers, slots=288, kv_heads=SPEC.kv_heads, head_dim=SPEC.head_dim, allocate=False)
        alone = lab.serve(lab.CACHES[name](s, small_run.config), small_run.requests)
        assert alone.records == served.records, name


def test_prefix_sharing_stores_the_system_prompt_once_and_keeps_the_tokens():
    shared = lab.run(lab.Config(**SMALL, system_prompt=32, cache="paged"))
    unshared = lab.run(lab.Config(**SMALL, system_prompt=32, cache="paged", no_prefix_sharing=True))
    static = lab.run(lab.Config(**SMALL, system_prompt=32, cache="static"))
    a, b = shared.served["paged"], unshared.served["paged"]
    assert a.outputs == b.outputs == static.served["static"].outputs
    for served in (a, b):  # the waste bound holds with shared prefix blocks too
        for r in served.records:
            assert r.internal <= r.running * (shared.config.block_size - 1), r
            assert r.stored + r.internal == r.held <= served.pool_slots, r
    assert a.metrics()["shared_fraction"] > 0.2 and b.metrics()["shared_fraction"] == 0
    assert a.metrics()["max_concurrent"] > b.metrics()["max_concurrent"]
    assert a.metrics()["tokens_per_step"] > b.metrics()["tokens_per_step"]


def test_a_request_that_can_never_fit_is_rejected_with_a_reason_and_the_rest_are_served(tmp_path):
    path = tmp_path / "trace.jsonl"
    trace.write(path, [trace.Request(0, 0, 10, 5), trace.Request(1, 0, 40, 200), trace.Request(2, 1, 8, 3)])
    run = lab.run(lab.Config(device="cpu", trace=path, pool_tokens=96, max_len=64))
    for name, served in run.served.items():
        assert set(served.outputs) == {0, 2}, name
        assert "40 + 200 tokens" in served.rejected[1] and name in served.rejected[1]


# ---------------------------------------------------------------------- traces and bad input
def test_a_generated_trace_is_seeded_and_survives_a_trace_file(tmp_path):
    kwargs = dict(requests=20, arrival_rate=1.5, prompt_lens=(3, 9), output_lens=(1, 4), system_prompt=5)
    first = trace.generate(seed=7, **kwargs)
    assert first == trace.generate(seed=7, **kwargs) != trace.generate(seed=8, **kwargs)
    assert all(8 <= r.prompt_len <= 14 and r.prefix_len == 5 for r in first)
    trace.write(tmp_path / "t.jsonl", first)
    assert trace.read(tmp_path / "t.jsonl") == first
    assert trace.prompt_tokens(first[0], 256, 0)[:5] == trace.prompt_tokens(first[1], 256, 0)[:5]


@pytest.mark.parametrize(("line", "fragment"), [
    ('{"arrival": 0, "prompt_len": -3, "output_len": 4}', "prompt_len must be a whole number >= 1"),
    ('{"arrival": 0, "prompt_len": 3}', "no output_len"),
    ('{"arrival": -1, "prompt_len": 3, "output_len": 4}', "arrival must be"),
    ('{"arrival": 0, "prompt_len": 3, "output_len": 4, "prefix": "s", "prefix_len": 9}', "prefix_len 9"),
    ("[1, 2]", "must be a JSON object"), ("{oops", "not JSON")])
def test_a_bad_trace_file_is_one_line_naming_its_line(tmp_path, capsys, line, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"arrival": 0, "prompt_len": 3, "output_len": 4}\n' + line + "\n")
    assert_usage_error_in_process(lab, ["--device", "cpu", "--trace", str(path)], capsys, "line 2", fragment)


def test_a_pool_smaller_than_a_prompt_and_a_model_that_leaves_no_pool_are_refused(capsys):
    assert_usage_error_in_process(lab, ["--device", "cpu", "--pool-tokens", "20"], capsys,
                                  "smaller than the prompt of request")
    assert_usage_error_in_process(lab, ["--model", "llama-3-8b", "--fake", "--seq-len", "256",
                                        "--gpu-memory-utilization", "0.1"], capsys, "leaves no KV pool on h100-80gb")


@pytest.mark.parametrize(("argv", "fragment"), [
    (["--pool-tokens", "100"], "smaller than one static region of --max-len 128"),
    (["--pool-tokens", "100", "--cache", "paged", "--block-size", "128"], "smaller than one block (--block-size 128)"),
    (["--fake", "--cache", "paged"], "keeps the books of"),  # a toy model's pool on an 80 GB card
    (["--fake", "--seq-len", "1000"], "more than small-llama's context of 128 tokens"),
    (["--pool-tokens", "100000000000"], "--pool-tokens must be in [1, 16,777,216]"),
    (["--non-torch-gib", "1e308"], "--non-torch-gib must be in [0, 1,024]")])
def test_a_pool_no_cache_can_use_and_sizes_past_any_gpu_are_one_line(capsys, argv, fragment):
    for cache in ("all", "static") if "static" in fragment else (None,):
        extra = ["--cache", cache] if cache else []
        assert_usage_error_in_process(lab, ["--device", "cpu", "--prompt-lens", "4,8", *argv, *extra], capsys, fragment)


@pytest.mark.parametrize(("kwargs", "fragment"), [
    (dict(prompt_lens=(9, 3)), "MIN <= MAX"), (dict(output_lens=(1, 2, 3)), "MIN,MAX"),
    (dict(model="small-gpt"), "Llama-family"), (dict(model="llama-3-8b", tp=3), "--tp 3"),
    (dict(model="nope"), "unknown model"), (dict(system_prompt=4, trace=__file__), "--system-prompt"),
    (dict(budget_model="small-gpt"), "--budget-model small-gpt"), (dict(budget_model="nope"), "unknown model"),
    (dict(model="llama-3-8b", fake=True, budget_model="llama-3-70b"), "leave --budget-model out"),
    (dict(seq_len=8193), "more than llama-3-8b's context of 8,192")])
def test_config_rules(kwargs, fragment):
    with pytest.raises(lab.UsageError, match=fragment):
        lab.Config(**kwargs)


def test_the_command_line_prints_the_issues_json_keys():
    proc = run_cli(SCRIPT, "--device", "cpu", "--requests", "6", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for key in ("kv_bytes_per_token", "weights_bytes", "kv_pool_bytes", "max_tokens_in_flight"):
        assert isinstance(out[key], int), key
    assert set(out["caches"]) == {"paged", "static", "growing"}
    for metrics in out["caches"].values():
        assert {"utilization", "waste_fraction", "max_concurrent", "preemptions"} <= set(metrics)
    assert out["identical_tokens"] is True
    assert out["model"] == "small-llama" and out["budget_model"] == out["budget"]["model"] == "llama-3-8b"


# ---------------------------------------------------------------------- the serving budget at real size
def test_the_default_run_ends_on_a_real_models_traced_budget_on_an_h100(capsys, monkeypatch):
    """The default command serves the toy, then ends on Llama-3-8B's serving budget on one H100 (traced
    on fake tensors, not the toy's), with the numbers serving_budget.plan computes, in 100 columns."""
    from labkit import cli

    monkeypatch.setenv("COLUMNS", "100")
    cli.main(lab.Config, lab.run, report.report, ["--device", "cpu"], prog="serve_memory.py")
    lines = capsys.readouterr().out.splitlines()
    b = budget.plan(zoo.get("llama-3-8b"), gpu="h100-80gb", seq_len=8192)
    assert lab.Config().budget_spec().name == "llama-3-8b" and b.max_tokens_in_flight > 400_000
    last = " ".join(line.strip() for line in lines[max(i for i, x in enumerate(lines) if x.startswith("[")) + 1:])
    assert last == report.budget_line(b) and last.startswith(
        f"llama-3-8b on one h100-80gb, traced: {b.max_tokens_in_flight:,} tokens in flight, "
        f"{b.sequences(8192):,} requests of 8,192 tokens at once; decode at most ")
    head = next(i for i, x in enumerate(lines) if x.startswith("Serving budget of llama-3-8b"))
    assert "traced at real size on fake tensors" in " ".join(lines[head:head + 3])
    table = "\n".join(lines[head:])
    for n in (b.usable_bytes, b.weights_bytes, b.prefill_peak_bytes, b.kv_pool_bytes):
        assert format_bytes(n, "GiB") in table, n
    assert max(len(line) for line in lines) <= 100


def test_bytes_per_token_come_from_the_config():
    for name in ("llama-3-8b", "llama-3-70b"):
        spec = zoo.get(name)
        assert pk.kv_bytes_per_token(spec.layers, spec.kv_heads, spec.head_dim, "bf16") == spec.kv_bytes_per_token(2)
    assert zoo.get("llama-3-8b").kv_bytes_per_token(2) == 2 * 32 * 8 * 128 * 2  # 128 KiB per token
    rank = budget.per_gpu_spec(zoo.get("llama-3-70b"), 8)
    assert (rank.heads, rank.kv_heads, rank.ffn, rank.head_dim) == (8, 1, 3584, 128)


@pytest.mark.parametrize(("batch", "new"), [(1, 100), (1, 48), (3, 1)], ids=["prefill", "chunk", "decode"])
def test_the_traced_step_equals_the_real_one_to_the_byte(batch, new):
    """The trace is the truth: small-llama's serving prefill, chunk and decode step on fake tensors (exact
    bytes: no allocator rounding) and on real ones, through the same code, give the same ledger peaks."""
    kwargs = dict(batch=batch, context=100, new=new, kv_dtype="bf16", block_size=16)
    traced = budget.trace_step(SPEC, tensors=lambda: fake.tensors(block=None), **kwargs)
    real = budget.trace_step(SPEC, tensors=contextlib.nullcontext, **kwargs)
    assert traced == real and traced["kv_cache"] == batch * 112 * SPEC.kv_bytes_per_token(2)


def test_llama_3_8b_on_an_h100_the_budget_and_what_paging_changes_at_real_size():
    """The page's real-scale claims: 8B's pool at 0.9 of an H100 holds 55 sequences of 8k tokens, and
    on a trace of shorter requests the paged cache runs several times as many at once as a static one."""
    run = lab.run(lab.Config(model="llama-3-8b", fake=True, requests=200, arrival_rate=4, output_lens=(128, 1024)))
    b, spec = run.budget, zoo.get("llama-3-8b")
    assert b.kv_bytes_per_token == spec.kv_bytes_per_token(2) == 128 * 1024
    assert abs(b.weights_bytes - 2 * spec.param_count()) < 512 * 300  # bf16, each tensor rounded to 512 B
    assert b.kv_pool_bytes > 50 * 2**30 and b.sequences(8192) == 55 == b.sequences(8192, reserve=8192)
    assert b.sequences(8192) == b.kv_pool_bytes // (8192 * b.kv_bytes_per_token)
    m = {k: s.metrics() for k, s in run.served.items()}
    assert m["paged"]["max_concurrent"] > 3 * m["static"]["max_concurrent"]
    assert m["paged"]["waste_fraction"] < 0.01 < 0.5 < m["static"]["waste_fraction"]
    assert run.identical_tokens() is None and all(s.outputs for s in run.served.values())


def test_a_tp_group_serves_from_one_gpus_pool_not_the_groups():
    """--fake --tp 4: the pool the caches serve from holds 70B's 2 KV heads of each GPU, so its bytes and
    the peak any cache holds stay within the budget's KV pool; the tokens are the budget's either way."""
    run = lab.run(lab.Config(model="llama-3-70b", fake=True, tp=4, seq_len=8192, requests=300, arrival_rate=4,
                             output_lens=(128, 1024)))
    b = run.budget
    assert b.kv_heads_per_gpu == 2 and run.pool_tokens == b.max_tokens_in_flight
    assert run.pool_bytes == b.max_tokens_in_flight * b.kv_bytes_per_token <= b.kv_pool_bytes
    for name, served in run.served.items():
        assert served.bytes_per_token == b.kv_bytes_per_token, name
        assert served.metrics()["peak_held_bytes"] <= b.kv_pool_bytes, name
    assert run.summary()["pool_bytes"] <= run.summary()["kv_pool_bytes"]


def test_chunked_prefill_cuts_the_32k_prefill_peak_of_llama_3_8b_below_a_fifth():
    whole = budget.trace_prefill(zoo.get("llama-3-8b"), seq_len=32768)["activations"]
    chunked = budget.trace_prefill(zoo.get("llama-3-8b"), seq_len=32768, chunk=2048)["activations"]
    assert chunked < whole / 5 and whole > 3 * 2**30


def test_each_budget_row_sizes_its_pool_for_its_own_context_and_chunking_is_the_lever_at_32k():
    measure = labs.load(14, "serving_measure")
    _, table, plans = measure.budgets([("llama-3-8b", 1, "bf16", "bf16", 8192, None),
                                       ("llama-3.1-8b", 1, "bf16", "bf16", 32768, None),
                                       ("llama-3.1-8b", 1, "bf16", "bf16", 32768, 2048)])
    short, whole, chunked = plans
    col = {c[0] if isinstance(c, tuple) else c: i for i, c in enumerate(table.columns)}
    assert [p.seq_len for p in plans] == [row[col["context"]] for row in table.rows] == [8192, 32768, 32768]
    assert whole.prefill_peak_bytes > 3 * short.prefill_peak_bytes > 5 * chunked.prefill_peak_bytes
    assert whole.kv_pool_bytes < short.kv_pool_bytes < chunked.kv_pool_bytes
    assert [row[col["sequences of the context"]] for row in table.rows] == [
        short.sequences(8192), whole.sequences(32768), chunked.sequences(32768)]


def test_the_non_torch_memory_is_cited_in_one_wording():
    assert budget.NON_TORCH_BYTES == round(lab.Config().non_torch_gib * 2**30)
    row = next(r for r in report.budget_table(budget.plan(SPEC, seq_len=64)).rows if "non-torch" in r[0])
    assert row[2] == "cited" and row[3] == budget.NON_TORCH_SOURCE
    page = (ROOT / "docs" / "labs" / "lab-14-serving-memory.md").read_text()
    for url in re.findall(r"https://\S+", budget.NON_TORCH_SOURCE):
        assert url.rstrip(",;:)'") in page, url


def test_block_size_trades_waste_for_block_table_entries(small_run):
    measure = labs.load(14, "serving_measure")
    table = measure.block_sizes(small_run.requests, pool=288, config=small_run.config, sizes=(1, 4, 16, 64))
    waste, tables = [row[1] for row in table.rows], [row[5] for row in table.rows]
    assert waste[0] == 0 and waste == sorted(waste) and tables == sorted(tables, reverse=True)


def test_quantized_caches_against_fp32(model):
    measure = labs.load(14, "serving_measure")
    rows = {row[0]: row for row in measure.kv_dtype_errors(model, list(range(40)), steps=8).rows}
    assert rows["fp32"][2] == 0 and rows["fp32"][4] == 1
    assert rows["int8"][2] < 0.02 and rows["bf16"][2] < rows["int8"][2] < rows["fp8-per-token"][2] < 0.1
    assert max(rows[k][2] for k in ("fp8", "fp8-per-head")) < 0.1  # e4m3 keeps ~3 bits of mantissa whatever the scale
    assert rows["int8"][1] == zoo.get("llama-3-8b").kv_bytes_per_token(1) * (128 + 4) // 128
    assert rows["fp8"][1] * 2 == rows["bf16"][1]


# ---------------------------------------------------------------------- how fast decode can be
speed = labs.load(14, "serving_speed")


def plain_attention(q, keys, values, valid):
    """``paged_kv.attend`` written with matmuls, so that FlopCounterMode counts it on a CPU."""
    q, k, v = q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
    k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) / q.size(-1) ** 0.5
    if valid is None:  # one sequence's whole prompt: causal
        valid = torch.ones(q.size(2), k.size(2), dtype=torch.bool).tril()[None]
    scores = scores.masked_fill(~valid[:, None], float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).flatten(2)


def decode_once(model, context: int, batch: int, attention=None, mode=None):
    """One decode step of ``batch`` sequences of ``context`` tokens (the new one included) on a paged cache."""
    store = pk.KVStore(layers=SPEC.layers, slots=1024, kv_heads=SPEC.kv_heads, head_dim=SPEC.head_dim, kv_dtype="fp32")
    cache = pk.PagedKVCache(store, 16)
    for seq in range(batch):
        cache.admit(seq, context - 1)
        cache.grow(seq, 1)
    serving = sm.ServingLlama(model)
    if attention is not None:
        serving.attention = attention
    with mode or contextlib.nullcontext():
        return serving.forward(cache, list(range(batch)), torch.arange(batch)[:, None])


def test_a_matmuls_flops_and_bytes_are_what_torch_counts_and_moves():
    from torch.utils.flop_counter import FlopCounterMode

    x, w = torch.ones(32, 16, dtype=torch.bfloat16), torch.ones(24, 16, dtype=torch.bfloat16)
    with FlopCounterMode(display=False) as counter:
        y = x @ w.T
    assert speed.matmul(32, 16, 24) == (counter.get_total_flops(), x.nbytes + w.nbytes + y.nbytes)


@pytest.mark.parametrize(("context", "batch"), [(1, 1), (37, 1), (37, 3)])
def test_decode_step_counts_the_flops_torch_counts_in_a_real_decode_step(context, batch):
    """small-llama's decode step through the lab's serving forward, its attention written with matmuls
    (equal to the lab's SDPA one): PyTorch's FlopCounterMode counts what ``decode_step`` derives."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = SPEC.build().eval()
    torch.testing.assert_close(decode_once(model, context, batch, plain_attention), decode_once(model, context, batch))
    counter = FlopCounterMode(display=False)
    decode_once(model, context, batch, plain_attention, counter)
    assert counter.get_total_flops() == speed.decode_step(SPEC, context, batch, element_bytes=4)[0]


@pytest.mark.parametrize("tied", [False, True])
def test_a_decode_step_reads_every_weight_once_and_the_embedding_only_where_it_looks(tied):
    """Which parameters a real decode step reads (a dispatch mode watching every op's inputs): each matrix
    once, the embedding table only by the lookup (B rows) unless the head shares it; so the bytes
    ``decode_step`` counts are the model's own parameters less the rows no token looked up."""
    from torch.utils._python_dispatch import TorchDispatchMode

    spec = dataclasses.replace(SPEC, tied=tied)
    model = spec.build().eval()
    params = {p.untyped_storage().data_ptr(): name for name, p in model.named_parameters()}
    reads: dict[str, list[str]] = {}

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            for t in torch.utils._pytree.tree_leaves((args, kwargs)):  # a view reads nothing
                if not func.is_view and isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in params:
                    reads.setdefault(params[t.untyped_storage().data_ptr()], []).append(func.__name__)
            return func(*args, **(kwargs or {}))

    batch, context = 3, 37
    decode_once(model, context, batch, mode=Reads())
    assert set(reads) == set(params.values()), "every parameter is read"
    assert all(len(ops) == 1 for name, ops in reads.items() if name != "embed.weight"), reads
    assert reads["embed.weight"][0] == "embedding.default" and len(reads["embed.weight"]) == (2 if tied else 1)
    total = sum(p.numel() for p in model.parameters())
    unread = 0 if tied else (spec.vocab - batch) * spec.width
    kv = batch * context * spec.kv_bytes_per_token(4)
    assert speed.decode_step(spec, context, batch, element_bytes=4)[1] == 4 * (total - unread) + kv


def test_the_roofline_bends_at_each_cards_ridge_point():
    for chip in speed.CHIPS.values():
        peak, bandwidth, ridge = chip.bf16_dense.value, chip.bandwidth.value, chip.ridge
        assert speed.attainable(chip, ridge) == pytest.approx(peak)
        assert speed.attainable(chip, ridge / 10) == pytest.approx(bandwidth * ridge / 10)
        assert speed.attainable(chip, ridge * 10) == peak


def test_llama_3_8b_decodes_below_the_ridge_even_with_the_pool_full_and_a_training_matmul_above_it():
    """The primer's worked example: at 8k tokens, one sequence reads the weights and 1 GiB of keys and
    values per token at about one FLOP per byte; the 54 sequences the pool holds multiply tokens per second
    but stay under the ridge (each reads its own keys and values); a training matmul is far above it."""
    spec, h100 = zoo.get("llama-3-8b"), speed.CHIPS["h100-80gb"]
    one, full = speed.decode(h100, spec, 8192), speed.decode(h100, spec, 8192, batch=54)
    assert one["kv_bytes"] == 2**30 and one["weight_bytes"] == 2 * (spec.param_count() - (spec.vocab - 1) * spec.width)
    assert one["tokens_per_s"] == h100.bandwidth.value / (one["weight_bytes"] + one["kv_bytes"])
    assert 1 < one["intensity"] < 2 and full["intensity"] < h100.ridge / 10
    assert full["tokens_per_s"] > 10 * one["tokens_per_s"]
    flops, moved = speed.matmul(tokens=8192, d_in=4096, d_out=4096)
    assert flops / moved > 5 * h100.ridge


def test_the_cited_cards_are_lab_13s_and_every_number_names_an_nvidia_source():
    fit_gpus = labs.load(13, "fit_gpus")
    for chip in speed.CHIPS.values():
        assert chip.memory.stated == fit_gpus.GPUS[chip.name].stated
        assert chip.registers_per_sm.value == 65536 * 4  # 64K 32-bit registers
        facts = [chip.registers_per_sm, chip.l1_shared_per_sm, chip.l2, chip.memory, chip.bandwidth, chip.bf16_dense]
        for fact in filter(None, facts):
            assert fact.sources and all(re.match(r"https://[\w.]*nvidia\.com/", s) for s in fact.sources), fact
    assert speed.CHIPS["h200-141gb"].l2 is None  # NVIDIA's H200 pages state no L2 size: none is shown
    assert speed.CHIPS["h100-80gb"].bf16_dense.value == speed.CHIPS["h200-141gb"].bf16_dense.value == 1979e12 / 2
    assert [row[0] for row in speed.sizes_table().rows] == [row[0] for row in speed.speeds_table().rows]
