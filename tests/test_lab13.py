"""Lab 13: the traced step is the real step, byte for byte; the figures the page quotes; the levers'
claims re-traced; bad input is one line and exit code 2."""

from __future__ import annotations

import contextlib
import functools
import json
import time
from dataclasses import replace

import pytest
import torch
from conftest import ROOT, assert_clean_usage_error, assert_usage_error_in_process, load_lab, run_cli
from test_labkit_fake import assert_same_timeline

from labkit import cli, fake, labs, zoo

SCRIPT = "lab-13-will-it-fit/fit.py"
ISSUE_KEYS = {"model", "params", "per_rank_peak_bytes", "by_category", "predicted", "gpu", "capacity_bytes", "fits",
              "levers"}


@pytest.fixture(scope="module")
def lab13():
    return load_lab(13)


def small(lab13, **fields):
    return lab13.Config(model="small-llama", seq=32, batch=2, levers="none", **fields)


EXACT = functools.partial(fake.tensors, block=None)  # the real twin counts exact bytes: so does this trace


@pytest.mark.parametrize("fields", [
    {},  # mixed, AdamW as CUDA runs it (foreach)
    {"precision": "bf16", "optimizer": "adamw-fused", "checkpointing": "save-matmuls"},
    {"checkpointing": "save-alternate-matmuls"},  # torchtitan's op-level policy, under autocast
    {"precision": "fp32", "checkpointing": "every-k", "checkpoint_every": 2, "accumulation": 2},
    {"checkpointing": "every-kth-block", "checkpoint_every": 2},  # torchtitan's layer policy: the second block alone
    {"precision": "fp32", "optimizer": "sgd", "checkpointing": "full", "accumulation": 2},
    {"dp": 2, "zero_stage": 1},
    {"dp": 2, "zero_stage": 2},
    {"dp": 2, "zero_stage": 3, "checkpointing": "full"},
    {"offload": "optimizer"},
    {"optimizer_in_backward": True},  # each parameter's AdamW stepped by its gradient's hook, in backward
    {"offload_activations": True},  # Lab 09's hooks around the blocks
    {"offload_activations": True, "precision": "bf16", "checkpointing": "full", "optimizer_in_backward": True},
    {"dp": 2, "zero_stage": 3, "offload": "params"},
    {"task": "infer"},
    {"loss": "chunked", "checkpointing": "full"},
    {"loss": "fused-linear", "precision": "bf16", "accumulation": 2},
    {"loss": "fused-linear", "dp": 2, "zero_stage": 3},
    {"method": "lora", "loss": "chunked"},  # Lab 15's adapters: the frozen head's logits recomputed chunk by chunk
    {"method": "qlora", "precision": "bf16", "loss": "fused-linear", "checkpointing": "full"},  # no head gradient
    {"method": "lora", "compile": True, "checkpointing": "full", "loss": "chunked"},  # adapters compiled with the block
    {"float8": "tensorwise"},
    {"float8": "tensorwise", "precision": "bf16", "checkpointing": "full", "accumulation": 2},
    {"float8": "tensorwise", "dp": 2, "zero_stage": 3},
    {"task": "decode", "precision": "bf16", "kv_len": 48, "new_tokens": 1},
    {"task": "decode", "precision": "fp32", "new_tokens": 4},
    {"compile": True},
    {"compile": True, "checkpointing": "full", "accumulation": 2},  # the checkpoint inside each compiled block
    {"compile": True, "precision": "bf16", "checkpointing": "save-alternate-matmuls"},
    {"compile": True, "checkpointing": "every-kth-block", "checkpoint_every": 2},  # one block plain, one checkpointed
    {"compile": True, "checkpointing": "full", "dp": 2, "zero_stage": 3},  # FSDP2's hooks around each compiled block
    {"compile": True, "pp": 2, "accumulation": 3, "checkpointing": "full"},  # a stage's blocks compiled, under 1F1B
    {"compile": True, "dp": 4, "zero_stage": 2, "replicate": 2},
    {"compile": True, "precision": "bf16", "dp": 2, "zero_stage": 3, "offload": "params"},
    {"compile": True, "precision": "bf16", "optimizer": "adamw-fused", "accumulation": 2, "dp": 2, "zero_stage": 1,
     "loss": "chunked"},
    {"tp": 2, "dp": 2},  # tensor parallelism (DTensor) beside DDP: a 2 x 2 mesh
    {"tp": 2, "sp": True, "checkpointing": "save-matmuls"},
    {"tp": 2, "sp": True, "dp": 2, "zero_stage": 3},  # FSDP2 over TP's local shards
    {"pp": 2, "accumulation": 3},  # 1F1B's first stage: two in flight, one steady pair
    {"pp": 2, "accumulation": 3, "float8": "tensorwise"},  # a stage's float8 linears
    {"pp": 2, "accumulation": 2, "float8": "tensorwise-all-gather", "dp": 2, "zero_stage": 3, "checkpointing": "full"},
    {"dp": 4, "zero_stage": 3, "replicate": 2},  # HSDP: sharded over 2, replicated across 2
    {"dp": 2, "zero_stage": 3, "fsdp_units": "blocks-embed-head"},  # the embedding and the norm + head as units
    {"dp": 2, "zero_stage": 2, "fsdp_units": "blocks-embed-head", "loss": "fused-linear", "precision": "bf16"},
    {"dp": 2, "zero_stage": 3, "float8": "tensorwise-all-gather"},  # FSDP2 gathers the linears' float8 bits
    {"pp": 2, "accumulation": 2, "tp": 2, "sp": True, "dp": 2, "zero_stage": 3},  # all of them at once
    {"float8": "tensorwise", "tp": 2},  # torchao's float8 TP styles: one float8 cast per sublayer input, shared
    {"float8": "tensorwise", "tp": 2, "sp": True, "dp": 2, "zero_stage": 3, "checkpointing": "full"},  # float8 gathers
    {"float8": "tensorwise", "tp": 2, "sp": True, "pp": 2, "accumulation": 2},  # float8 TP styles on a stage
    {"cp": 2, "dp": 2, "zero_stage": 3},  # ring attention over 2 ranks; FSDP2 over dp x cp = 4
    {"cp": 2, "zero_stage": 3, "fsdp_units": "blocks-embed-head"},  # the ring beside the embedding and head units
    {"cp": 4, "zero_stage": 2, "precision": "bf16", "checkpointing": "full"},  # the ring again in the recompute
    {"cp": 2, "tp": 2, "sp": True, "dp": 2, "zero_stage": 3, "precision": "bf16"},  # the ring on TP's local heads
    {"cp": 2, "tp": 2, "dp": 4, "replicate": 2, "zero_stage": 2},  # HSDP: 2 x (2 x 2) FSDP ranks, each a TP pair
    {"cp": 2, "dp": 4, "replicate": 2, "zero_stage": 3, "precision": "bf16"},  # HSDP x CP, no TP: the 3-D mesh's ring
], ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()) or "default")
def test_the_traced_step_is_the_real_step_to_the_byte(lab13, fields):
    """The same code path on real CPU tensors and on fake ones: every allocation and free, every
    category at every phase peak (exact bytes on both sides: the CUDA rounding is off here)."""
    config = small(lab13, **fields)
    real = lab13.trace(config, tensors=contextlib.nullcontext)
    traced = lab13.trace(config, tensors=EXACT)
    assert_same_timeline(real.ledger, traced.ledger)
    assert real.derived == traced.derived
    assert traced.per_rank_peak_bytes > 0


