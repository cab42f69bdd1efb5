"""Fake-tensor traces (labkit.fake): the ledger of a step on fake tensors equals, to the byte, the
ledger of the same step on real tensors, in every category, at every row and every phase peak."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.utils.checkpoint as cp

from labkit import GPTConfig, Ledger, TinyGPT, fake, marks, zoo

TINY = GPTConfig(width=64, layers=2, heads=4, vocab=128, seq_len=32)


def checkpointed(blocks, x):
    for block in blocks:
        x = cp.checkpoint(block, x, use_reentrant=False)
    return x


def train_step(model, optimizer, idx, precision="fp32", run_blocks=None, steps=2):
    for step in range(steps):
        autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "mixed"
                    else contextlib.nullcontext())
        with marks.phase("forward", step=step), autocast:
            _, loss = model(idx, idx, run_blocks=run_blocks)
        with marks.phase("backward", step=step):
            loss.backward()
        with marks.phase("optimizer", step=step):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def ledger_of(build, *, on_fake, precision="fp32", optimizer="adamw-foreach", run_blocks=None, block=None,
              batch=2, seq=32, steps=2):
    """The timeline of two training steps of ``build()``, on fake or on real tensors."""
    torch.manual_seed(0)
    scope = fake.tensors(block=block) if on_fake else contextlib.nullcontext()
    with scope:
        dtype = torch.bfloat16 if precision == "bf16" else None
        # the real twin is initialised (an MoE routes by its weights' values); the trace needs no values
        model = fake.materialize(build, dtype=dtype) if on_fake else build().to(dtype or torch.float32)
        params = list(model.parameters())
        opt = {"adamw-foreach": lambda: torch.optim.AdamW(params, foreach=True),
               "adamw-fused": lambda: torch.optim.AdamW(params, fused=True),
               "adamw-for-loop": lambda: torch.optim.AdamW(params, foreach=False),
               "sgd": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True)}[optimizer]()
        # random token ids (seeded): an MoE routes a batch of identical tokens to the same experts
        idx = torch.randint(0, 64, (batch, seq), generator=None)
        ledger = Ledger("cpu").track_module(model).track_optimizer(opt)
        with ledger:
            train_step(model, opt, idx, precision=precision, run_blocks=run_blocks, steps=steps)
    return ledger


def event_signature(ledger):
    """The allocations in order (op, bytes, category, phase), each followed by what was freed before
    the next one. Frees that happen together are compared as a set: autocast empties its cache of
    casts in hash-table order, which differs from run to run on real tensors too."""
    out, freed = [], []
    for ev in ledger.events:
        rec = ledger.records[ev[1]]
        item = (rec.op, rec.nbytes, ledger.category_of(rec), ledger.scope_of(rec), rec.phase)
        if ev[0] == "free":
            freed.append(item)
            continue
        out.append(tuple(sorted(freed)))
        freed = []
        out.append((ev[0],) + item + tuple(ev[2:]))
    return out + [tuple(sorted(freed))]


def assert_same_timeline(real_ledger, traced_ledger):
    real, traced = real_ledger.timeline(), traced_ledger.timeline()
    assert len(real) == len(traced), "the fake step allocated and freed a different number of times"
    assert event_signature(real_ledger) == event_signature(traced_ledger)
    assert real.peaks_by_phase() == traced.peaks_by_phase()
    assert real.step_peaks() == traced.step_peaks()
    assert real.peak() == traced.peak()
    for cat in real.categories:
        assert max(real.device[cat]) == max(traced.device[cat]), cat


@pytest.mark.parametrize("precision", ["fp32", "mixed", "bf16"])
@pytest.mark.parametrize("optimizer", ["adamw-foreach", "adamw-fused", "adamw-for-loop", "sgd"])
def test_tinygpt_fake_trace_equals_the_real_ledger_to_the_byte(precision, optimizer):
    build = functools.partial(TinyGPT, TINY)
    real = ledger_of(build, on_fake=False, precision=precision, optimizer=optimizer)
    traced = ledger_of(build, on_fake=True, precision=precision, optimizer=optimizer)
    timeline = traced.timeline()
    assert max(timeline.device["activations"]) > 0 and max(timeline.device["gradients"]) > 0
    assert_same_timeline(real, traced)


@pytest.mark.parametrize("name", ["small-llama", "small-mixtral", "small-gpt"])
@pytest.mark.parametrize("precision", ["fp32", "mixed"])
def test_small_zoo_model_fake_trace_equals_the_real_ledger_to_the_byte(name, precision):
    spec = zoo.get(name)
    real = ledger_of(spec.build, on_fake=False, precision=precision, batch=4)
    traced = ledger_of(spec.build, on_fake=True, precision=precision, batch=4)
    if spec.experts:
        # An MoE routes by value, which fake tensors do not have: the trace gives each expert an
        # equal share of the tokens, the real run routes by the router's scores. Same totals for
        # everything the routing does not touch; the expert temporaries may differ.
        r, t = real.timeline(), traced.timeline()
        for cat in ("parameters", "gradients", "optimizer_state"):
            assert max(r.device[cat]) == max(t.device[cat]), cat
        assert abs(r.peak()["total"] - t.peak()["total"]) < 0.10 * r.peak()["total"]
        return
    assert_same_timeline(real, traced)


def test_checkpointed_step_traces_the_same_on_fake_tensors():
    build = functools.partial(TinyGPT, TINY)
    real = ledger_of(build, on_fake=False, precision="mixed", run_blocks=checkpointed)
    traced = ledger_of(build, on_fake=True, precision="mixed", run_blocks=checkpointed)
    assert_same_timeline(real, traced)
    plain = ledger_of(build, on_fake=True, precision="mixed")
    fwd = "forward"
    assert (traced.peaks_by_phase()[fwd]["activations"]
            < plain.peaks_by_phase()[fwd]["activations"])


def test_block_rounding_counts_each_storage_in_cuda_allocator_blocks():
    build = functools.partial(TinyGPT, TINY)
    exact = ledger_of(build, on_fake=True, block=None).timeline()
    rounded = ledger_of(build, on_fake=True, block=512).timeline()
    assert all(v % 512 == 0 for v in rounded.peak().values())
    n_params = sum(1 for _ in TinyGPT(TINY).parameters())
    param_bytes = exact.peak()["parameters"]
    assert param_bytes <= rounded.peak()["parameters"] < param_bytes + 512 * n_params


def test_nothing_real_is_allocated_at_real_size():
    """A model far larger than this machine's memory, built and stepped on fake tensors."""
    big = GPTConfig(width=8192, layers=4, heads=64, vocab=128_000, seq_len=4096)  # 4.3 G parameters
    with fake.tensors():
        model = fake.materialize(functools.partial(TinyGPT, big), dtype=torch.bfloat16)
        idx = torch.zeros(1, 4096, dtype=torch.long)
        ledger = Ledger("cpu").track_module(model)
        with ledger, marks.phase("forward", step=0):
            _, loss = model(idx, idx)
        assert fake.is_fake(loss)
    n = sum(p.numel() for p in model.parameters())
    assert ledger.peak()["parameters"] >= 2 * n > 8 * 2**30


