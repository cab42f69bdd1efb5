"""Lab 14 - the serving budget at real size: what is left for the KV pool, and how many tokens it holds.

A serving engine sizes its KV pool once, at start-up, the way vLLM does with
``--gpu-memory-utilization`` (vLLM docs, "Engine Arguments"; ``vllm/utils/mem_utils.py``): of the
GPU's memory it may use the given fraction; from that it takes the weights, the peak of one profiling
forward (the activations of the largest prefill it will run) and the memory no tensor accounts for
(CUDA context, cuBLAS workspaces, NCCL buffers, CUDA graphs); the rest becomes KV blocks. This file
does that sum with the weights and the prefill peak **traced on fake tensors** (the zoo model at its
published size, bf16, the lab's own serving forward; nothing is allocated) and the non-torch memory
**cited**: Lab 13's CUDA context allowance and its source (``fit_gpus.CUDA_CONTEXT_SOURCE``), a flag
to override it. Bytes per token come from the model's config.

Tensor parallelism over ``tp`` GPUs is traced as the per-GPU model Megatron-style sharding leaves:
the query heads, the KV heads, the MLP's hidden size and the vocabulary (embedding and head) divided
by ``tp``, the hidden size and the norms whole. So each GPU holds 1/tp of the weights (but the norms)
and of every token's keys and values; with more GPUs than KV heads, each GPU keeps one KV head
(replicated). The all-reduce buffers are not in the trace.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from paged_kv import KVStore, PagedKVCache, kv_bytes_per_token
from serving_model import ServingLlama

from labkit import fake, labs, marks
from labkit.ledger import Ledger

GIB = 1 << 30
FIT_GPUS = labs.load(13, "fit_gpus")
#: Memory per GPU: the total the CUDA driver reports, from Lab 13's GPU table (one place for it; the
#: datasheets' "80 GB" is a little more than an 80 GB card's driver total).
GPUS = {name: gpu.total_bytes for name, gpu in FIT_GPUS.GPUS.items()}
#: Memory per GPU outside PyTorch's allocator (CUDA context, cuBLAS workspaces): Lab 13's allowance,
#: with its source; one wording for the report, ``--help`` and the page.
NON_TORCH_BYTES = FIT_GPUS.CUDA_CONTEXT_BYTES
NON_TORCH_SOURCE = FIT_GPUS.CUDA_CONTEXT_SOURCE
NON_TORCH_HOW = "assumed from cited measurements (Lab 13's CUDA context)"


def per_gpu_spec(spec, tp: int):
    """The model one of ``tp`` tensor-parallel GPUs holds: heads, KV heads (at least one), MLP width and
    vocabulary divided by ``tp``; hidden size, layers and head size unchanged."""
    if tp == 1:
        return spec
    return dataclasses.replace(spec, heads=spec.heads // tp, kv_heads=max(1, spec.kv_heads // tp),
                               ffn=spec.ffn // tp, vocab=-(-spec.vocab // tp), head_dim=spec.head_dim)


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
               block_size: int = 16, zoo_forward: bool = False, tensors=fake.tensors) -> dict:
    """Peak bytes of one forward of ``batch`` sequences of ``context`` tokens whose last ``new`` are
    computed (a prefill: batch 1, new = the chunk; a decode step: new = 1), on one of ``tp`` GPUs.
    Arguments and result as :func:`trace_prefill`'s."""
    rank = per_gpu_spec(spec, tp)
    with tensors():
        model = fake.materialize(rank.build, dtype=torch.bfloat16)
        store = KVStore(layers=rank.layers, slots=batch * -(-context // block_size) * block_size,
                        kv_heads=rank.kv_heads, head_dim=rank.head_dim, kv_dtype=kv_dtype)
        cache = PagedKVCache(store, block_size)
        ledger = Ledger("cpu").track_module(model)
        ledger.track(store.tensors(), "kv_cache")
        with ledger, torch.no_grad(), marks.phase("step"):
            tokens = torch.zeros(batch, new if not zoo_forward else context, dtype=torch.long)
            if zoo_forward:
                model(tokens)
            else:
                for seq in range(batch):
                    cache.admit(seq, context - new)  # the earlier tokens' keys and values are in the cache
                    cache.grow(seq, new)
                ServingLlama(model).forward(cache, list(range(batch)), tokens)
    peak = ledger.timeline().peaks_by_phase()["step"]
    return peak | {"activations": sum(v for k, v in peak.items() if k not in ("parameters", "kv_cache"))}


@dataclass
class Budget:
    """The serving budget of one GPU of a ``tp``-way group (bytes per GPU)."""

    model: str
    gpu: str
    tp: int
    utilization: float
    kv_dtype: str
    seq_len: int  # the prompt the prefill peak is traced at
    chunk: int | None
    block_size: int
    gpu_bytes: int
    weights_bytes: int  # traced
    prefill_peak_bytes: int  # traced: activations and temporaries at the prefill's peak
    non_torch_bytes: int  # Lab 13's allowance (NON_TORCH_BYTES) or a flag
    kv_heads_per_gpu: int
    kv_bytes_per_token: int  # per GPU, from the config

    @property
    def usable_bytes(self) -> int:
        return int(self.gpu_bytes * self.utilization)

    @property
    def kv_pool_bytes(self) -> int:
        """What is left for KV blocks (negative: the model does not fit)."""
        return self.usable_bytes - self.weights_bytes - self.prefill_peak_bytes - self.non_torch_bytes

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
            "usable_bytes": self.usable_bytes, "kv_pool_bytes": self.kv_pool_bytes,
            "max_tokens_in_flight": self.max_tokens_in_flight}


def plan(spec, *, gpu: str = "h100-80gb", tp: int = 1, utilization: float = 0.9, kv_dtype: str = "bf16",
         seq_len: int, chunk: int | None = None, block_size: int = 16,
         non_torch_bytes: int = NON_TORCH_BYTES) -> Budget:
    """The serving budget of ``spec`` on one ``gpu`` of a ``tp``-way group: weights and the peak of a
    ``seq_len``-token prefill (in ``chunk``-token chunks) traced, ``non_torch_bytes`` cited, and the
    KV pool that is left at ``utilization`` of the GPU, in ``kv_dtype``."""
    rank = per_gpu_spec(spec, tp)
    peak = trace_prefill(spec, tp=tp, seq_len=seq_len, chunk=chunk, kv_dtype=kv_dtype, block_size=block_size)
    return Budget(spec.name, gpu, tp, utilization, kv_dtype, seq_len, chunk, block_size, GPUS[gpu],
                  peak["parameters"], peak["activations"], non_torch_bytes, rank.kv_heads,
                  kv_bytes_per_token(rank.layers, rank.kv_heads, rank.head_dim, kv_dtype))