@pytest.mark.parametrize("fields, collectives", [
    ({}, False), ({"dp": 2}, False),  # one rank; DDP (no ZeRO): its buckets are not traced
    ({"dp": 2, "zero_stage": 3}, True), ({"cp": 2, "zero_stage": 2}, True), ({"dp": 4, "zero_stage": 2, "replicate": 2}, True),
], ids=["one-rank", "ddp", "zero3", "cp", "hsdp"])
def test_what_collectives_fill_is_communication_wherever_a_process_group_runs(lab13, fields, collectives):
    """labkit's Traffic labels the buffers c10d's collectives fill (FSDP2's gathers and reductions, the ring's
    passes) whichever parallelism made the process group, and is left out where none exists. (DTensor's
    functional collectives under --tp are not c10d ops: their buffers stay temporaries.)"""
    traced = lab13.trace(small(lab13, **fields))
    assert (max(traced.timeline.device["communication"]) > 0) is collectives


def causal_attention(seed: int, tokens: int):
    """Random float64 q (4 heads), k and v (2 heads) and an output gradient, and the reference: leaf copies
    of q, k, v after scaled_dot_product_attention's causal output (returned) has been backpropagated."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, h, tokens, 8, dtype=torch.float64, generator=g) for h in (4, 2, 2))
    dout = torch.randn(q.shape, dtype=torch.float64, generator=g)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = torch.nn.functional.scaled_dot_product_attention(*whole, is_causal=True, enable_gqa=True)
    expected.backward(dout)
    return (q, k, v, dout), whole, expected


@pytest.mark.parametrize("balanced", [True, False], ids=["head-tail", "contiguous"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_ring_attention_over_cp_ranks_is_full_causal_attention(cp, balanced):
    """N ranks (threads) passing K/V chunks round a ring give scaled_dot_product_attention's causal
    output and gradients on the whole sequence (grouped-query heads), within float64's rounding."""
    context = labs.load(13, "fit_context")
    (q, k, v, dout), whole, expected = causal_attention(seed=0, tokens=32)
    out, grads = context.simulate(q, k, v, dout, cp, balanced)
    torch.testing.assert_close(out, expected.detach(), rtol=0, atol=1e-12)
    for got, leaf in zip(grads, whole):
        torch.testing.assert_close(got, leaf.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("tp", [1, 2])
def test_the_cp_trace_passes_every_chunk_round_the_ring(lab13, monkeypatch, tp):
    """Rank 0 of --cp 4, two blocks, one micro-batch: each attention passes its K/V on 3 times in forward,
    and in backward K/V 3 times and the gradients 4 (home again); each pass receives into fresh buffers
    (communication) shaped as what it sends: K and V of T / cp tokens, their gradients in float32. Under
    --tp 2 the ring carries this TP rank's KV heads alone, to the rank --tp ranks on (tp is the innermost
    dimension of the mesh, as torchtitan's)."""
    context = labs.load(13, "fit_context")
    passes, strides, plain = [], set(), context.FakeGroupRing.pass_on
    monkeypatch.setattr(context.FakeGroupRing, "pass_on",
                        lambda self, t: passes.append(t) or strides.add(self.stride) or plain(self, t))
    config = small(lab13, cp=4, tp=tp, sp=tp > 1, zero_stage=3, precision="bf16")
    lab13.trace(config, tensors=EXACT)
    assert len(passes) == config.spec.layers * (3 + 3 + 4) == 20
    kv = (config.batch, config.spec.kv_heads // tp, config.seq // 4, config.spec.head_dim)
    assert {tuple(t.shape) for sent in passes for t in sent} == {kv}
    assert {t.dtype for sent in passes for t in sent} == {torch.bfloat16, torch.float32}
    assert strides == {tp}


def test_the_ring_on_each_tp_ranks_local_heads_is_full_causal_attention():
    """--cp 2 under --tp 2: each TP rank rings its own slice of the heads (2 of 4 query heads, 1 of 2 KV heads,
    as the column-parallel Q, K and V projections leave them); the two ranks' outputs and gradients, side by
    side, are scaled_dot_product_attention's on every head of the whole sequence, within float64's rounding."""
    context = labs.load(13, "fit_context")
    (q, k, v, dout), whole, expected = causal_attention(seed=1, tokens=16)
    ranks = [context.simulate(*(t.chunk(2, dim=1)[r] for t in (q, k, v, dout)), 2) for r in range(2)]
    torch.testing.assert_close(torch.cat([out for out, _ in ranks], dim=1), expected.detach(), rtol=0, atol=1e-12)
    for i, leaf in enumerate(whole):
        torch.testing.assert_close(torch.cat([grads[i] for _, grads in ranks], dim=1), leaf.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("loss", ["chunked", "fused-linear"])
@pytest.mark.parametrize("precision", ["fp32", "mixed"])
@pytest.mark.parametrize("method", ["full", "lora"])
def test_chunked_and_fused_losses_equal_the_full_loss_and_its_gradients(lab13, loss, precision, method):
    """--loss chunked and fused-linear are the model's own cross-entropy, one chunk of tokens at a time:
    the same loss and the same gradient on every trained parameter (every weight, or LoRA's adapters on a
    frozen base and head, their B made nonzero so that A gets a gradient too), within 1e-5 relative in fp32
    (the sums run in another order) and 2e-2 under bf16 autocast (bf16 matmuls, each chunk rounded on its
    own). 17 tokens in 8 chunks leave a short last chunk; two targets are ignored (-100)."""
    fit_loss = load_lab(13, "fit_loss")
    torch.manual_seed(0)
    model = zoo.get("small-llama").build()
    if method == "lora":  # Lab 15's adapters, the base in its dtype for --precision (bf16 under mixed, as PEFT)
        lab15 = labs.load(15)
        model.to(lab15.weights_dtype(method, precision))
        lab15.prepare(model, method, precision, rank=4)
        for adapter in labs.load(15, "lora").adapters(model):
            torch.nn.init.normal_(adapter.lora_B.weight, std=0.02)
    idx = torch.randint(0, model.spec.vocab, (1, 17))
    targets = idx.clone()
    targets[0, :2] = fit_loss.IGNORE

    def loss_and_grads(head_loss):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "mixed"):
            value = model(idx, targets, head_loss=head_loss)[1]
        value.backward()
        return value.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    want, want_grads = loss_and_grads(None)
    got, got_grads = loss_and_grads(fit_loss.LOSSES[loss])
    tol = 1e-5 if precision == "fp32" else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=tol, atol=tol * grad.abs().max().item(), msg=name)


@pytest.mark.parametrize("checkpointing", ["every-k", "save-alternate-matmuls", "every-kth-block"])
def test_checkpointed_blocks_give_the_gradients_of_none(lab13, checkpointing):
    """--checkpointing every-k (one segment of small-llama's two blocks), torchtitan's op-level policy and its
    layer policy (every-kth-block: the second block checkpointed) run Lab 04's run_blocks (fit_every_kth's) on a
    zoo Llama: the same loss and the same gradient on every parameter as keeping everything, bit for bit (the
    recompute runs the same ops on the same inputs: tolerance zero)."""
    torch.manual_seed(0)
    model = zoo.get("small-llama").build()
    idx = torch.randint(0, model.spec.vocab, (2, 16))

    def loss_and_grads(strategy):
        model.zero_grad(set_to_none=True)
        run = load_lab(13, "fit_every_kth").run_blocks
        value = model(idx, idx, run_blocks=functools.partial(run, strategy=strategy, every=2))[1]
        value.backward()
        return value.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    want, want_grads = loss_and_grads("none")
    got, got_grads = loss_and_grads(checkpointing)
    assert torch.equal(got, want)
    assert all(torch.equal(got_grads[n], g) for n, g in want_grads.items())


@pytest.mark.parametrize("k, recomputed", [(1, [0, 1, 2, 3, 4]), (2, [1, 3]), (3, [2]), (5, [4])])
def test_every_kth_block_recomputes_torchtitans_blocks(lab13, k, recomputed):
    """every-kth-block on five blocks: blocks K - 1, 2K - 1, ... (torchtitan's count from 1 reaching a multiple
    of K) run their forward again in backward; the rest run it once (the last L mod K are not checkpointed)."""
    fit_every_kth = load_lab(13, "fit_every_kth")
    model = replace(zoo.get("small-llama"), layers=5).build()
    calls = [0] * 5
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda module, args, i=i: calls.__setitem__(i, calls[i] + 1))
    idx = torch.randint(0, model.spec.vocab, (1, 8))
    run = functools.partial(fit_every_kth.run_blocks, strategy="every-kth-block", every=k)
    model(idx, idx, run_blocks=run)[1].backward()
    assert [i for i, n in enumerate(calls) if n == 2] == recomputed and set(calls) <= {1, 2}


