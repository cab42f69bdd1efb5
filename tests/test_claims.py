"""What the pages say about PyTorch 2.13 and about the published results, held to both.

Each test guards a sentence a review found wrong or misleading: it checks the behaviour or the
source of the pinned torch the sentence describes, the results its numbers come from, and the
page's wording, so that a torch upgrade, a re-run or an edit that makes the sentence false fails
here. Pages are rendered through the build hook (their placeholders filled in) without building the
whole site.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import re
import warnings
from pathlib import Path

import pytest
import torch
from conftest import load_lab

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MiB = 2**20
RATIO = "lab-04:real_scale_rule.kept_over_input"


def results(name: str) -> dict:
    path = ROOT / "results" / name / "summary.json"
    return json.loads(path.read_text(encoding="utf-8"))["numbers"]


@pytest.fixture(scope="module")
def hooks():
    spec = importlib.util.spec_from_file_location("infralab_hooks_claims", ROOT / "scripts" / "mkdocs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rendered(hooks, page: str) -> str:
    """A docs page's markdown with every number placeholder filled in, as the build writes it."""
    text = (DOCS / page).read_text(encoding="utf-8")
    return hooks.VALUE.sub(lambda m: hooks.render_value(m, page), text)


def prose(text: str) -> str:
    """Markdown as one line of words: line breaks and indentation do not split a phrase."""
    return re.sub(r"\s+", " ", text)


def every_page() -> dict[str, str]:
    return {p.relative_to(DOCS).as_posix(): p.read_text(encoding="utf-8") for p in DOCS.rglob("*.md")}


