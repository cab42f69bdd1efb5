"""Lab 14 - the measurements the page shows beyond one run: block sizes, prefix sharing, attention layouts,
quantized caches, and the serving budget of real models. Each returns a :class:`labkit.table.Table`
whose columns say whether a number is measured (the lab's own counts and errors, on CPU), derived
(from a configuration) or traced (fake tensors at real size).

Sweeps over the cache's bookkeeping run without the model (``serve(cache, requests)``): a schedule
depends on lengths alone, and ``tests/test_lab14.py`` holds the bookkeeping run's records equal to the
model run's, step for step.
"""

from __future__ import annotations

import dataclasses

import quantize
import serving_budget
import torch
from paged_kv import KV_DTYPES, KVStore, PagedKVCache, kv_bytes_per_token
from serve_memory import CACHES, kv_store, serve

from labkit import marks
from labkit.ledger import Ledger
from labkit.table import Table

TABLE_ENTRY_BYTES = 4  # one int32 per block-table entry, as vLLM keeps its block tables


def bookkeeping(kind: str, requests, *, pool: int, config):
    """``requests`` served by cache ``kind`` with no tensors behind it: the allocator's counts alone, on
    ``config``'s model (with ``--fake``, one GPU's share of a ``--tp`` group's KV heads)."""
    return serve(CACHES[kind](kv_store(config, pool), config), requests)


def block_sizes(requests, *, pool: int, config, sizes=(1, 2, 4, 8, 16, 32, 64)) -> Table:
    """The paged cache at each block size on one trace and pool: waste against block-table size."""
    rows = []
    for size in sizes:
        served = bookkeeping("paged", requests, pool=pool, config=dataclasses.replace(config, block_size=size))
        m = served.metrics()
        table_bytes = m["mean_table_entries"] * TABLE_ENTRY_BYTES
        stored = m["utilization"] * pool * served.bytes_per_token
        rows.append([size, m["waste_fraction"], m["max_concurrent"], m["tokens_per_step"], m["preemptions"],
                     table_bytes, table_bytes / stored])
    return Table([("block size", "int"), ("waste of held", "pct:1"), ("max concurrent", "int"),
                  ("tokens / step", "float:2"), ("preemptions", "int"), ("block tables (mean)", "size"),
                  ("tables / KV stored", "pct:3")], rows)


def prefix_sharing(requests, *, pool: int, config) -> Table:
    """The paged cache with and without sharing a common prefix's blocks, on one trace and pool."""
    rows = []
    for share in (False, True):
        c = dataclasses.replace(config, no_prefix_sharing=not share)
        m = bookkeeping("paged", requests, pool=pool, config=c).metrics()
        rows.append(["shared once" if share else "a copy per request", m["shared_fraction"], m["max_concurrent"],
                     m["tokens_per_step"], m["preemptions"], m["steps"]])
    return Table(["prefix blocks", ("tokens not stored twice", "pct:1"), ("max concurrent", "int"),
                  ("tokens / step", "float:2"), ("preemptions", "int"), ("steps", "int")], rows)