def test_the_help_says_what_every_kth_block_keeps(lab13):
    words = " ".join(cli.parser(lab13.Config, "fit.py").format_help().split())
    assert "every-kth-block (torchtitan's layer policy): blocks K, 2K, ... (counted from 1) keep their input only, " \
        "every other block everything" in words and "every-kth-block: every K-th block checkpointed" in words


@pytest.mark.parametrize("optimizer", ["adamw", "adamw-fused", "sgd"])
def test_the_step_in_backward_gives_the_plain_steps_weights(lab13, optimizer):
    """--optimizer-in-backward: two steps of small-llama, each parameter's optimizer stepped by its own hook in
    backward, leave the same weights, bit for bit, as the plain optimizer stepping them all after backward; and
    no gradient is left once backward is done."""
    fit_backward = load_lab(13, "fit_backward")
    make, kwargs = lab13.OPTIMIZERS[optimizer]
    kwargs = kwargs | {"lr": 1e-2} | ({} if kwargs.get("fused") else {"foreach": False})  # one kernel for both
    torch.manual_seed(0)
    plain = zoo.get("small-llama").build()
    fused = zoo.get("small-llama").build()
    fused.load_state_dict(plain.state_dict())
    idx = torch.randint(0, plain.spec.vocab, (2, 16))
    step_all = make(plain.parameters(), **kwargs)
    in_backward = fit_backward.OptimizerInBackward(fused.parameters(), functools.partial(make, **kwargs))
    assert len(in_backward.each) == len(list(fused.parameters()))  # one optimizer per parameter
    for _ in range(2):
        plain(idx, idx)[1].backward()
        step_all.step()
        step_all.zero_grad(set_to_none=True)
        fused(idx, idx)[1].backward()
        assert all(p.grad is None for p in fused.parameters())
    for (name, a), b in zip(plain.named_parameters(), fused.parameters()):
        assert torch.equal(a, b), name


def test_offloaded_activations_wait_on_the_host_and_give_the_same_gradients(lab13):
    """--offload-activations on real tensors: the blocks' saved tensors leave the device for the host (at toy size
    those under 4 KiB stay: what stays at real size, the last two saved, is the calculator's formula, held to the
    trace by tests/test_fit_formula.py), and the loss and every gradient are those of the step without the
    hooks, bit for bit."""
    fit_offload = load_lab(13, "fit_offload")
    config = small(lab13, precision="fp32", offload_activations=True)
    torch.manual_seed(0)
    model = zoo.get("small-llama").build()
    idx = torch.randint(0, model.spec.vocab, (2, 32))

    def loss_and_grads(offload):
        model.zero_grad(set_to_none=True)
        blocks = fit_offload.offloaded(functools.partial(lab13.lab04.run_blocks, strategy="none"),
                                       replace(config, offload_activations=offload), model, idx)
        value = model(idx, idx, run_blocks=blocks)[1]
        value.backward()
        return value.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    want, want_grads = loss_and_grads(False)
    got, got_grads = loss_and_grads(True)
    assert torch.equal(got, want) and all(torch.equal(got_grads[n], g) for n, g in want_grads.items())
    traced = lab13.trace(config, tensors=contextlib.nullcontext)
    tl = traced.timeline
    end = next(s for s in tl.spans if s.name == "forward").end - 1
    plain = lab13.trace(replace(config, offload_activations=False), tensors=contextlib.nullcontext).timeline
    moved = plain.device["activations"][end] - tl.device["activations"][end]
    assert moved > plain.device["activations"][end] / 3 and max(tl.host_total()) >= moved


@pytest.mark.parametrize("precision, checkpointing, method", [
    ("fp32", "none", "full"), ("mixed", "none", "full"), ("fp32", "full", "full"), ("mixed", "save-matmuls", "full"),
    ("mixed", "none", "lora"), ("fp32", "full", "lora"),
    ("fp32", "every-kth-block", "full")])  # Lab 15's adapters compiled with their block