# --------------------------------------------------------------------- DDP: the cap closes a bucket
def test_a_ddp_bucket_closes_at_the_cap_and_the_pages_say_so(hooks):
    """DDP's C++ reducer (``dist._compute_bucket_assignment_by_size``) closes a bucket once it holds
    the cap or more: a tensor larger than the cap fills a bucket alone, small ones share. The
    published Llama-3-8B buckets follow that rule, every one of them over the 25 MiB cap, which is
    what Lab 10 and the chapter say; no page calls them 25 MiB buffers."""
    import torch.distributed as dist

    sizes = [224, 1, 10, 10, 10, 64, 300, 1]  # MiB, in ready order
    tensors = [torch.empty(n * MiB // 4) for n in sizes]
    buckets, _ = dist._compute_bucket_assignment_by_size(tensors, [25 * MiB])
    assert buckets == [[0], [1, 2, 3, 4], [5], [6], [7]]
    assert inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters["bucket_cap_mb"].default is None

    b = results("lab-10-ddp")["real_scale"]["llama_3_8b_8"]["buckets"]
    assert b["cap_bytes"] == 25 * MiB and b["count"] == len(b["bytes"]) and sum(b["bytes"]) == b["total_bytes"]
    assert all(x > b["cap_bytes"] for x in b["bytes"]), "the pages say every 8B bucket is over the cap"
    assert max(b["bytes"]) == b["largest_bytes"] > 80 * b["cap_bytes"]

    lab10, chapter = prose(rendered(hooks, "labs/lab-10-ddp.md")), prose(rendered(hooks, "handbook/data-parallel.md"))
    largest = hooks.Table([("", "bytes")], [[b["largest_bytes"]]]).cell(b["largest_bytes"], "bytes")
    assert "a tensor bigger than the cap fills a bucket on its own" in lab10
    assert "buckets, every one of them over the cap, and the largest holds the embedding" in lab10
    assert f"largest {hooks.Table([('', 'size')], [[b['largest_bytes']]]).cell(b['largest_bytes'], 'size')} (the embedding)" in lab10
    assert "is the size at which a bucket closes, not the size it has" in chapter
    assert f"all {b['count']} buckets are over it, the largest {largest}" in chapter
    for page, text in every_page().items():
        assert not re.search(r"25 MiB (buffers|buckets)|buckets of about", prose(text)), page


# ------------------------------------------------------------ torch.compile: aims, does not promise
def test_the_compile_answer_says_the_peak_can_rise_and_cites_the_issues():
    from torch._functorch import config

    assert config.activation_memory_budget == 1.0  # "1.0 default", as the answer says
    for page, text in every_page().items():
        assert "never more than eager" not in prose(text), page
    answer = prose((DOCS / "labs/lab-12-memory-debugging.md").read_text(encoding="utf-8"))
    said = answer.split("What does `torch.compile` do to memory", 1)[1][:1800]
    assert "so it aims to save no more than eager. The peak can still rise" in said
    for issue in (120381, 122512):
        assert f"https://github.com/pytorch/pytorch/issues/{issue}" in said


# ------------------------------------------------------- FSDP2: reshard_after_forward=None and int
def _root_is_sharded_after_forward(wrap) -> tuple[bool, bool]:
    """(root's head sharded after forward, a block's weight sharded after forward) on rank 0 of 2."""
    from torch.distributed.tensor import DTensor

    from labkit.dist import fake_group
    from labkit.models import GPTConfig, TinyGPT

    with fake_group(2) as mesh:
        torch.manual_seed(0)
        model = TinyGPT(GPTConfig(vocab=64, seq_len=16, width=32, layers=2, heads=2, dropout=0.0))
        wrap(model, mesh)
        x = torch.randint(0, 64, (2, 16))
        model(x, x)
        head = isinstance(model.head.weight, DTensor)
        block = isinstance(model.blocks[0].mlp.up.weight, DTensor)
        del model
    return head, block


def test_fsdp2_keeps_the_root_gathered_by_default_and_lab11_frees_it():
    """torch 2.13: ``reshard_after_forward`` defaults to None, which reshards every unit after forward
    but the root; an int reshards to a smaller group. Lab 11 passes True to the root as well, so its
    root is freed after forward and gathered again for backward: the moment the chapter, Lab 11's
    page and the calculator attribute to that choice."""
    from torch.distributed.fsdp import fully_shard

    assert inspect.signature(fully_shard).parameters["reshard_after_forward"].default is None
    doc = inspect.getdoc(fully_shard)
    assert "``True`` for non-root modules and ``False``" in doc and "world size to reshard to" in doc

    def default(model, mesh):
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)

    lab11 = load_lab(11)
    assert _root_is_sharded_after_forward(default) == (False, True)
    assert _root_is_sharded_after_forward(lambda model, mesh: lab11.wrap(3, model, mesh, 1e-3)) == (True, True)

    chapter = prose((DOCS / "handbook/zero-fsdp.md").read_text(encoding="utf-8"))
    assert "`None`, the default in 2.13, means `True` for every unit but the root, and `False` for the root" in chapter
    assert "An `int` reshards after forward to that many ranks" in chapter
    assert "is there because Lab 11 freed the root after forward" in chapter
    assert "gathered again as Lab 11 passes `True` to the root too" in prose(
        (DOCS / "labs/lab-11-zero-fsdp.md").read_text(encoding="utf-8"))
    assert "because Lab 11 freed them after forward with `reshard_after_forward=True`" in prose(
        (DOCS / "fit.md").read_text(encoding="utf-8"))


# ---------------------------------------------------------- checkpoint: use_reentrant left out
def test_checkpoint_without_use_reentrant_still_runs_the_reentrant_variant():
    """Leaving ``use_reentrant`` out warns and picks True: the reentrant variant, which refuses a
    ``context_fn`` (so no selective checkpointing). The chapter says so."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    x = torch.randn(4, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint(torch.sin, x).sum().backward()
    assert any("use_reentrant parameter should be passed explicitly" in str(w.message) for w in caught)
    policy = lambda: create_selective_checkpoint_contexts([torch.ops.aten.sin.default])  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="only supported when use_reentrant=False"):
            checkpoint(torch.sin, x, context_fn=policy)
    checkpoint(torch.sin, x, use_reentrant=False, context_fn=policy).sum().backward()  # the other variant takes it
    chapter = prose((DOCS / "handbook/activation-checkpointing.md").read_text(encoding="utf-8"))
    assert "Leave the argument out and 2.13 still runs the *reentrant* variant, with a warning only" in chapter


# ------------------------------------------------- mixed precision: the residual stream, not the add
def test_under_autocast_the_fp32_residual_stream_is_saved_by_the_next_norm():
    """A GPT block under bf16 autocast: the residual additions save nothing for backward; the fp32
    activations of full width are the norms' inputs, and the second norm's input is the residual
    stream after attention (the tensor the first addition made)."""
    from labkit.models import Block, GPTConfig

    torch.manual_seed(0)
    block = Block(GPTConfig(vocab=64, seq_len=16, width=32, layers=1, heads=2, dropout=0.0))
    x = torch.randn(2, 16, 32, requires_grad=True)
    norm_inputs = []
    block.ln2.register_forward_pre_hook(lambda module, args: norm_inputs.append(args[0]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = block(x)
    nodes, stack = [], [y.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in nodes:
            nodes.append(node)
            stack += [f for f, _ in node.next_functions]

    def saved(node):
        return [getattr(node, a) for a in dir(node) if a.startswith("_saved_") and isinstance(getattr(node, a), torch.Tensor)]

    adds = [n for n in nodes if type(n).__name__ == "AddBackward0"]
    assert len(adds) == 2 and all(saved(n) == [] for n in adds)
    full_width_fp32 = [t for n in nodes for t in saved(n) if t.dtype == torch.float32 and t.shape == x.shape]
    norms = [n for n in nodes if type(n).__name__ == "NativeLayerNormBackward0"]
    assert len(full_width_fp32) == len(norms) == 2
    assert all(any(t is n._saved_input for n in norms) for t in full_width_fp32)
    (residual,) = norm_inputs
    assert residual.dtype == torch.float32 and any(torch.equal(n._saved_input, residual) for n in norms)

    for page, text in every_page().items():
        assert "residual additions" not in prose(text), page
    chapter = prose((DOCS / "handbook/mixed-precision.md").read_text(encoding="utf-8"))
    assert "in a GPT block the residual stream, saved by the next norm as its input" in chapter


# ----------------------------------------------------------------- one keep-to-input ratio
def test_every_page_gives_one_keep_to_input_ratio():
    """A block's bytes kept for backward against its input: one figure on the whole site, Lab 04's
    traced Llama 3 ratio, through its placeholder; no other number (17, 24x of a toy, "tens",
    "twenty"). A toy's own ratio is written against I_blk, in its lab's measured section."""
    seen = 0
    for page, text in every_page().items():
        flat = prose(text)
        assert not re.search(r"\b\d+(?:\.\d+)?\s*(?:times|×)\s+(?:its|their)(?: own)? input", flat), page
        assert not re.search(r"\b17 times|tens of times|twenty times|twentyfold input", flat), page
        for m in re.finditer(r"\{\{([^}]*)\}\}\**\s*(?:times|×)\s+(?:its|their|it\b|that\b|at Llama)", flat):
            seen += 1
            assert RATIO in m.group(1), (page, m.group(0))
        seen += len(re.findall(r"K_blk / I_blk is \{\{ " + re.escape(RATIO), flat))
        for m in re.finditer(r"lab-04:summary\.per_block_over_input[^}]*\}\}(.{0,8})", flat):
            assert m.group(1).startswith("× I_blk"), (page, m.group(0))  # the toy's, against its own I_blk
    assert seen >= 7, seen
    assert 20 <= results("lab-04-activation-checkpointing")["real_scale_rule"]["kept_over_input"] <= 30


# ---------------------------------------------------------- gradient accumulation at Llama-3-8B
def test_accumulation_raises_the_8b_peak_by_the_difference_of_the_published_peaks(hooks):
    """The chapter's "+X" is Lab 06's accumulation peak minus Lab 02's single pass of the same
    micro-batch (one 4,096-token sequence, fp32, foreach AdamW), which peaks in the optimizer step:
    less than the whole gradient buffer."""
    single = results("lab-02-single-gpu-training")["real_scale"]["8b"]
    acc = results("lab-06-gradient-accumulation")["real_scale"]
    assert single["activations"] == acc["accumulation"]["activations"]  # the same micro-batch
    assert single["adamw_state"] == acc["accumulation"]["optimizer_state"]
    assert single["peak"] == single["step1_optimizer"] > single["step1_backward"]
    rise = acc["accumulation"]["total"] - single["peak"]
    assert 0 < rise < acc["gradient_buffer"]
    fmt = lambda v: hooks.Table([("", "bytes")], [[v]]).cell(v, "bytes")  # noqa: E731
    chapter = prose(rendered(hooks, "handbook/gradient-accumulation.md"))
    assert f"**+{fmt(rise)}**, not the whole {fmt(acc['gradient_buffer'])} buffer" in chapter
    assert f"peaks in foreach AdamW's step, at {fmt(single['peak'])}" in chapter


# ------------------------------------------------------------- optimizer offload: 7 x 0.53 s
def test_the_offload_extrapolation_is_multiplied_out_and_called_one(hooks):
    bench = json.loads((ROOT / "results" / "cpu_adam_bench.json").read_text(encoding="utf-8"))
    (measured,) = [s for s in bench["sets"] if s["params"] == 12905472]
    ns = measured["impls"]["fused"]["ns_per_param"]
    chapter = prose(rendered(hooks, "handbook/optimizer-offload.md"))
    assert f"ns ≈ **{7e9 * ns * 1e-9:.1f} s**. That is an extrapolation, not a measurement" in chapter
    assert f"{measured['params'] / 1e6:.1f} million parameters, scaled linearly to 7 billion" in chapter
    assert f"is {28 / ns:.0f} GB/s from one thread" in chapter
    params = results("lab-07-optimizer-offload")["real_scale"]["params"]
    lab07 = prose(rendered(hooks, "labs/lab-07-optimizer-offload.md"))
    assert f"times 8B parameters: about {params * ns * 1e-9:.1f} s" in lab07 and "an extrapolation from a set" in lab07
    for page, text in every_page().items():  # no product left for the reader to work out
        assert not re.search(r"\d(?:\.\d+)? × \{\{[^}]*\}\} s(?:econds)?\b", text), page


# ----------------------------------------------------------- PyTorch's own tools beside the ledger
def _tiny_model():
    from labkit.models import GPTConfig, TinyGPT

    torch.manual_seed(0)
    return TinyGPT(GPTConfig(vocab=64, seq_len=16, width=32, layers=2, heads=2, dropout=0.0))


def _warm_step(model):
    """(model, optimizer, batch, step) after one step: the optimizer state exists before any tool
    watches, as in a run's later steps. ``step(phase)`` marks its phases with ``phase(name)``."""
    from contextlib import nullcontext

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x = torch.randint(0, 64, (2, 16))

    def step(phase=lambda name: nullcontext()):
        with phase("forward"):
            _, loss = model(x, x)
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    return model, optimizer, x, step


def _ledger_peak(model, optimizer, x, step) -> dict:
    from labkit.ledger import Ledger

    ledger = Ledger("cpu").track_module(model).track_optimizer(optimizer)
    ledger.track([x], "other")
    with ledger:
        step(ledger.phase)
    return ledger.peak()


def test_memtracker_and_the_ledger_agree_on_the_peak_and_differ_on_the_step_copy():
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    model, optimizer, x, step = _warm_step(_tiny_model())
    tracker = MemTracker()
    tracker.track_external(model, optimizer, x)
    with tracker:
        step()
    (theirs,) = tracker.get_tracker_snapshot("peak").values()
    ours = _ledger_peak(*_warm_step(_tiny_model()))
    assert theirs["Total"] == ours["total"]
    assert theirs[_MemRefType.OPT] == ours["optimizer_state"] + ours["temporaries"] > ours["optimizer_state"]
    assert (theirs[_MemRefType.PARAM], theirs[_MemRefType.GRAD], theirs[_MemRefType.ACT]) == (
        ours["parameters"], ours["gradients"], ours["activations"])


def test_fsdp_memtracker_and_the_ledger_agree_under_the_fake_process_group():
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import fully_shard

    from labkit.dist import fake_group

    def sharded(mesh):
        model = _tiny_model()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return _warm_step(model)

    with fake_group(2) as mesh:
        model, optimizer, x, step = sharded(mesh)
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs((x,))
        with tracker:
            step()
        (theirs,) = tracker.get_tracker_snapshot("peak").values()
        del model, optimizer, step, tracker
        ours = _ledger_peak(*sharded(mesh))
    assert theirs["Total"] == ours["total"] > 0


def test_the_profiler_timeline_has_the_handbooks_categories_and_leaves_the_step_copy_unknown(tmp_path):
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, Category

    assert {c.name for c in Category} == {"PARAMETER", "OPTIMIZER_STATE", "GRADIENT", "ACTIVATION", "TEMPORARY",
                                          "INPUT", "AUTOGRAD_DETAIL"}
    model, optimizer, x, step = _warm_step(_tiny_model())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prof.export_memory_timeline(str(tmp_path / "timeline.json"), device="cpu")
    assert any("deprecated" in str(w.message) for w in caught)
    _, sizes = json.loads((tmp_path / "timeline.json").read_text(encoding="utf-8"))
    at_peak = max(sizes, key=sum)
    ours = _ledger_peak(*_warm_step(_tiny_model()))
    assert abs(sum(at_peak) - ours["total"]) <= 64  # "within a few bytes"
    assert at_peak[1 + _CATEGORY_TO_INDEX[None]] == ours["temporaries"] > 0  # foreach's copy: "unknown"
    assert at_peak[1 + _CATEGORY_TO_INDEX[Category.OPTIMIZER_STATE]] == ours["optimizer_state"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the claim is about a machine without a GPU")
@pytest.mark.parametrize("mode", ["operator-level-cost-model", "operator-level-benchmark"])
def test_the_sac_estimator_needs_a_gpu(mode):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.sac_estimator import SACEstimator

    estimator = SACEstimator()
    with FakeTensorMode(), pytest.raises((AssertionError, RuntimeError)):
        layer = torch.nn.Linear(8, 8)
        with estimator(mode):
            layer(torch.randn(2, 8))


def test_the_tools_section_names_each_tool_and_its_relation_to_the_ledger():
    chapter = prose((DOCS / "handbook/memory-debugging.md").read_text(encoding="utf-8"))
    section = chapter.split("## PyTorch's own memory tools, beside the ledger", 1)[1]
    for said in ("`prof.export_memory_timeline(", "the two peaks agree within a few bytes",
                 "left \"unknown\" by the profiler", "`torch.distributed._tools.mem_tracker.MemTracker`",
                 "on one CPU step their peaks agree to the byte", "`FSDPMemTracker`",
                 "its peak equals the ledger's to the byte", "`torch.distributed._tools.sac_estimator.SACEstimator`",
                 "Both of its timing modes need a GPU"):
        assert said in section, said


# ----------------------------------------------------------------------------- attention in 2.13
def test_a_block_mask_takes_sixteen_n_n_plus_one_bytes():
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(b, h, q, kv):
        return q >= kv

    fields = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
              "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
    for s in (1024, 2048):
        mask = create_block_mask(causal, None, None, s, s, device="cpu")
        n = -(-s // 128)
        assert sum(getattr(mask, f).nbytes for f in fields) == 16 * n * (n + 1)
    documents = torch.tensor([[0] * 300 + [1] * 724, [0] * 1024])  # a packed batch: one mask per sequence

    def same_document(b, h, q, kv):
        return documents[b, q] == documents[b, kv]

    mask = create_block_mask(same_document, 2, None, 1024, 1024, device="cpu")
    assert sum(getattr(mask, f).nbytes for f in fields) == 2 * 16 * 8 * 9
    assert 16 * 1024 * 1025 == 16_793_600  # the page's figure at 131,072 tokens


def test_flex_attention_without_compile_warns_that_it_materializes_the_scores():
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = (torch.randn(1, 2, 128, 16) for _ in range(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = flex_attention(q, k, v)
    assert any("materializes the full scores matrix" in str(w.message) for w in caught)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v))


def test_varlen_attention_keeps_the_output_and_an_fp32_lse_per_real_token():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.attention.varlen import varlen_attn

    saved = []
    tokens, heads, d = 1000, 8, 64
    with FakeTensorMode():
        q, k, v = (torch.empty(tokens, heads, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        offsets = torch.tensor([0, 300, 1000], dtype=torch.int32)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = varlen_attn(q, k, v, offsets, offsets, 700, 700)
        new = [t for t in saved if all(t is not i for i in (q, k, v, offsets))]
        assert out.shape == (tokens, heads, d)
        kept = sorted(t.nbytes for t in new)
        assert kept == sorted([tokens * heads * d * 2, 4 * heads * tokens, 16])  # out, lse, the RNG state


def test_the_attention_chapter_covers_fa3_flex_varlen_and_packing():
    import torch.nn.attention as attention

    assert set(attention.list_flash_attention_impls()) == {"FA3", "FA4"}
    chapter = prose((DOCS / "handbook/attention-memory.md").read_text(encoding="utf-8"))
    for heading in ("### FlashAttention-3 behind the same call", "### FlexAttention: your mask, a fused kernel, a block mask",
                    "### Variable-length attention and sequence packing"):
        assert heading in chapter
    assert "16·n·(n + 1) bytes" in chapter and "16 × 1,024 × 1,025 = 16,793,600 bytes" in chapter
    assert "8 × 4,096 = 32,768 token slots for 8,192 tokens, four times" in chapter and 8 * 4096 == 4 * 8 * 1024