def attention_layouts(name: str = "llama-3-8b", toy: str = "small-llama") -> Table:
    """Keys and values per token for multi-head, grouped-query and multi-query attention: derived at a real
    model's shape, and measured on the toy model's pools by the ledger."""
    real, small = zoo_spec(name), zoo_spec(toy)
    rows = []
    for label, real_kv, toy_kv in (("MHA", real.heads, small.heads), (f"GQA ({name})", real.kv_heads, small.kv_heads),
                                   ("MQA", 1, 1)):
        with Ledger("cpu") as ledger, marks.category("kv_cache"):  # the ledger counts the pools as they are made
            KVStore(layers=small.layers, slots=64, kv_heads=toy_kv, head_dim=small.head_dim, kv_dtype="bf16")
        rows.append([label, real_kv, kv_bytes_per_token(real.layers, real_kv, real.head_dim, "bf16"), toy_kv,
                     ledger.peak()["kv_cache"] // 64])
    return Table(["attention", (f"KV heads ({name})", "int"), ("KV / token, bf16 (derived)", "size"),
                  (f"KV heads ({toy})", "int"), ("KV / token, measured", "B")], rows)


def zoo_spec(name: str):
    from labkit import zoo

    return zoo.get(name)


def kv_dtype_errors(model, prompt: list[int], steps: int = 16, real: str = "llama-3-8b") -> Table:
    """Each KV dtype against an fp32 cache on the same prompt and decode: the attention outputs' relative
    error (the largest of any layer and step), the logits' largest difference and the greedy tokens that
    agree (teacher-forced with the fp32 run's tokens), and the bytes per token at ``real``'s shape."""
    spec, big = model.model.spec, zoo_spec(real)

    def decode_run(kv_dtype: str, forced: list[int] | None):
        store = KVStore(layers=spec.layers, slots=len(prompt) + steps, kv_heads=spec.kv_heads,
                        head_dim=spec.head_dim, kv_dtype=kv_dtype)
        cache, outputs, logits, inner = PagedKVCache(store, 16), [], [], model.attention

        def recording(*args):
            outputs.append(inner(*args))
            return outputs[-1]
        model.attention = recording
        try:
            cache.admit(0, len(prompt))
            logits.append(model.forward(cache, [0], torch.tensor([prompt])))
            for i in range(steps - 1):
                cache.grow(0)
                token = forced[i] if forced else int(logits[-1].argmax())
                logits.append(model.forward(cache, [0], torch.tensor([[token]])))
        finally:
            model.attention = inner
        return outputs, torch.cat(logits)

    ref_out, ref_logits = decode_run("fp32", None)
    forced = ref_logits.argmax(-1).tolist()
    rows = []
    for kind in KV_DTYPES:
        out, logits = decode_run(kind, forced)
        error = max(float((a - b).norm() / b.norm()) for a, b in zip(out, ref_out))
        agree = float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean())
        rows.append([kind, kv_bytes_per_token(big.layers, big.kv_heads, big.head_dim, kind), error,
                     float((logits - ref_logits).abs().max()), agree])
    return Table(["KV dtype", (f"KV / token ({real})", "size"), ("attention error, max", "sci:1"),
                  ("logits, max difference", "sci:1"), ("greedy tokens agreeing", "pct:0")], rows)


def budgets(cases, *, gpu: str = "h100-80gb", utilization: float = 0.9) -> tuple[Table, Table, list]:
    """The serving budget of each ``(model name, tp, weights, kv_dtype, context, prefill chunk)`` in ``cases``
    on one ``gpu``, as vLLM sizes it: weights (counted per tensor), the peak of a prefill of the whole context
    (in chunks, if one is given) and the CUDA graphs traced, cited non-torch memory, the KV pool and what it
    holds: sequences of that context (paged, whole blocks; a static cache reserving the context holds as many);
    beside it the decode bound, one sequence and the pool's worth (derived). Each row's pool is sized for its
    own context. Two tables with the same rows, to fit a page: the budget, then what its pool holds and how
    fast it decodes. Returns both and the :class:`serving_budget.Budget` of each case."""
    from serving_report import decode_bounds

    plans, rows, speeds = [], [], []
    for name, tp, weights, kv_dtype, context, chunk in cases:
        b = serving_budget.plan(zoo_spec(name), gpu=gpu, tp=tp, utilization=utilization, kv_dtype=kv_dtype,
                                seq_len=context, chunk=chunk, weights=weights)
        plans.append(b)
        fits = b.kv_pool_bytes > 0
        one, full = decode_bounds(b) if fits else (None, None)
        rows.append([name, tp, weights, kv_dtype, context, chunk, b.weights_bytes, b.prefill_peak_bytes,
                     b.cuda_graph_bytes, b.kv_pool_bytes if fits else None])
        speeds.append([name, tp, weights, kv_dtype, context, chunk, b.kv_bytes_per_token,
                       b.sequences(context) if fits else None, one, full])
    config = ["model", ("TP", "int"), "weights", "KV dtype", ("context", "int"), ("prefill chunk", "int")]
    return (Table([*config, ("weights / GPU", "size"), ("prefill peak", "size"), ("CUDA graphs", "size"),
                   ("KV pool / GPU", "size")], rows),
            Table([*config, ("KV / token / GPU", "size"), ("sequences of the context", "int"),
                   ("decode tokens/s, one", "float:0"), ("decode tokens/s, all", "float:0")], speeds), plans)


def weight_formats(name: str = "llama-3-8b", gpu: str = "h100-80gb", context: int = 8192) -> tuple[Table, list]:
    """One model's weights in every ``--weights`` format (counted per tensor, scales and zeros included), the
    KV pool each leaves on ``gpu`` and the sequences of ``context`` it holds, with an fp8 KV cache too."""
    rows, plans = [], []
    for weights in quantize.FORMATS:
        b, b8 = (serving_budget.plan(zoo_spec(name), gpu=gpu, seq_len=context, weights=weights, kv_dtype=kv)
                 for kv in ("bf16", "fp8"))
        plans.append((b, b8))
        rows.append([weights, quantize.FORMATS[weights].bits, b.weights_bytes, b.kv_pool_bytes, b.sequences(context),
                     b8.sequences(context)])
    return Table(["weights", ("bits a weight", "int"), ("weights", "size"), ("KV pool", "size"),
                  (f"sequences of {context // 1024}k, bf16 KV", "int"), (f"sequences of {context // 1024}k, fp8 KV",
                                                                       "int")], rows), plans


def quantizer_checks(out: int = 512, inp: int = 1024, tokens: int = 16, seed: int = 0) -> Table:
    """The lab's int4 and int8 quantizers on a real random matrix: stored bytes against the format's, the
    largest error in half-steps, and the group-wise product against F.linear on the dequantized matrix."""
    g = torch.Generator().manual_seed(seed)
    w, x = torch.randn(out, inp, generator=g), torch.randn(tokens, inp, generator=g)
    rows = []
    for fmt in quantize.QUANTIZERS:
        r = quantize.check_linear(w, x, fmt)
        rows.append([fmt, r["bytes"], r["format_bytes"], r["worst_error_over_half_step"], r["output_difference"]])
    return Table(["format", ("bytes stored", "B"), ("bytes the format lists", "B"), ("worst error / half step", "float:3"),
                  ("product vs F.linear, relative", "sci:1")], rows)


def prefill_peaks(name: str = "llama-3.1-8b", lengths=(8192, 32768), chunks=(None, 2048), decode_batch: int = 256) -> Table:
    """Activations at the peak of one forward, traced: the zoo's training-style forward (every position's
    logits) against the serving prefill (last-token logits), whole and in chunks; and one decode step of
    ``decode_batch`` sequences, traced at a one-block context so that it holds its own activations and
    not the gathered copies of the keys and values it reads (those are in the pool already)."""
    spec, rows = zoo_spec(name), []
    for length in lengths:
        zoo_forward = serving_budget.trace_prefill(spec, seq_len=length, zoo_forward=True)["activations"]
        rows.append([length, "zoo forward, every position's logits", zoo_forward])
        for chunk in chunks:
            peak = serving_budget.trace_prefill(spec, seq_len=length, chunk=chunk)["activations"]
            rows.append([length, "serving prefill, " + (f"chunks of {chunk:,}" if chunk else "whole prompt"), peak])
    decode = serving_budget.trace_step(spec, batch=decode_batch, context=16, new=1)["activations"]
    rows.append([decode_batch, f"decode step: {decode_batch} sequences, one token each", decode])
    return Table([("tokens", "int"), "forward", ("activations at the peak", "size")], rows)