def test_compiled_blocks_equal_eager_and_save_the_same_bytes_fake_as_real(lab13, precision, checkpointing, method):
    """--compile: each block through AOTAutograd with inductor's partition, its two graphs run as Python, the
    checkpoint (if any) inside the compiled block as torchtitan puts it. The loss and every trained gradient equal the
    eager step's with the same checkpointing (1e-5 relative in fp32; 2e-2 under bf16 autocast, where the graph
    rounds in its own order). The bytes each block's forward saves for backward, read off its outputs as it
    runs, are the same on fake tensors as on real ones. Under full checkpointing they are none (the block's
    input is its input; the rng state is host memory) and the activations at the end of forward equal eager's; otherwise
    some, and fewer activations than eager's (the partitioner recomputes some)."""
    from types import SimpleNamespace

    from labkit import marks
    from labkit.ledger import Ledger
    fit_compile = load_lab(13, "fit_compile")
    config = SimpleNamespace(accumulation=1, checkpointing=checkpointing, checkpoint_every=2, pp=1)  # every-kth: the second

    def step(tensors, compile_blocks):
        with tensors():
            torch.manual_seed(0)
            previous = torch.get_default_dtype()  # under LoRA, built in the frozen base's dtype (bf16 under mixed)
            torch.set_default_dtype(labs.load(15).weights_dtype(method, precision))
            model = zoo.get("small-llama").build()
            torch.set_default_dtype(previous)
            if method == "lora":  # rank-4 adapters on the frozen base, as PEFT's, B made nonzero
                labs.load(15).prepare(model, method, precision, rank=4)
                for adapter in labs.load(15, "lora").adapters(model):
                    torch.nn.init.normal_(adapter.lora_B.weight, std=0.02)
            idx = torch.arange(34).remainder(model.spec.vocab).view(2, 17)
            ledger = Ledger("cpu").track_module(model)
            blocks = functools.partial(fit_compile.run_blocks, strategy=checkpointing if not compile_blocks
                                       else "none", every=2)
            with ledger, fit_compile.compiled(model, SimpleNamespace(compile=compile_blocks, **vars(config)), 1) as backend:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "mixed"), marks.phase("forward", 0):
                    loss = model(idx, idx, run_blocks=blocks)[1]
                loss.backward()
            grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
            tl = ledger.timeline()  # the activations at the end of forward
            return loss, grads, backend, tl.device["activations"][next(s for s in tl.spans if s.name == "forward").end - 1]

    want, want_grads, _, eager_saved = step(contextlib.nullcontext, False)
    got, got_grads, real, compiled_saved = step(contextlib.nullcontext, True)
    tol = 1e-5 if precision == "fp32" else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=tol, atol=tol * grad.abs().max().item(), msg=name)
    traced = step(functools.partial(fake.tensors, block=None), True)[2]
    kth = checkpointing == "every-kth-block"  # a plain block and a checkpointed one: two graphs
    # under LoRA the first block's input (the frozen embedding's output) needs no gradient: a graph of its own
    assert real.graphs == (2 if method == "lora" else 1 + kth) and real.calls == 2 and traced.saved == real.saved
    assert not kth or real.saved[0] > 0 == real.saved[1]  # every-kth: the second block checkpointed, nothing saved
    assert (real.saved == [0, 0]) is (checkpointing == "full")
    if checkpointing == "full":  # each block's input alone, as eager checkpointing keeps it
        assert compiled_saved == eager_saved
    else:
        assert 0 < compiled_saved < eager_saved


@pytest.mark.parametrize("precision, checkpointing", [("fp32", "none"), ("mixed", "full")])
def test_a_compiled_pipeline_stage_gives_the_eager_stages_gradients(precision, checkpointing):
    """--compile --pp 2: the first stage's two blocks (of a four-block small-llama) each compiled alone
    (fit_compile.compiled), Lab 13's 1F1B schedule running three micro-batches through them, the same gradients
    coming back from the next stage. Every gradient equals the eager stage's (1e-5 relative in fp32; 2e-2 under bf16
    autocast, where the graph rounds in its own order), and each block ran compiled once per micro-batch."""
    from types import SimpleNamespace

    from test_lab13_float8 import KeepGradients
    fit_compile, pipeline = load_lab(13, "fit_compile"), load_lab(13, "fit_pipeline")
    spec = pipeline.stage_spec(replace(zoo.get("small-llama"), layers=4), 2)
    config = SimpleNamespace(accumulation=3, checkpointing=checkpointing, pp=2)

    def stage(compile_blocks):
        torch.manual_seed(0)
        model = spec.build()
        pipeline.first_stage(model)
        g = torch.Generator().manual_seed(1)
        idx = torch.arange(34).remainder(spec.vocab).view(2, 17)
        blocks = functools.partial(fit_compile.lab04.run_blocks, strategy="none" if compile_blocks else checkpointing)
        optimizer = KeepGradients(model)
        with fit_compile.compiled(model, SimpleNamespace(compile=compile_blocks, **vars(config)), 2) as backend:
            pipeline.first_stage_step(model, optimizer, idx, recipe="bf16" if precision == "mixed" else "fp32",
                                      blocks=blocks, stages=2, accumulation=3,
                                      receive=lambda out: torch.randn(out.shape, generator=g, dtype=out.dtype))
        return optimizer.grads, backend

    want, _ = stage(False)
    got, backend = stage(True)
    assert backend.calls == 2 * 3 and set(got) == set(want) and len(want) == 1 + 2 * 9  # embedding; 9 per block
    tol = 1e-5 if precision == "fp32" else 2e-2
    for name, grad in want.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(got[name], grad, rtol=tol, atol=tol * grad.abs().max().item(), msg=name)


def test_fsdp2_hooks_run_eagerly_around_each_compiled_block(lab13, monkeypatch):
    """--compile under ZeRO-3, checkpointed: FSDP2's hooks are torch._dynamo.disable'd, so Dynamo leaves them out
    of the block's graph without a graph break. One forward graph for both blocks, no collective in it, and
    the all-gathers that the hooks run are still seen by Traffic (the communication category)."""
    from torch._dynamo.utils import counters
    fit_compile = load_lab(13, "fit_compile")
    graphs, forward = [], fit_compile.Partitioned.forward
    monkeypatch.setattr(fit_compile.Partitioned, "forward", lambda self, g, inputs: graphs.append(g) or forward(self, g, inputs))
    breaks = sum(counters["graph_break"].values())  # Dynamo's counters live as long as the process
    traced = lab13.trace(small(lab13, compile=True, checkpointing="full", dp=2, zero_stage=3))
    ops = {str(node.target) for g in graphs for node in g.graph.nodes if node.op == "call_function"}
    assert len(graphs) == 1 and "aten.mm.default" in ops and sum(counters["graph_break"].values()) == breaks
    assert not [op for op in ops if any(word in op for word in ("c10d", "fsdp", "all_gather", "reduce_scatter"))]
    assert max(traced.timeline.device["communication"]) > 0


@pytest.mark.parametrize(("fields", "fragment"), [
    ({"task": "infer"}, "no backward to partition"), ({"checkpointing": "every-k", "checkpoint_every": 2},
                                                       "compiled alone"), ({"model": "small-mixtral"}, "dense zoo Llama"),
    ({"optimizer_in_backward": True}, "--optimizer-in-backward with --compile is not traced together"),
    ({"offload_activations": True}, "--offload-activations with --compile is not traced together"),
    ({"tp": 2}, "DTensor's split blocks are not traced compiled"),
    ({"method": "qlora", "precision": "bf16"}, "NF4 linears")])
def test_compile_refuses_what_it_does_not_trace(lab13, fields, fragment):
    with pytest.raises(lab13.UsageError, match=fragment):
        lab13.Config(**{"model": "small-llama", "compile": True, **fields})


def test_why_compile_refuses_tp_a_compiled_blocks_input_from_an_async_redistribute_loses_its_gradient():
    """The reason --compile --tp is refused, held (fit_compile.check_compile): on the pinned torch, an embedding split by
    DTensor's RowwiseParallel (whose output redistribute is async_op=True) feeding a block compiled by stock AOTAutograd
    (aot_eager) fails in backward on real tensors; the same model eager does not. When a torch upgrade fixes it, this
    test fails, and the refusal can be lifted (twins and gradients first)."""
    from torch import nn
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    from labkit import dist as dist_kit

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    def step(compile_block: bool) -> None:
        torch._dynamo.reset()
        model = nn.ModuleDict({"embed": nn.Embedding(16, 8), "block": Block()})
        with dist_kit.fake_group(2, device="cpu") as mesh:
            parallelize_module(model, mesh, {"embed": RowwiseParallel(input_layouts=Replicate(),
                                                                      output_layouts=Replicate())})
            if compile_block:
                model["block"].compile(backend="aot_eager", fullgraph=True)
            model["block"](model["embed"](torch.arange(4).view(1, 4))).sum().backward()

    step(False)
    with pytest.raises(AttributeError, match="_local_tensor"):
        step(True)


