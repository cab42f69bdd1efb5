"""Lab 14 - the serving budget at real size: what is left for the KV pool, and how many tokens it holds.

A serving engine sizes its KV pool once, at start-up. This file does it the way vLLM's worker does at
the tag ``quantize.VLLM_TAG`` (``vllm/v1/worker/gpu_worker.py``, ``Worker.init_device`` and
``determine_available_memory``; ``vllm/utils/mem_utils.py``, ``memory_profiling``), term by term:

* **what the engine may use** = the card's total memory x ``--gpu-memory-utilization``. The total, not
  what is free: the CUDA context and NCCL's buffers exist before vLLM takes its baseline snapshot, so
  they live in the share the flag leaves out, and vLLM refuses to start if that share cannot hold them;
* less the **weights**, as loaded: traced on fake tensors in bf16 (the zoo model at its published size,
  nothing allocated); in a quantized format, each quantized matrix counted from the tensors its format
  stores (``quantize.py``), the rest bf16; a speculative decoder's **draft model** the same way;
* less the **activation peak** of one profiling forward (the largest prefill it will schedule),
  traced through this lab's serving forward;
* less the **non-torch increase** since that snapshot (cuBLAS workspaces and the like), cited;
* less the **CUDA graphs**, as vLLM estimates them since v0.21 (``gpu_model_runner.py``,
  ``profile_cudagraph_memory``): the memory the first, largest capture takes, plus every other graph's
  own share, which vLLM measures on the second capture and never takes below 1 MiB. Here the first
  capture is traced (one forward at the largest captured size, its private pool holding that forward's
  intermediates) and each further graph counts vLLM's 1 MiB floor: a lower bound;
* the rest is the **KV pool**, in whole blocks; its bytes per token come from the config (a latent
  vector per layer for multi-head latent attention; a draft model's own keys and values added).

Tensor parallelism over ``tp`` GPUs is traced as the per-GPU model Megatron-style sharding leaves:
the query heads, the KV heads, the MLP's hidden size (an expert's too) and the vocabulary divided by
``tp``, the hidden size, the norms and a latent attention's compressed KV whole. The all-reduce
buffers are not in the trace.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import quantize
import torch
from paged_kv import KVStore, PagedKVCache, kv_bytes_per_token
from serving_model import ServingLlama

from labkit import fake, labs, marks
from labkit.ledger import Ledger
from labkit.models import run_in_order

GIB, MIB = 1 << 30, 1 << 20
FIT_GPUS = labs.load(13, "fit_gpus")
#: Memory per GPU: the total the CUDA driver reports, from Lab 13's GPU table (one place for it; the
#: datasheets' "80 GB" is a little more than an 80 GB card's driver total).
GPUS = {name: gpu.total_bytes for name, gpu in FIT_GPUS.GPUS.items()}
VLLM = "https://github.com/vllm-project/vllm/blob/" + quantize.VLLM_TAG + "/vllm/"
#: What vLLM subtracts besides weights, activations and graphs: the non-torch memory that grew after its
#: baseline snapshot. One wording for the report, ``--help`` and the page.
NON_TORCH_BYTES = round(0.16 * GIB)
NON_TORCH_SOURCE = ("cited: 0.16 GiB, vLLM's own profile of a model on an H100 "
                    "(https://github.com/vllm-project/vllm/pull/12126: 'non_torch_memory takes 0.16GiB'); "
                    "its logs show 0.05 to 0.65 GiB")
NON_TORCH_HOW = "cited from a vLLM log (non-torch growth after its baseline)"
CONTEXT_HOW = ("the CUDA context and NCCL: made before vLLM's baseline snapshot, so not in the budget "
               f"({VLLM}v1/worker/gpu_worker.py, Worker.init_device)")
GRAPH_FLOOR = MIB  # vLLM's least per further graph: "Use at least 1 MiB per graph for driver overhead"
GRAPH_SOURCE = (f"{VLLM}v1/worker/gpu_model_runner.py, profile_cudagraph_memory (its 'Estimated CUDA graph "
                "memory' log is line 6365 at this tag); the capture sizes: vllm/config/vllm.py, "
                "_set_cudagraph_sizes (https://github.com/vllm-project/vllm/issues/32324 quotes it)")
MAX_CAPTURE = 512  # vLLM caps the default largest captured size at 512 tokens


def per_gpu_spec(spec, tp: int):
    """The model one of ``tp`` tensor-parallel GPUs holds: heads, KV heads (at least one), MLP width (an
    expert's too) and vocabulary divided by ``tp``; hidden size, layers, head size and latent unchanged."""
    if tp == 1:
        return spec
    return dataclasses.replace(spec, heads=spec.heads // tp, kv_heads=max(1, spec.kv_heads // tp),
                               ffn=spec.ffn // tp, moe_ffn=spec.moe_ffn // tp, vocab=-(-spec.vocab // tp),
                               head_dim=spec.head_dim)


def latent(spec) -> bool:
    """Does the model cache a compressed latent (multi-head latent attention) rather than K and V?"""
    return bool(spec.kv_lora_rank)


def token_bytes(spec, kv_dtype: str, layout: str = "auto") -> int:
    """Bytes of one token's cache on one GPU of ``spec`` (a per-GPU spec): ``auto`` caches what the model's
    attention needs (MLA: its latent and RoPE key, whole on every GPU; else K and V per KV head);
    ``per-head``: an MLA model's keys and values expanded per head, as a cache without MLA would keep."""
    if latent(spec) and layout != "per-head":
        return kv_bytes_per_token(spec.layers, 1, spec.kv_lora_rank + spec.rope_dim, kv_dtype, latent=True)
    if latent(spec):  # per head a key of head_dim + rope_dim and a value of v_head_dim: their mean, twice
        return kv_bytes_per_token(spec.layers, spec.heads, (spec.head_dim + spec.rope_dim + spec.v_head_dim) // 2,
                                  kv_dtype)
    return kv_bytes_per_token(spec.layers, spec.kv_heads, spec.head_dim, kv_dtype)


def traced_blocks(spec):
    """The model a trace of activations runs: each kind of block once more than the model has of it (its
    dense blocks, then two more). Under ``no_grad`` a block's temporaries are freed before the next block
    runs, so the activation peak of a forward is one block's on top of the stream, whatever the depth
    (``tests/test_lab14.py`` holds it to the whole model's); the weights are counted whole elsewhere."""
    return dataclasses.replace(spec, layers=min(spec.layers, spec.dense_layers + 2))


def trace_prefill(spec, *, tp: int = 1, seq_len: int, chunk: int | None = None, kv_dtype: str = "bf16",
                  block_size: int = 16, zoo_forward: bool = False, tensors=fake.tensors) -> dict:
    """Peak bytes of one prefill of ``seq_len`` tokens on one of ``tp`` GPUs, traced on fake tensors.

    ``chunk``: prefill in chunks of this many tokens (None: the whole prompt at once); the trace runs
    the last chunk, whose attention reads the longest context (every earlier chunk holds the same
    activations and reads fewer keys). ``zoo_forward``: trace the zoo model's own forward under
    ``no_grad`` instead (every position's logits, no cache), the way a plain training-style forward
    prefills. ``tensors``: the context the prefill runs in (``fake.tensors``, whose ledger rounds to
    the CUDA allocator's 512-byte blocks; a test passes real tensors to check the trace). Returns the
    ledger's peak by category in the prefill phase, plus ``activations``: what is not weights or KV pool.
    """
    new = min(chunk or seq_len, seq_len)
    return trace_step(spec, tp=tp, batch=1, context=seq_len, new=new, kv_dtype=kv_dtype, block_size=block_size,
                      zoo_forward=zoo_forward, tensors=tensors)


def trace_step(spec, *, tp: int = 1, batch: int, context: int, new: int, kv_dtype: str = "bf16",
               block_size: int = 16, zoo_forward: bool = False, logits: bool = True, tensors=fake.tensors,
               whole: bool = False) -> dict:
    """Peak bytes of one forward of ``batch`` sequences of ``context`` tokens whose last ``new`` are
    computed (a prefill: batch 1, new = the chunk; a decode step: new = 1), on one of ``tp`` GPUs.
    ``logits``: compute each sequence's last logits (False: stop at the hidden states, as a captured
    CUDA graph does). A latent-attention model runs the zoo's own blocks over its ``new`` tokens (its
    prefill expands K and V for them, as vLLM's MLA prefill does), then the last position's logits.
    ``whole``: trace every block (default: :func:`traced_blocks`). Arguments and result as
    :func:`trace_prefill`'s."""
    rank = per_gpu_spec(spec if whole else traced_blocks(spec), tp)
    with tensors():
        model = fake.materialize(rank.build, dtype=torch.bfloat16)
        ledger = Ledger("cpu").track_module(model)
        if latent(rank) or rank.family not in ("llama", "mixtral"):
            with ledger, torch.no_grad(), marks.phase("step"):
                x = run_in_order(model.blocks, model.embed(torch.zeros(batch, new, dtype=torch.long)))
                if logits:
                    model.head(model.norm(x[:, -1]))
        else:
            store = KVStore(layers=rank.layers, slots=batch * -(-context // block_size) * block_size,
                            kv_heads=rank.kv_heads, head_dim=rank.head_dim, kv_dtype=kv_dtype)
            cache = PagedKVCache(store, block_size)
            ledger.track(store.tensors(), "kv_cache")
            with ledger, torch.no_grad(), marks.phase("step"):
                tokens = torch.zeros(batch, new if not zoo_forward else context, dtype=torch.long)
                if zoo_forward:
                    model(tokens)
                else:
                    for seq in range(batch):
                        cache.admit(seq, context - new)  # the earlier tokens' keys and values are in the cache
                        cache.grow(seq, new)
                    ServingLlama(model).forward(cache, list(range(batch)), tokens, logits=logits)
    peak = ledger.timeline().peaks_by_phase()["step"]  # "other": the model's buffers (its RoPE frequencies)
    return peak | {"activations": sum(v for k, v in peak.items() if k not in ("parameters", "kv_cache", "other"))}


def weight_bytes(spec, *, tp: int = 1, weights: str = "bf16", group: int | None = None) -> int:
    """One GPU's weights as loaded, each tensor in the CUDA allocator's 512-byte blocks: bf16, or the
    quantizable matrices in ``weights`` (``quantize.model_bytes``). Counted from the shapes of the model
    built on meta (blocks of one kind are alike: each kind is built once and counted for all its blocks)."""
    rank = per_gpu_spec(spec, tp)
    with torch.device("meta"):
        model = traced_blocks(rank).build()
    per_block = [quantize.model_bytes(b, weights, group, block=fake.CUDA_BLOCK) for b in model.blocks]
    blocks = sum(per_block) + per_block[-1] * (rank.layers - len(per_block))
    rest = sum(-(-2 * p.numel() // fake.CUDA_BLOCK) * fake.CUDA_BLOCK for n, p in model.named_parameters()
               if not n.startswith("blocks."))
    return blocks + rest


def read_weight_bytes(spec, *, tp: int = 1, weights: str = "bf16", group: int | None = None) -> int:
    """The weights one decode step must read at least: all of them, but a mixture of experts' unrouted
    experts (a token reads its top_k of them; tokens that all chose the same ones read no more)."""
    total = weight_bytes(spec, tp=tp, weights=weights, group=group)
    if not spec.experts:
        return total
    rank = per_gpu_spec(spec, tp)
    with torch.device("meta"):
        expert = traced_blocks(rank).build().blocks[-1].mlp.experts[0]
    unread = (rank.experts - rank.top_k) * quantize.model_bytes(expert, weights, group, block=fake.CUDA_BLOCK)
    return total - (rank.layers - rank.dense_layers) * unread


def capture_sizes(max_num_seqs: int, speculative_tokens: int = 0, max_batched_tokens: int = 8192) -> tuple[list, list]:
    """The token counts vLLM captures CUDA graphs for, by default (FULL_AND_PIECEWISE): piecewise graphs
    at [1, 2, 4] + every 8 below 256 + every 16 up to the largest, min(2 x max_num_seqs x (1 + k), 512,
    --max-num-batched-tokens); with k speculative tokens each rounded up to a multiple of 1 + k; full
    graphs for the decode batches among them, up to max_num_seqs x (1 + k) tokens."""
    step = 1 + speculative_tokens
    largest = min(max_num_seqs * step * 2, MAX_CAPTURE, max_batched_tokens)
    sizes = [s for s in (1, 2, 4) if s <= largest] + list(range(8, min(largest + 1, 256), 8)) \
        + list(range(256, largest + 1, 16))
    sizes = sorted({-(-s // step) * step for s in sizes})
    return sizes, [s for s in sizes if s <= max_num_seqs * step]


def graph_bytes(spec, *, tp: int = 1, max_num_seqs: int = 256, speculative_tokens: int = 0,
                max_batched_tokens: int = 8192, block_size: int = 16) -> tuple[int, int, int]:
    """(bytes, graphs, largest) of vLLM's CUDA-graph estimate: the first, largest capture (traced: one
    forward of that many tokens, to the hidden states) and vLLM's 1 MiB floor for each further graph."""
    piecewise, full = capture_sizes(max_num_seqs, speculative_tokens, max_batched_tokens)
    first = trace_step(spec, tp=tp, batch=max(piecewise), context=block_size, new=1, logits=False)["activations"]
    return (first + GRAPH_FLOOR * (len(piecewise) - 1 + max(len(full) - 1, 0)), len(piecewise) + len(full),
            max(piecewise))


@dataclass
class Budget:
    """The serving budget of one GPU of a ``tp``-way group (bytes per GPU)."""

    model: str
    gpu: str
    tp: int
    utilization: float
    weights: str  # the --weights format
    kv_dtype: str
    kv_layout: str  # "K and V per KV head" or "latent"
    seq_len: int  # the prompt the prefill peak is traced at
    chunk: int | None
    block_size: int
    gpu_bytes: int
    weights_bytes: int  # traced (bf16) or counted per matrix (quantized)
    prefill_peak_bytes: int  # traced: activations and temporaries at the prefill's peak
    non_torch_bytes: int  # cited (NON_TORCH_BYTES) or a flag
    cuda_graph_bytes: int  # traced first capture + vLLM's per-graph floor; 0 with --enforce-eager
    cuda_graphs: int
    largest_graph: int  # tokens of the largest (first) capture
    kv_heads_per_gpu: int
    kv_bytes_per_token: int  # per GPU, from the config: the target's, and the draft's if any
    draft: str | None = None
    draft_weights_bytes: int = 0
    draft_kv_bytes_per_token: int = 0
    read_bytes: int = 0  # the weights a decode step must read (a mixture of experts: its routed experts)

    @property
    def usable_bytes(self) -> int:
        return int(self.gpu_bytes * self.utilization)

    @property
    def outside_bytes(self) -> int:
        """What the flag leaves out of the budget: where the CUDA context and NCCL live."""
        return self.gpu_bytes - self.usable_bytes

    @property
    def kv_pool_bytes(self) -> int:
        """What is left for KV blocks (negative: the model does not fit)."""
        return (self.usable_bytes - self.weights_bytes - self.draft_weights_bytes - self.prefill_peak_bytes
                - self.non_torch_bytes - self.cuda_graph_bytes)

    @property
    def max_tokens_in_flight(self) -> int:
        """Tokens whose keys and values the pool holds, in whole blocks."""
        blocks = max(self.kv_pool_bytes, 0) // (self.block_size * self.kv_bytes_per_token)
        return blocks * self.block_size

    def sequences(self, context: int, reserve: int | None = None) -> int:
        """Sequences of ``context`` tokens the pool holds at once: paged (whole blocks of ``context``),
        or each reserving ``reserve`` tokens (a static cache's max_len)."""
        per = reserve if reserve is not None else -(-context // self.block_size) * self.block_size
        return self.max_tokens_in_flight // per

    def summary(self) -> dict:
        return dataclasses.asdict(self) | {
            "usable_bytes": self.usable_bytes, "outside_bytes": self.outside_bytes,
            "kv_pool_bytes": self.kv_pool_bytes, "max_tokens_in_flight": self.max_tokens_in_flight}


def plan(spec, *, gpu: str = "h100-80gb", tp: int = 1, utilization: float = 0.9, kv_dtype: str = "bf16",
         seq_len: int, chunk: int | None = None, block_size: int = 16, non_torch_bytes: int = NON_TORCH_BYTES,
         weights: str = "bf16", group: int | None = None, kv_layout: str = "auto", cuda_graphs: bool = True,
         max_num_seqs: int = 256, draft=None, speculative_tokens: int = 3, gpu_bytes: int | None = None) -> Budget:
    """The serving budget of ``spec`` on one ``gpu`` of a ``tp``-way group: weights in ``weights`` (int4:
    groups of ``group``) and the peak of a ``seq_len``-token prefill (in ``chunk``-token chunks) traced,
    ``non_torch_bytes`` cited, the CUDA graphs of ``max_num_seqs`` (none without ``cuda_graphs``), a
    ``draft`` model proposing ``speculative_tokens`` tokens, and the KV pool left at ``utilization`` of the
    GPU (``gpu_bytes``: another card's total, as a published log states it), in ``kv_dtype``."""
    rank = per_gpu_spec(spec, tp)
    peak = trace_prefill(spec, tp=tp, seq_len=seq_len, chunk=chunk, kv_dtype=kv_dtype, block_size=block_size)
    k = speculative_tokens if draft is not None else 0
    graphs = graph_bytes(spec, tp=tp, max_num_seqs=max_num_seqs, speculative_tokens=k,
                         max_batched_tokens=min(chunk or seq_len, seq_len), block_size=block_size) \
        if cuda_graphs else (0, 0, 0)
    draft_rank = per_gpu_spec(draft, tp) if draft is not None else None
    draft_kv = token_bytes(draft_rank, kv_dtype) if draft is not None else 0
    return Budget(spec.name, gpu, tp, utilization, weights, kv_dtype,
                  "latent" if latent(rank) and kv_layout != "per-head" else "K and V per KV head",
                  seq_len, chunk, block_size, gpu_bytes or GPUS[gpu],
                  weight_bytes(spec, tp=tp, weights=weights, group=group), peak["activations"], non_torch_bytes,
                  *graphs, rank.kv_heads, token_bytes(rank, kv_dtype, kv_layout) + draft_kv,
                  draft.name if draft is not None else None,
                  weight_bytes(draft, tp=tp, weights=weights, group=group) if draft is not None else 0, draft_kv,
                  read_weight_bytes(spec, tp=tp, weights=weights, group=group)
                  + (read_weight_bytes(draft, tp=tp, weights=weights, group=group) if draft is not None else 0))