def test_materialize_outside_a_trace_gives_real_tensors():
    model = fake.materialize(functools.partial(TinyGPT, TINY))
    assert not any(fake.is_fake(p) for p in model.parameters())
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_a_ledger_ignores_fake_tensors_of_another_trace():
    with fake.tensors():
        outside = torch.ones(1024)
    with fake.tensors():
        ledger = Ledger("cpu")
        with ledger:
            y = outside * 2  # converted into this trace's mode: counted once, as the new storage
            z = y + 1
    assert z.shape == (1024,)
    assert ledger.peak()["other"] == 2 * 1024 * 4


def test_autocast_audit_finds_where_cpu_and_cuda_policies_differ():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with fake.autocast_audit() as differs, torch.autocast("cpu", dtype=torch.bfloat16):
        x.exp()  # float32 on CUDA, bfloat16 under CPU autocast
        torch.nn.functional.linear(x, torch.randn(8, 8))  # bfloat16 on both
    assert differs == {"exp": 1}


@pytest.mark.parametrize("name", ["tiny", "small-llama"])
def test_mixed_step_holds_the_dtypes_cuda_autocast_would(name):
    build = functools.partial(TinyGPT, TINY) if name == "tiny" else zoo.get(name).build
    with fake.tensors(), fake.autocast_audit() as differs:
        model = fake.materialize(build)
        idx = torch.zeros(2, 32, dtype=torch.long)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(idx, idx)
        loss.backward()
    assert differs == {}