def test_the_ladder_under_compile_offers_only_levers_it_can_trace(lab13):
    """Activation offload and the optimizer step in backward are refused with --compile, so the ladder leaves
    them out rather than stop at them; checkpointing, inside each compiled block, stays."""
    levers = load_lab(13, "fit_levers")
    config = small(lab13, compile=True)
    assert not levers._traceable(config, {"offload_activations": True})
    assert levers._traceable(config, {"checkpointing": "full"})
    names = {lever.name for lever, changes in ((lv, lv.pull(config)) for lv in levers.LEVERS) if changes
             and levers._traceable(config, changes)}
    assert "full checkpointing" in names and not {"activation offload", "optimizer step in backward"} & names


def test_sharded_adamw_allocates_what_dtensors_adamw_allocates(lab13):
    """ZeRO-2/3 step the local shards (ShardOptimizer): the same allocations in the optimizer step as
    AdamW over FSDP2's DTensors, once DTensor's sharding propagation has warmed up."""
    from labkit.ledger import Ledger

    config = small(lab13, dp=2, zero_stage=3)

    def optimizer_allocations(make_optimizer, steps):
        with lab13.fake_process_group(2, "cpu") as mesh, fake.tensors():
            model = lab13.build(config.spec, torch.float32, "cpu")
            optimizer = make_optimizer(lab13.shard(model, config, mesh), model)
            idx = torch.zeros(2, 32, dtype=torch.long)
            for _ in range(steps):  # the last step is the steady state: AdamW's state exists
                model(idx, idx)[1].backward()
                ledger = Ledger("cpu")
                with ledger:
                    optimizer.step()
                optimizer.zero_grad()
        return sorted((r.op, r.nbytes) for r in ledger.records)

    local = optimizer_allocations(lambda shard_optimizer, model: shard_optimizer, 2)
    dtensor = optimizer_allocations(lambda _, model: torch.optim.AdamW(model.parameters(), foreach=True), 2)
    assert local and local == dtensor


