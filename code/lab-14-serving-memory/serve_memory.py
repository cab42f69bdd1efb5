"""Lab 14 - serving memory: a paged KV cache against static and growing ones, under continuous batching.

A server runs many requests at once and does not know how long any of them will be. Each step it
decodes one token for every running request, frees the finished ones and admits waiting ones while
the KV pool has room (continuous batching, Yu et al., OSDI 2022, "Orca"); when the pool runs out mid-
request it preempts the newest request, frees its keys and values and recomputes them later. How much
of the pool holds real keys and values, and so how many requests run at once, depends on the cache:
``paged_kv.py`` (blocks and block tables, Kwon et al., SOSP 2023) or ``kv_baselines.py`` (a static
reservation of max_len per request; a region per sequence that is reallocated as it grows).

A real model's name (``--model llama-3-8b``) serves at its real size: the budget traced on fake tensors
and the caches' bookkeeping on the budget's pool (no tensors, no tokens), as ``--fake`` asks of a toy.

Run it:
    .venv/bin/python code/lab-14-serving-memory/serve_memory.py --device cpu
    .venv/bin/python code/lab-14-serving-memory/serve_memory.py --cache paged --block-size 4 --system-prompt 32
    .venv/bin/python code/lab-14-serving-memory/serve_memory.py --model llama-3-8b --gpu h100-80gb --weights int4-awq --kv-dtype fp8
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import quantize
import serving_budget
import serving_trace
import torch
from kv_baselines import GrowingKVCache, StaticKVCache
from paged_kv import KV_DTYPES, KVStore, PagedKVCache, kv_bytes_per_token
from serving_model import ServingLlama
from serving_report import Result, Served, report
from serving_trace import Request

from labkit import budget, cli, marks, zoo
from labkit.config import MAX_BATCH, MAX_RANKS, MAX_TOKENS, MAX_WIDTH, LabConfig, UsageError, option
from labkit.ledger import Ledger


# --8<-- [start:serve]
@dataclass(eq=False)
class Sequence:
    request: Request
    tokens: list[int] = field(default_factory=list)  # generated so far
    seq: int = -1  # the cache's name for its current admission

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.request.output_len


def serve(cache, requests: list[Request], model: ServingLlama | None = None, prompt_of=None) -> Served:
    """Continuous batching of ``requests`` over ``cache``; ``model`` computes the tokens (None: the
    cache's bookkeeping alone, at any size), ``prompt_of(request)`` gives a prompt's token ids."""
    arriving, waiting, running = deque(sorted(requests, key=lambda r: r.arrival)), deque(), []
    served, step = Served(cache), 0
    while arriving or waiting or running:
        if not waiting and not running:
            step = max(step, arriving[0].arrival)  # idle until the next request arrives
        while arriving and arriving[0].arrival <= step:
            r = arriving.popleft()
            if cache.fits_alone(r.prompt_len + r.output_len):
                waiting.append(Sequence(r))
            else:  # (1)!
                served.rejected[r.id] = f"{r.prompt_len} + {r.output_len} tokens: more than the {cache.name} cache can ever hold"
        preempted = new = prefilled = 0
        for s in list(running):  # room for each running sequence's next token, oldest first
            while s in running and not cache.grow(s.seq):
                victim = running.pop()  # (2)!
                cache.free(victim.seq)
                waiting.appendleft(victim)
                preempted += 1
        if running:
            with marks.phase("decode", step):  # one token for every running sequence, in one batch
                last = [s.tokens[-1] for s in running]
                out = model.decode(cache, [s.seq for s in running], last) if model else [0] * len(running)
            for s, token in zip(running, out):
                s.tokens.append(token)
            new += len(running)
        for s in [s for s in running if s.done]:
            running.remove(s)
            cache.free(s.seq)  # (3)!
            served.outputs[s.request.id] = s.tokens
        while waiting:  # admit while the pool has room: a prefill gives each its first token
            s, r = waiting[0], waiting[0].request
            s.seq, length = served.next_seq(), r.prompt_len + len(s.tokens)  # a recompute runs its output too
            prefix = (r.prefix, r.prefix_len) if r.prefix is not None else None
            cached = cache.admit(s.seq, length, prefix)  # (4)!
            if cached is None:
                break
            waiting.popleft()
            with marks.phase("prefill", step):
                context = prompt_of(r) + s.tokens if model else None
                s.tokens.append(model.prefill(cache, s.seq, context, cached) if model else 0)
            if prefix:
                cache.publish_prefix(s.seq, prefix)
            new, prefilled = new + 1, prefilled + length - cached
            if s.done:
                cache.free(s.seq)
                served.outputs[r.id] = s.tokens
            else:
                running.append(s)
        served.record(step, running, waiting, new, preempted, prefilled)
        step += 1
    return served
# --8<-- [end:serve]


# --8<-- [start:config]
BUDGET_FOR_TOYS = "llama-3-8b"  # the real model a run of the toy sizes the serving budget of
GPUS = tuple(serving_budget.GPUS)  # Lab 13's cards, the 24 GB ones included
SERVED = ("llama", "mixtral", "deepseek")  # the zoo families a budget is traced for


@dataclass
class Config(LabConfig):
    """Serve a request trace with a paged, a static and a growing KV cache, and size a real model's KV pool on a GPU."""

    cache: Literal["all", "paged", "static", "growing"] = option("all", "the KV cache that serves the trace (all: each in turn)")
    block_size: int = option(16, "tokens per block of the paged cache", min=1, max=MAX_TOKENS)
    requests: int = option(32, "requests in the generated trace", min=1, max=MAX_BATCH)
    arrival_rate: float = option(2.0, "requests arriving per engine step, on average (Poisson)",
                                 min=1e-6, max=1e6)
    prompt_lens: tuple[int, ...] | None = option(
        None, "MIN,MAX prompt tokens, uniform (default: 1/16 to 3/8 of the model's context)", min=1, max=MAX_TOKENS)
    output_lens: tuple[int, ...] | None = option(
        None, "MIN,MAX generated tokens, uniform (default: 1/16 to 1/2 of the model's context)", min=1, max=MAX_TOKENS)
    system_prompt: int = option(0, "tokens of a system prompt that every generated request starts with",
                                min=0, max=MAX_TOKENS)
    trace: Path | None = option(None, "a JSON-lines trace file to serve instead (format: serving_trace.py)",
                                path="read")
    pool_tokens: int | None = option(None, "KV pool in tokens (default: 8 contexts; at real size, the budget's pool)",
                                     min=1, max=MAX_TOKENS)
    max_len: int | None = option(None, "tokens the static cache reserves per request (default: the context)",
                                 min=1, max=MAX_TOKENS)
    no_prefix_sharing: bool = option(False, "the paged cache keeps a copy of a shared prefix per request")
    model: str = option("small-llama", "a zoo model (small-llama, llama-3-8b, llama-3-70b, deepseek-v2-lite, ...) "
                        "or a Hugging Face config.json; a real one serves at real size (bookkeeping)", metavar="NAME|PATH")
    fake: bool = option(False, "real size for a toy too: the serving run keeps the caches' bookkeeping only (no "
                        "tensors, no tokens) on the budget's pool; the budget is traced on fake tensors either way")
    budget_model: str | None = option(
        None, f"the model whose serving budget on --gpu is sized, traced on fake tensors (default: --model; for a "
        f"toy, small-*, whose budget means nothing: {BUDGET_FOR_TOYS}); at real size, --model's own",
        metavar="NAME|PATH")
    gpu: Literal[GPUS] = option("h100-80gb", "the GPU the serving budget is sized for (Lab 13's cards)")
    tp: int = option(1, "tensor-parallel GPUs the model is split over (the budget is per GPU)", min=1, max=MAX_RANKS)
    gpu_memory_utilization: float = option(0.9, "fraction of the GPU the engine may use, as vLLM's flag",
                                           min=0.1, max=1)
    weights: Literal[tuple(quantize.FORMATS)] = option(
        "bf16", "how the weights are stored (quantize.py): int4 formats in groups of --group-size, with fp16 "
        "scales and 4-bit zeros; int8 and fp8 with fp32 scales; nvfp4 with an fp8 scale per 16")
    group_size: int | None = option(None, "int4 formats: inputs per scale and zero point (default 128)",
                                    min=1, max=MAX_WIDTH)
    kv_dtype: Literal[tuple(KV_DTYPES)] = option(
        "bf16", "how keys and values are stored: fp8 with one scale per layer (vLLM's default), fp8-per-head, or "
        "a float32 scale per token and head (fp8-per-token, int8)")
    kv_layout: Literal["auto", "latent", "per-head"] = option(
        "auto", "latent attention (MLA): cache the latent (auto, latent) or each head's K and V (per-head)")
    seq_len: int | None = option(None, "prompt tokens of the prefill whose peak the budget traces (default: its model's context)",
                                 min=1, max=MAX_TOKENS)
    prefill_chunk: int | None = option(None, "chunked prefill: tokens per chunk (default: the whole prompt at once)",
                                       min=1, max=MAX_TOKENS)
    enforce_eager: bool = option(False, "no CUDA graphs (vLLM's --enforce-eager): their memory goes to the KV pool")
    max_num_seqs: int = option(256, "sequences a step runs at most (vLLM's --max-num-seqs): the graphs captured",
                               min=1, max=MAX_BATCH)
    draft_model: str | None = option(None, "speculative decoding: a smaller zoo model whose weights and KV join the "
                                     "budget", metavar="NAME|PATH")
    num_speculative_tokens: int = option(3, "speculative decoding: tokens the draft proposes per step", min=1, max=64)
    non_torch_gib: float = option(serving_budget.NON_TORCH_BYTES / serving_budget.GIB,
                                  "GiB per GPU that grows outside PyTorch's allocator once the engine has started "
                                  f"(cuBLAS workspaces); default {serving_budget.NON_TORCH_SOURCE}", min=0, max=1024)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("prompt_lens", "output_lens"):
            pair = getattr(self, name)
            if pair is not None and (len(pair) != 2 or pair[0] > pair[1]):
                raise UsageError(f"--{name.replace('_', '-')} takes MIN,MAX with MIN <= MAX, got {','.join(map(str, pair))}")
        if self.trace is not None and self.system_prompt:
            raise UsageError("--system-prompt shapes a generated trace; put prefixes in the --trace file instead")
        if self.real_size and self.budget_model is not None:
            raise UsageError(f"--model {self.model} serves on its own budget's pool; leave --budget-model out")
        if self.spec().family not in SERVED or (not self.real_size and self.spec().family == "deepseek"):
            raise UsageError(f"--model {self.spec().name}: the serving forward runs the zoo's Llama-family models "
                             "(a DeepSeek model serves at real size only)")
        spec = self.budget_spec()  # --tp, --seq-len and the formats shape the budget
        if spec.family not in SERVED:
            raise UsageError(f"--budget-model {spec.name}: the budget traces the zoo's Llama, Mixtral and DeepSeek models")
        if spec.heads % self.tp or spec.ffn % self.tp or (self.tp > spec.kv_heads and self.tp % spec.kv_heads):
            raise UsageError(f"--tp {self.tp} does not split {spec.name}'s {spec.heads} heads, {spec.kv_heads} KV heads "
                             f"and MLP of {spec.ffn} evenly")
        if self.fake and self.device == "cuda":
            raise UsageError("--fake runs on this machine's CPU; leave --device at cpu or auto")
        if self.seq_len is not None and self.seq_len > spec.context:
            raise UsageError(f"--seq-len {self.seq_len:,} is more than {spec.name}'s context of {spec.context:,} tokens")
        self.check_formats(spec)

    def check_formats(self, spec) -> None:
        """The weight format, the KV layout and the draft model must fit the model they are given."""
        fmt = quantize.FORMATS[self.weights]
        if self.group_size is not None and not fmt.tunable:
            raise UsageError(f"--group-size sets an int4 format's groups; --weights {self.weights} has none to set")
        with torch.device("meta"):
            shapes = serving_budget.traced_blocks(serving_budget.per_gpu_spec(spec, self.tp)).build()
        why = quantize.check_model(shapes, self.weights, self.group_size)
        if why:
            raise UsageError(f"--weights {self.weights} cannot store {spec.name} (per GPU at --tp {self.tp}): {why}")
        if self.kv_layout == "latent" and not serving_budget.latent(spec):
            raise UsageError(f"--kv-layout latent caches latent attention's compressed KV: {spec.name} has none "
                             "(its attention keeps K and V per KV head)")
        draft = self.draft_spec()
        if draft is not None:
            if draft.param_count() >= spec.param_count():
                raise UsageError(f"--draft-model {draft.name} ({draft.param_count() / 1e9:.1f}B parameters) is not "
                                 f"smaller than {spec.name} ({spec.param_count() / 1e9:.1f}B): a draft must be the cheap model")
            if draft.vocab != spec.vocab:
                raise UsageError(f"--draft-model {draft.name}: its vocabulary ({draft.vocab:,}) is not {spec.name}'s "
                                 f"({spec.vocab:,}); the target checks the draft's tokens one for one")

    @property
    def real_size(self) -> bool:
        """Serve at real size (the budget's pool, bookkeeping only): a real model's name, or --fake."""
        return self.fake or not self.spec().name.startswith("small-")

    def spec(self):
        return zoo.get(self.model)  # an unknown name or a bad path: UsageError, one line

    def budget_spec(self):
        """The model the serving budget is sized for: --budget-model, else --model unless it is a toy."""
        if self.budget_model is not None:
            return zoo.get(self.budget_model)
        spec = self.spec()
        return zoo.get(BUDGET_FOR_TOYS) if not self.real_size else spec

    def draft_spec(self):
        return zoo.get(self.draft_model) if self.draft_model is not None else None
# --8<-- [end:config]


# --8<-- [start:run]
CACHES = {"paged": lambda store, c: PagedKVCache(store, c.block_size, share_prefixes=not c.no_prefix_sharing),
          "static": lambda store, c: StaticKVCache(store, c.max_len or c.spec().context),
          "growing": lambda store, c: GrowingKVCache(store)}


def run(config: Config) -> Result:
    device = cli.pick_device(config.device)
    spec, sized, t0 = config.spec(), config.budget_spec(), time.perf_counter()
    plan = serving_budget.plan(  # (1)!
        sized, gpu=config.gpu, tp=config.tp, utilization=config.gpu_memory_utilization, kv_dtype=config.kv_dtype,
        seq_len=config.seq_len or sized.context, chunk=config.prefill_chunk, block_size=config.block_size,
        non_torch_bytes=int(config.non_torch_gib * serving_budget.GIB), weights=config.weights,
        group=config.group_size, kv_layout=config.kv_layout, cuda_graphs=not config.enforce_eager,
        max_num_seqs=config.max_num_seqs, draft=config.draft_spec(), speculative_tokens=config.num_speculative_tokens)
    requests = requests_of(config, spec)
    pool = config.pool_tokens or (plan.max_tokens_in_flight if config.real_size else 8 * spec.context)
    check_pool(config, plan, requests, pool)
    model = None
    if not config.real_size:  # the toy runs for real: its weights and the pool must fit this machine
        per_token = kv_bytes_per_token(spec.layers, spec.kv_heads, spec.head_dim, config.kv_dtype)
        budget.require(4 * spec.param_count() + pool * per_token, device,
                       f"fp32 weights of {spec.name} and a {pool:,}-token KV pool")
        torch.manual_seed(config.seed)
        model = ServingLlama(spec.build().to(device).eval())
    served, ledgers = {}, {}
    for kind in CACHES if config.cache == "all" else [config.cache]:
        store = kv_store(config, pool, device, allocate=model is not None, per_token=plan.kv_bytes_per_token)
        ledger = Ledger(device)
        if model:
            ledger.track_module(model.model)
        ledger.track(store.tensors(), "kv_cache")  # (2)!
        with ledger:
            served[kind] = serve(CACHES[kind](store, config), requests, model,
                                 lambda r: serving_trace.prompt_tokens(r, spec.vocab, config.seed))
        ledgers[kind] = ledger
    return Result(config, spec, device, plan, requests, pool, served, ledgers, time.perf_counter() - t0)
# --8<-- [end:run]


def kv_store(config: Config, pool: int, device="cpu", allocate: bool = False, per_token: int | None = None) -> KVStore:
    """The pool a run serves from: at real size, one GPU's of a --tp group, bookkeeping only, its bytes per
    token the budget's (``per_token``: a latent, a draft's layers); else the toy's whole, on this device."""
    spec = serving_budget.per_gpu_spec(config.spec(), config.tp) if config.real_size else config.spec()
    store = KVStore(layers=spec.layers, slots=pool, kv_heads=spec.kv_heads, head_dim=spec.head_dim,
                    kv_dtype=config.kv_dtype, device=device, allocate=allocate)
    if config.real_size and per_token is not None:
        store.bytes_per_token = per_token  # counted by the budget from the config
    return store


def requests_of(config: Config, spec) -> list[Request]:
    """The trace file's requests, or a generated trace whose default lengths scale with the model's context."""
    if config.trace is not None:
        return serving_trace.read(config.trace)
    ctx = spec.context
    return serving_trace.generate(
        requests=config.requests, seed=config.seed, arrival_rate=config.arrival_rate,
        prompt_lens=config.prompt_lens or (max(1, ctx // 16), max(1, 3 * ctx // 8)),
        output_lens=config.output_lens or (max(1, ctx // 16), max(1, ctx // 2)), system_prompt=config.system_prompt)


MAX_BLOCKS = 1 << 24  # the bookkeeping keeps list entries per block; 16M blocks of 16 outnumber any GPU's pool


def check_pool(config: Config, plan, requests: list[Request], pool: int) -> None:
    """Refuse, in one line, a pool that cannot hold even one request's prompt, one block of the paged
    cache or one max_len region of the static one, or one too large to keep the books of."""
    if config.real_size and not config.pool_tokens and plan.kv_pool_bytes <= 0:
        raise UsageError(f"{plan.model} leaves no KV pool on {config.gpu} at --tp {config.tp}: weights "
                         f"{(plan.weights_bytes + plan.draft_weights_bytes) / 2**30:.1f} GiB + prefill "
                         f"{plan.prefill_peak_bytes / 2**30:.1f} GiB + non-torch {plan.non_torch_bytes / 2**30:.2f} GiB + "
                         f"CUDA graphs {plan.cuda_graph_bytes / 2**30:.2f} GiB > {plan.usable_bytes / 2**30:.1f} GiB usable")
    if pool // config.block_size > MAX_BLOCKS:
        raise UsageError(f"a KV pool of {pool:,} tokens is {pool // config.block_size:,} blocks of "
                         f"{config.block_size}: more than the {MAX_BLOCKS:,} this lab keeps the books of")
    longest = max(requests, key=lambda r: r.prompt_len)
    if longest.prompt_len > pool:
        raise UsageError(f"the KV pool ({pool:,} tokens, --pool-tokens) is smaller than the prompt of request "
                         f"{longest.id} ({longest.prompt_len:,} tokens): no cache could ever admit it")
    uses = {config.cache} if config.cache != "all" else set(CACHES)
    if "paged" in uses and pool < config.block_size:
        raise UsageError(f"the KV pool ({pool:,} tokens) is smaller than one block (--block-size {config.block_size})")
    max_len = config.max_len or config.spec().context
    if "static" in uses and pool < max_len:
        raise UsageError(f"the KV pool ({pool:,} tokens) is smaller than one static region of --max-len "
                         f"{max_len:,}: the static cache could admit nothing")


if __name__ == "__main__":
    cli.main(Config, run, report)