def test_materialize_keeps_tied_weights_tied():
    with fake.tensors():
        model = fake.materialize(zoo.get("llama-3.2-1b").build, dtype=torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == 1_235_814_400  # published, tied embeddings


def test_zoo_llama_and_hugging_face_llama_trace_the_same_step_within_one_percent(tmp_path):
    """Llama-3-8B's full config (32 layers, 4k tokens), built by the zoo and by transformers'
    LlamaForCausalLM on fake tensors: two mixed-precision steps with fused AdamW (no foreach
    temporaries, so the peak is where the backward starts) hold the same bytes within 1 % in every
    category and at the peak.

    transformers runs as on real tensors (``zoo._one_sequence_per_row``): without that, on fake
    tensors it cannot rule out packed sequences, builds a T x T mask and copies K and V up to the
    query heads (``repeat_kv``), 2.4 GB more activations here (5 %). What remains is the zoo's own,
    exactly: each of its attentions computes the RoPE cos and sin tables, (T, head_dim) fp32 each,
    and saves them, where transformers computes them once for all layers; each holds its inverse
    frequencies (64 floats, one 512-byte block), where transformers holds two for the model."""
    transformers = pytest.importorskip("transformers")
    spec = zoo.get("llama-3-8b")
    hf = transformers.LlamaConfig(
        vocab_size=spec.vocab, hidden_size=spec.width, intermediate_size=spec.ffn,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.context, rms_norm_eps=spec.norm_eps, rope_theta=spec.rope_theta,
        tie_word_embeddings=False)
    hf.to_json_file(tmp_path / "config.json")
    assert spec.param_count() == 8_030_261_248 and spec.layers == 32
    seq, block = 4096, 512
    step = dict(on_fake=True, precision="mixed", optimizer="adamw-fused", batch=1, seq=seq, block=block)
    a = ledger_of(spec.build, **step).timeline()
    b = ledger_of(zoo.get(str(tmp_path / "config.json")).build, **step).timeline()
    tops_a = {cat: max(a.device[cat]) for cat in a.categories}
    tops_b = {cat: max(b.device[cat]) for cat in b.categories}
    rope = 2 * seq * spec.head_dim * 4  # cos and sin, fp32: 4 MiB a layer
    assert tops_a["activations"] - tops_b["activations"] == (spec.layers - 1) * rope
    assert (tops_a["other"], tops_b["other"]) == (spec.layers * block, 2 * block)
    for cat in tops_a:
        if cat != "other":  # (16 KiB against 1 KiB: stated above)
            assert abs(tops_a[cat] - tops_b[cat]) <= 0.01 * tops_a[cat], (cat, tops_a[cat], tops_b[cat])
    peak_a, peak_b = a.peak(), b.peak()
    # the peak: the second step's backward begins, the moments kept, no gradient yet, every activation saved
    assert peak_a["gradients"] == peak_b["gradients"] == 0 and peak_a["activations"] > 0.3 * peak_a["total"]
    assert peak_a["total"] - peak_b["total"] == (spec.layers - 1) * rope + (spec.layers - 2) * block
    assert abs(peak_a["total"] - peak_b["total"]) <= 0.01 * peak_a["total"]


def test_realscale_flags_pick_the_model_and_the_tensors(tmp_path):
    from dataclasses import dataclass

    from labkit.config import LabConfig, UsageError
    from labkit.models import TinyGPTShape
    from labkit.scale import RealScale

    @dataclass
    class Config(RealScale, TinyGPTShape, LabConfig):
        pass

    def tiny():
        return TinyGPT(GPTConfig(width=32, layers=1, heads=2, vocab=64, seq_len=16))

    assert isinstance(Config().build_model(tiny), TinyGPT)
    assert all(p.dtype == torch.bfloat16 for p in Config().build_model(tiny, dtype=torch.bfloat16).parameters())
    config = Config(model="llama-3-8b", fake=True)
    with config.tensors():
        model = config.build_model(tiny, dtype=torch.bfloat16)
        assert all(fake.is_fake(p) and p.dtype == torch.bfloat16 for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    real = Config(model="small-llama").build_model(tiny)
    assert not any(fake.is_fake(p) for p in real.parameters())
    for bad, fragment in [(dict(model="llama-9"), "llama-9"),
                          (dict(model=str(tmp_path / "missing.json")), "missing.json"),
                          (dict(fake=True, device="cuda"), "--fake")]:
        with pytest.raises(UsageError, match=fragment):
            Config(**bad)


def test_copies_counts_copies_of_fake_host_buffers():
    """schedule.Copies tells host buffers apart by storage; fake storages have no address."""
    from labkit.schedule import Copies

    with fake.tensors():
        host = [torch.empty(1024), torch.empty(2048)]
        dev = torch.empty(1024)
        with Copies(host) as copies:
            dev.copy_(host[0])  # out of a host buffer: 4 KiB
            host[1][:1024].copy_(dev)  # into one: 4 KiB
            dev.copy_(dev * 2)  # neither
    assert (copies.out_of, copies.into) == (4096, 4096)


def _dtensor_step(tensors) -> Ledger:
    """A DTensor forward and backward on rank 0 of 2 (the fake process group): a column- then a row-split
    linear, the loss under loss_parallel, whose handlers learn output shapes by running ops on fake tensors."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

    from labkit import dist

    with dist.fake_group(2) as mesh, tensors():
        model = parallelize_module(fake.materialize(lambda: torch.nn.Sequential(torch.nn.Linear(8, 16),
                                                                                torch.nn.Linear(16, 8),
                                                                                torch.nn.Linear(8, 6))),
                                   mesh, {"0": ColwiseParallel(), "1": RowwiseParallel(),
                                          "2": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
        ledger = Ledger("cpu").track_module(model)
        with ledger, loss_parallel():
            with marks.phase("forward", 0):
                loss = torch.nn.functional.cross_entropy(model(torch.ones(4, 8)), torch.zeros(4, dtype=torch.long))
            with marks.phase("backward", 0):
                loss.backward()
        return ledger


def test_a_dtensor_step_traces_as_it_runs_on_real_tensors():
    """The ledger looks through a functional collective's AsyncCollectiveTensor, takes a collective's wait as
    the input it returns on real tensors (the fake kernel makes a new tensor), and counts nothing while DTensor's
    sharding propagation runs ops on fake tensors to learn shapes: a fake trace is the real step, to the byte."""
    real, traced = _dtensor_step(contextlib.nullcontext), _dtensor_step(functools.partial(fake.tensors, block=None))
    assert max(traced.timeline().device["activations"]) > 0
    assert_same_timeline(real, traced)