def test_llama_3_8b_traces_within_15_cpu_seconds_and_counts_every_parameter(lab13):
    """The issue's figure: P = 8,030,261,248; parameters as traced = each tensor's fp32 bytes,
    rounded to 512-byte blocks; the whole run (one trace, no levers) within 15 s of CPU time."""
    t0 = time.process_time()
    summary = lab13.run(lab13.Config(model="llama-3-8b", seq=4096, levers="none")).summary()
    cpu_seconds = time.process_time() - t0
    assert summary["params"] == 8_030_261_248
    with torch.device("meta"):
        tensors = [p.numel() for p in zoo.get("llama-3-8b").build().parameters()]
    assert summary["category_max"]["parameters"] == sum(-(-4 * n // 512) * 512 for n in tensors)
    assert summary["by_category"]["optimizer_state"] == 2 * summary["category_max"]["parameters"] + 512 * len(tensors)
    assert cpu_seconds <= 15, cpu_seconds


def test_a_tied_head_is_counted_once(lab13):
    trace = lab13.trace(lab13.Config(model="small-gpt", seq=32, levers="none"))
    spec = zoo.get("small-gpt")
    assert spec.tied and trace.derived["category_max"]["parameters"] < 4 * spec.param_count() + 512 * 64


def test_fused_adamw_drops_the_foreach_copy_of_a_moment(lab13):
    """The page's claim: CUDA's default AdamW (foreach) holds one more moment's worth of temporaries
    in its step; the fused one none of that size."""
    def optimizer_temporaries(optimizer):
        return lab13.trace(small(lab13, optimizer=optimizer)).derived["by_phase"]["optimizer"]["temporaries"]

    moment = lab13.trace(small(lab13)).derived["by_phase"]["optimizer"]["optimizer_state"] // 2
    assert optimizer_temporaries("adamw") >= moment - 512 * 16
    assert optimizer_temporaries("adamw-fused") < moment // 4


def test_autocast_caches_a_bf16_copy_of_every_weight_through_forward(lab13):
    """The page's claim for mixed precision (fp32 weights + autocast): even with full checkpointing the
    forward holds a bf16 cast of every block weight, autocast's cache, until the autocast block ends.
    A short sequence, so that the weights dwarf everything else."""
    spec = zoo.get("llama-3.2-1b")
    blocks = spec.param_count() - spec.vocab * spec.width - spec.width  # tied: one embedding matrix

    def forward_temporaries(precision):
        config = lab13.Config(model=spec.name, seq=16, checkpointing="full", precision=precision, levers="none")
        return lab13.trace(config).derived["by_phase"]["forward"]["temporaries"]

    assert forward_temporaries("mixed") >= 2 * blocks
    assert forward_temporaries("bf16") < 2 * blocks / 20


def linear_weight_bytes(name: str, element: int) -> int:
    with torch.device("meta"):
        model = zoo.get(name).build()
    return element * sum({id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)}
                         .values())


def test_autocast_saves_a_bf16_cast_of_every_linear_weight_and_the_report_names_it(lab13):
    """Under torch AMP every linear's weight is cast to bf16 and saved for backward: the activations
    hold exactly 2 B x the linear parameters of those casts, and the gap table names them."""
    trace = lab13.trace(small(lab13), tensors=EXACT)
    casts = trace.derived["weight_casts"]
    assert casts["at_activations_max"] == casts["max"] == linear_weight_bytes("small-llama", 2)
    assert casts["max"] < trace.derived["category_max"]["activations"]
    rows = {r[0]: r for r in load_lab(13, "fit_report").gap_table(trace).rows}
    assert rows["of which: bf16 weight casts"][1] == casts["max"]


def test_zero3_mixed_keeps_no_unsharded_weight_copy(lab13, monkeypatch):
    """ZeRO-3 with --precision mixed is FSDP2's MixedPrecisionPolicy (bf16 gathers, fp32 reduction): no
    weight cast is saved. Autocast over FSDP2's fp32 gathers instead saves a bf16 copy of every
    unsharded weight (the detector sees them there), and holds more activations than fp32 itself."""
    config = small(lab13, dp=2, zero_stage=3)
    policy = lab13.trace(config, tensors=EXACT).derived
    fp32 = lab13.trace(replace(config, precision="fp32"), tensors=EXACT).derived
    monkeypatch.setattr(lab13, "fsdp_mixed", lambda _config: False)
    autocast = lab13.trace(config, tensors=EXACT).derived
    assert policy["weight_casts"]["max"] == 0
    assert autocast["weight_casts"]["max"] == linear_weight_bytes("small-llama", 2)
    assert policy["category_max"]["activations"] < fp32["category_max"]["activations"]
    assert policy["category_max"]["activations"] < autocast["category_max"]["activations"]


def test_a_prefills_phases_table_adds_up_to_the_verdict(lab13):
    """Each category once (the KV cache was listed twice): the table's total is the per-rank peak."""
    trace = lab13.trace(small(lab13, task="infer"))
    rows = load_lab(13, "fit_report").phases_table(trace).rows
    assert [r[0] for r in rows][-1] == "per-rank peak" and rows[-1][1] == trace.per_rank_peak_bytes
    assert all(r[1] == sum(r[2:]) for r in rows)


def test_the_gpu_measurement_rehearses_on_cpu(lab13, tmp_path):
    """measure_on_gpu's plumbing, on real CPU tensors: the same step run for real, its ledger equal to
    the exact-byte trace; no allocator counters on a CPU, and multi-rank steps are not run."""
    config = small(lab13, precision="bf16", checkpointing="full")
    measured = lab13.measure_on_gpu(config, lab13.trace(config, tensors=EXACT), device="cpu")
    assert measured["measured"] and measured["ledger_peak_bytes"] == measured["traced_peak_bytes"] > 0
    assert measured["max_memory_allocated"] is None and measured["traced_over_allocated"] is None
    sharded = small(lab13, dp=2, zero_stage=3)
    assert not lab13.measure_on_gpu(sharded, lab13.trace(sharded), device="cpu")["measured"]
    past = lab13.Config(model="small-gpt", seq=256, device="cpu", levers="none")  # context 128: traced, not run
    skipped = lab13.measure_on_gpu(past, lab13.trace(past), device="cpu")
    assert not skipped["measured"] and "context" in skipped["why"]
    proc = run_cli("../bench/fit_gpu_bench.py", "--device", "cpu", "--out", str(tmp_path / "b.json"))
    assert proc.returncode == 0, proc.stderr
    cases = json.loads((tmp_path / "b.json").read_text())["cases"].values()
    assert len(cases) == 3 and all(c["ledger_peak_bytes"] > 0 and c["measured"] for c in cases)
    assert [c["config"].get("method") for c in cases] == [None, None, "qlora"]  # Lab 15's QLoRA step too
    assert not any("simulated_over_reserved" in c for c in cases)  # no reserved segments on a CPU


@pytest.mark.cuda
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_on_a_gpu_the_trace_is_the_allocators_peak_within_3_percent(lab13, checkpointing):
    """Issue 13, clause 6: the traced peak against torch.cuda.max_memory_allocated over the same step
    (less what the allocator held before it: cuBLAS workspaces), within 3 %."""
    config = lab13.Config(model="llama-3.2-1b", seq=1024, precision="bf16", checkpointing=checkpointing,
                          device="cuda", levers="none")
    measured = lab13.run(config).measured
    assert measured["measured"], measured
    assert abs(measured["traced_over_allocated"] - 1) <= 0.03, measured
    assert measured["max_requested_bytes"] <= measured["max_memory_allocated"]


def test_json_has_the_issues_keys_and_the_formula_beside_each_category():
    proc = run_cli(SCRIPT, "--model", "small-llama", "--seq", "64", "--gpu", "l4-24gb", "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert ISSUE_KEYS <= set(summary)
    assert set(summary["predicted"]) == set(summary["by_category"]) >= {"parameters", "gradients", "optimizer_state",
                                                                       "activations", "temporaries"}
    assert summary["fits"] is True and summary["levers"] == []
    assert summary["per_rank_peak_bytes"] == sum(summary["by_category"].values()) <= summary["capacity_bytes"]


def test_levers_come_cheapest_first_and_each_saves_what_it_claims(lab13):
    """A step that does not fit an L4: each lever's flags, traced again, give the saving it reported,
    the derived zeros included (a lever that cannot touch the peak's phase)."""
    config = lab13.Config(model="llama-3.2-1b", seq=256, precision="fp32", gpu="l4-24gb", levers="all")
    result = lab13.run(config)
    assert not result.trace.fits
    order = [lever.name for lever in load_lab(13, "fit_levers").LEVERS]
    names = [row["name"] for row in result.levers]
    assert names == sorted(names, key=order.index)
    derived = [row for row in result.levers if row["alone"]["how"].startswith("derived")]
    top = result.levers[0]
    assert derived and top not in derived
    for row in [top, *derived]:
        again = lab13.trace(replace(config, levers="none", **row["changes"]))
        assert result.trace.per_rank_peak_bytes - again.per_rank_peak_bytes == row["alone"]["saves_bytes"], row["name"]
    assert top["name"] == "fused AdamW" and top["alone"]["saves_bytes"] == top["together"]["saves_bytes"] > 0
    assert top["flags"] == ["--model", "llama-3.2-1b", "--seq", "256", "--precision", "fp32", "--optimizer",
                            "adamw-fused", "--gpu", "l4-24gb"]
    fitting = [row["together"] for row in result.levers if row["together"] and row["together"]["fits"]]
    assert fitting and lab13.trace(cli.parse(lab13.Config, fitting[0]["flags"])[0]).fits
    labels = {row["name"]: row["numerics"] for row in result.levers}
    assert labels["fused AdamW"] == "exact" and labels["bf16 weights and state"] == "numerics-changing"


def test_exact_levers_come_before_those_that_change_the_numerics():
    """The ladder tries every exact lever (the same loss and gradients) before bf16 matmuls or bf16 weights
    and moments: optimizer offload, an exact one, comes before pure bf16."""
    levers = load_lab(13, "fit_levers").LEVERS
    exact = [lever.exact for lever in levers]
    assert exact == sorted(exact, reverse=True)
    assert {lever.name for lever in levers if not lever.exact} == {"mixed precision", "bf16 weights and state"}
    names = [lever.name for lever in levers]
    assert names.index("optimizer offload") < names.index("bf16 weights and state")
    assert names.index("chunked loss") < names.index("ZeRO-1")


def test_the_float8_all_gather_is_the_float8_step_bit_for_bit_on_one_rank():
    """--float8 tensorwise-all-gather (fit_float8_gather.py): FSDP2's extension casts each shard to float8 before the
    all-gather, with the whole weight's scale. On one rank in bf16 the gather moves nothing, so the loss and every
    gradient equal those of --float8 tensorwise (which casts the gathered bf16 weight) bit for bit; and the sharded
    weight is the wrapper whose hooks FSDP2 calls."""
    from labkit import dist as dist_kit
    fit_float8, lab11 = load_lab(13, "fit_float8"), labs.load(11)

    def step(recipe):
        with dist_kit.fake_group(1) as mesh:
            torch.manual_seed(0)
            model = zoo.get("small-llama").build().to(torch.bfloat16)
            fit_float8.convert(model, recipe)
            lab11.wrap(3, model, mesh, lr=1e-3)
            idx = torch.randint(0, model.spec.vocab, (2, 16), generator=torch.Generator().manual_seed(1))
            loss = model(idx, idx)[1]
            loss.backward()
            shard = type(model.blocks[0].attn.q_proj.weight.to_local()).__name__
            return loss.detach(), {n: p.grad.full_tensor() for n, p in model.named_parameters()}, shard

    want, want_grads, plain = step("tensorwise")
    got, got_grads, wrapped = step("tensorwise-all-gather")
    assert (plain, wrapped) == ("Tensor", "Float8GatherWeight")
    assert torch.equal(got, want) and all(torch.equal(got_grads[n], g) for n, g in want_grads.items())


def test_the_fsdp_units_lever_is_exact_and_saves_what_it_claims(lab13):
    """Under ZeRO-3, the embedding and the head as FSDP2 units of their own (torchtitan's) is an exact lever: the
    ladder offers it, the bytes it reports saved are the step re-traced with --fsdp-units blocks-embed-head (the
    root no longer gathered whole through backward), and it is not offered once pulled or without FSDP2."""
    levers = load_lab(13, "fit_levers")
    config = small(lab13, dp=2, zero_stage=3)
    rows = {row["name"]: row for row in levers.search(lab13.trace(config), lab13.trace, every=True)}
    row = rows["embedding and head as FSDP units"]
    again = lab13.trace(replace(config, fsdp_units="blocks-embed-head"))
    assert row["numerics"] == "exact" and row["changes"] == {"fsdp_units": "blocks-embed-head"}
    assert row["alone"]["saves_bytes"] == lab13.trace(config).per_rank_peak_bytes - again.per_rank_peak_bytes > 0
    lever = levers.LEVER["embedding and head as FSDP units"]
    assert lever.pull(again.config) is None and lever.pull(small(lab13, dp=2, zero_stage=1)) is None


def test_the_chunked_loss_lever_saves_what_it_claims_where_the_logits_hold_the_peak(lab13):
    """Llama-3.2-1B at 16k tokens with full checkpointing: the loss's logits hold the peak, so the ladder
    pulls the chunked loss (exact: it comes before any lever that changes the numerics) and the saving it
    reports is the step re-traced with --loss chunked."""
    config = lab13.Config(model="llama-3.2-1b", seq=16384, precision="bf16", optimizer="adamw-fused",
                          checkpointing="full", gpu="l4-24gb")
    result = lab13.run(config)
    row = next(r for r in result.levers if r["name"] == "chunked loss")
    assert row["changes"] == {"loss": "chunked"} and row["together"]["saves_bytes"] > 2**30
    again = lab13.trace(replace(config, levers="none", loss="chunked"))
    assert result.trace.per_rank_peak_bytes - again.per_rank_peak_bytes == row["alone"]["saves_bytes"] \
        == row["together"]["saves_bytes"]


def test_the_chunked_loss_lever_is_offered_under_lora_and_pulls_a_config_that_traces(lab13):
    """Under LoRA and QLoRA the ladder offers the chunked loss too (the frozen head's logits in chunks), and the
    configuration it pulls is one Lab 13 accepts."""
    levers = load_lab(13, "fit_levers")
    for fields in ({"method": "lora"}, {"method": "qlora", "precision": "bf16", "checkpointing": "full"}):
        config = small(lab13, **fields)
        assert levers.LEVER["chunked loss"].pull(config) == {"loss": "chunked"}
        assert replace(config, loss="chunked").loss == "chunked"  # __post_init__ runs again: accepted


def test_a_decode_step_holds_the_preallocated_cache_and_the_formula_follows_it(lab13):
    """--task decode: Llama-3-8B in bf16, 32 sequences, a cache of 8,192 tokens each, 4 new tokens: the KV
    cache traced is every layer's K and V at full length (Lab 01's kv_cache_bytes, to the byte), and the
    calculator's formula is the traced peak within 0.1 %."""
    fit = labs.load(1, "fit_formula")
    config = lab13.Config(model="llama-3-8b", task="decode", precision="bf16", batch=32, kv_len=8192, new_tokens=4,
                          levers="none")
    trace = lab13.trace(config)
    spec = config.spec
    assert trace.derived["peak"]["kv_cache"] == 2 * spec.layers * 32 * 8192 * spec.kv_heads * spec.head_dim * 2
    assert trace.derived["sources"]["kv_cache"].startswith("traced")
    mine = fit.estimate(labs.load(1, "fit_inputs").Inputs(model="llama-3-8b", task="decode", precision="bf16", batch=32,
                                                          kv_len=8192, new_tokens=4))
    assert mine["kv_cache"] == trace.derived["peak"]["kv_cache"]
    assert sum(mine.values()) == pytest.approx(trace.per_rank_peak_bytes, rel=0.001)


def test_one_gpu_table_serves_lab13_lab14_and_the_calculator():
    """B200, H100 NVL, MI300X, RTX A6000 and L40S among them; each card's driver total is a little over its
    datasheet's decimal figure (GB, not GiB: 1.00x to 1.08x), which catches a mistyped one."""
    import re

    gpus = load_lab(13, "fit_gpus").GPUS
    calc = json.loads((ROOT / "results" / "fit" / "calculator.json").read_text())
    assert set(calc["gpus"]) == set(gpus) == set(labs.load(14, "serving_budget").GPUS)
    assert {"b200-180gb", "h100-nvl-94gb", "mi300x-192gb", "rtx-a6000-48gb", "l40s-48gb"} <= set(gpus)
    for g in gpus.values():
        stated = int(re.match(r"(\d+) GB", g.stated).group(1)) * 10**9
        assert 1.0 <= g.total_bytes / stated <= 1.08, g.name
        assert g.datasheet.startswith("https://") and "https://" in g.total_source and g.capacity_bytes > 0


BAD = [
    (["--model", "no-such-model"], "unknown model"),
    (["--model", "small-llama", "--task", "infer", "--loss", "chunked"], "--loss chunked or fused-linear needs"),
    (["--model", "small-llama", "--kv-len", "64"], "give --task decode"),
    (["--model", "small-llama", "--task", "decode", "--precision", "mixed"], "--precision bf16 or fp32"),
    (["--model", "small-llama", "--task", "decode", "--precision", "bf16", "--kv-len", "4", "--new-tokens", "5"],
     "more than the cache holds"),
    (["--model", "small-gpt", "--task", "decode", "--precision", "bf16"], "Llama or Mixtral"),
    (["--model", "code/lab-13-will-it-fit/examples/qwen2.5-0.5b.config.json", "--loss", "fused-linear"],
     "a Hugging Face config's"),
    (["--model", "flux-dev"], "not a causal LM"),
    (["--model", "small-llama", "--compile", "--checkpointing", "every-k", "--checkpoint-every", "2"], "compiled alone"),
    (["--model", "small-llama", "--zero-stage", "3"], "--dp"),
    (["--model", "small-llama", "--batch", str(2**40), "--seq", str(2**40)], "--batch must be in [1, 65,536]"),
    (["--model", "small-llama", "--task", "infer", "--checkpointing", "full"], "--task infer"),
    (["--model", "small-llama", "--checkpointing", "every-k", "--checkpoint-every", "0"], "--checkpoint-every must be"),
    (["--model", "small-llama", "--checkpointing", "every-k", "--checkpoint-every", "3"], "more than the model's 2 blocks"),
    (["--model", "small-llama", "--checkpoint-every", "2"], "sizes the segments of --checkpointing every-k"),
    (["--model", "small-llama", "--checkpointing", "every-k"], "needs --checkpoint-every K"),
    (["--model", "small-llama", "--checkpointing", "every-kth-block"], "needs --checkpoint-every K: every K-th block"),
    (["--model", "small-llama", "--checkpointing", "every-kth-block", "--checkpoint-every", "0"], "--checkpoint-every must be"),
    (["--model", "small-llama", "--checkpointing", "every-kth-block", "--checkpoint-every", "3"], "more than the model's 2"),
    (["--model", "small-llama", "--checkpointing", "every-kth-block", "--checkpoint-every", "2", "--tp", "2"],
     "with --tp or --pp is not traced together"),
    (["--model", "small-llama", "--checkpointing", "selective"], "invalid choice: 'selective'"),
    (["--model", "small-llama", "--optimizer-in-backward", "--accumulation", "2"], "no --accumulation"),
    (["--model", "small-llama", "--task", "infer", "--optimizer-in-backward"], "needs a backward"),
    (["--model", "small-llama", "--offload-activations", "--dp", "2", "--zero-stage", "3"], "FSDP2's gathered weights"),
    (["--model", "small-llama", "--dp", "65536", "--zero-stage", "3"], "up to 1024"),
    (["--model", "small-llama", "--sp"], "give --tp N"),
    (["--model", "small-llama", "--tp", "3"], "does not split 4 heads"),
    (["--model", "small-llama", "--tp", "4"], "does not split 4 heads, 2 KV heads"),
    (["--model", "small-llama", "--tp", "2", "--loss", "chunked"], "with --tp is not traced"),
    (["--model", "small-llama", "--tp", "2", "--dp", "2", "--zero-stage", "1"], "with --tp is not traced"),
    (["--model", "llama-3.1-405b", "--tp", "8", "--dp", "1048576"], "GPUs: more than"),
    (["--model", "small-llama", "--tp", "2", "--task", "infer"], "traced for training"),
    (["--model", "small-mixtral", "--tp", "2"], "a zoo Llama's modules"),
    (["--model", "small-llama", "--pp", "2"], "needs --accumulation 2 or more"),
    (["--model", "small-llama", "--dp", "4", "--replicate", "2"], "is HSDP: it needs --zero-stage 2 or 3"),
    (["--model", "small-llama", "--pp", "3", "--accumulation", "3"], "more pipeline stages than"),
    (["--model", "small-llama", "--pp", "2", "--task", "infer"], "traced for training"),
    (["--model", "small-llama", "--pp", "2", "--accumulation", "2", "--loss", "chunked"], "with --pp is not traced"),
    (["--model", "small-llama", "--seq", "12", "--cp", "4", "--dp", "2", "--zero-stage", "3"], "not a multiple of 8"),
    (["--model", "small-llama", "--cp", "2", "--dp", "2"], "give --zero-stage 2 or 3"),
    (["--model", "llama-3-8b", "--seq", "8", "--cp", "2", "--tp", "8", "--sp", "--zero-stage", "3"],
     "give a --seq that --cp x --tp = 16 divides"),
    (["--model", "small-llama", "--cp", "2", "--pp", "2", "--accumulation", "2", "--zero-stage", "3"], "with --pp"),
    (["--model", "small-llama", "--cp", "2", "--zero-stage", "3", "--float8", "tensorwise"], "with --float8"),
    (["--model", "small-llama", "--cp", "2", "--zero-stage", "3", "--task", "infer"], "with --task infer"),
    (["--model", "small-gpt", "--cp", "2", "--zero-stage", "3"], "rings a zoo Llama's"),
    (["--model", "small-llama", "--cp", "2", "--zero-stage", "3", "--checkpointing", "save-matmuls"],
     "with --checkpointing save-matmuls is not traced"),
    (["--model", "small-llama", "--fsdp-units", "blocks-embed-head"], "it needs --zero-stage 2 or 3"),
    (["--model", "small-llama", "--fsdp-units", "blocks-embed-head", "--dp", "2", "--zero-stage", "1"], "--zero-stage 2"),
    (["--model", "small-llama", "--fsdp-units", "blocks-embed-head", "--dp", "2", "--zero-stage", "3", "--pp", "2",
      "--accumulation", "2"], "not traced with --offload params or --pp"),
    (["--model", "small-gpt", "--fsdp-units", "blocks-embed-head", "--dp", "2", "--zero-stage", "3"],
     "head shares the embedding's weight"),
    (["--model", "small-llama", "--float8", "tensorwise-all-gather"], "it needs --zero-stage 2 or 3"),
]


@pytest.mark.parametrize(("args", "fragment"), BAD)
def test_bad_input_is_one_line_and_exit_2(args, fragment, lab13, capsys):
    """The first case in a fresh interpreter, the rest in this process."""
    if args == BAD[0][0]:
        assert_clean_usage_error(run_cli(SCRIPT, *args), fragment)
    else:
        assert_usage_error_in_process(lab13, args, capsys, fragment)


def test_the_example_config_json_traces_verbatim_with_its_published_count():
    """The page's Try command: Qwen2.5-0.5B's published config.json, shipped in the lab folder."""
    proc = run_cli(SCRIPT, "--model", "code/lab-13-will-it-fit/examples/qwen2.5-0.5b.config.json", "--precision", "bf16",
                   "--optimizer", "adamw-fused", "--seq", "256", "--levers", "none", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["params"] == 494_032_768  # the model card's 0.49B, counted


def test_a_config_that_is_not_a_causal_lm_is_refused(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2,
                                  "num_attention_heads": 2, "intermediate_size": 128, "vocab_size": 100}))
    assert_clean_usage_error(run_cli(SCRIPT, "--model", str(config)), "not a decoder-only causal language model")


def test_a_sequence_longer_than_the_context_warns_then_traces():
    proc = run_cli(SCRIPT, "--model", "small-llama", "--seq", "256", "--levers", "none", "--json")
    assert proc.returncode == 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "longer than small-llama's context (128" in lines[0], proc.stderr
    assert json.loads(proc.stdout)["config"]["seq"] == 256


def test_the_ladder_halves_the_batch_again_until_it_fits(lab13):
    """Batch 8 of a Llama-3-8B prefill on an L4: half the micro-batch once (4) is not enough, twice (2)
    fits; the ladder says so, costed as inference (no accumulation), and the formulas' ladder (the page's)
    pulls it the same number of times."""
    from test_fit_formula import table_script

    config = lab13.Config(model="llama-3-8b", task="infer", precision="bf16", batch=8, gpu="l4-24gb")
    result = lab13.run(config)
    row = next(r for r in result.levers if r["name"] == "half the micro-batch")
    up = row["together"]
    assert up["fits"] and up["pulls"] == 2 and up["kept"], up
    assert up["flags"][up["flags"].index("--batch") + 1] == "2"
    assert up["saves_bytes"] == result.trace.per_rank_peak_bytes - up["per_rank_peak_bytes"]
    assert row["cost"] == "fewer sequences per forward: lower throughput" and "accumulation" not in row["cost"]
    assert lab13.trace(cli.parse(lab13.Config, up["flags"])[0]).fits
    script = table_script()
    formula = script.ladder(script.Inputs(model="llama-3-8b", task="infer", precision="bf16", batch=8), "l4-24gb")
    assert [(r["name"], r["pulls"], r["fits"]) for r in formula] == [("half the micro-batch", 2, True)]
