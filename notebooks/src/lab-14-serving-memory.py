# %% [markdown]
# # Lab 14 · Serving memory, measured
#
# This notebook runs the Lab 14 starter, `code/lab-14-serving-memory/serve_memory.py`: one request
# trace served by a paged KV cache, a static cache that reserves the maximum length per request, and a
# growing cache that reallocates each sequence as it grows, all on the same pool and the same small
# Llama (random weights). It is executed by `scripts/run_notebooks.py`, never edited by hand; the table
# below says where and on which code. On a CPU the byte counts are exact; speed needs a GPU run.
#
# What to look for:
#
# 1. The three caches generate the same tokens; only where they keep the keys and values differs.
# 2. The paged cache wastes at most one block's tail per sequence; the static cache wastes what it
#    reserved ahead; the growing one wastes nothing but fragments the pool and copies every step.
# 3. At real size (Llama-3-8B and 70B on an 80 GB H100, traced on fake tensors) the weights and the
#    prefill peak decide the KV pool, and the pool decides how many requests run at once.

# %%
import matplotlib.pyplot as plt
import torch
from IPython.display import display

from labkit import labs, marks, notebook, plot, zoo
from labkit.ledger import Ledger

nb = notebook.setup(14)
lab = nb.lab
measure = labs.load(14, "serving_measure")
report = labs.load(14, "serving_report")
budget = labs.load(14, "serving_budget")
logs = labs.load(14, "serving_logs")
config = lab.Config(device=nb.device.type)

# %% [markdown]
# ## One trace, three caches, one pool
#
# 32 requests arrive as a Poisson process (2 per engine step on average); prompts are 8 to 48 tokens
# and outputs 8 to 64 (uniform), and the pool holds 1,024 tokens (8 of small-llama's 128-token
# contexts), so the caches must choose whom to run. Each engine step decodes one token for every
# running request, frees the finished ones and admits waiting ones while the cache has room; a
# request that cannot grow preempts the newest one, which is recomputed later.

# %%
result = lab.run(config)
caches = report.caches_table(result)
display(caches)
print(f"identical greedy tokens from the three caches: {result.identical_tokens()}")
metrics = {name: served.metrics() for name, served in result.served.items()}
cost = report.Table(["cache", ("prefill tokens (recomputes included)", "int"), ("bytes copied", "size")],
                    [[name, m["prefilled_tokens"], m["copied_bytes"]] for name, m in metrics.items()])
display(cost)

# %% [markdown]
# ## Where the pool goes, step by step
#
# For each cache, the pool's slots at every step: holding a token's keys and values, held but empty
# (internal waste in the paged cache's last blocks, reservation waste in the static cache's regions),
# and free but unusable (fragmentation). The dashed line is the paged cache's bound, one block's tail
# per running sequence (`running x (block_size - 1)` slots): its internal waste never crosses it
# (`tests/test_lab14.py` asserts it at every step).

# %%
fig, axes = plt.subplots(3, 1, figsize=(8, 9), dpi=110, layout="constrained", sharex=True, sharey=True)
for ax, (name, served) in zip(axes, result.served.items()):
    rec, kib = served.records, served.bytes_per_token / 1024
    steps = [r.step for r in rec]
    layers = {"K/V stored": [r.stored * kib for r in rec],
              "internal waste": [r.internal * kib for r in rec],
              "reservation waste": [r.reservation * kib for r in rec],
              "fragmentation": [r.fragmentation * kib for r in rec]}
    ax.stackplot(steps, *layers.values(), labels=layers.keys(),
                 colors=[plot.CATEGORY_COLORS["kv_cache"], plot.SERIES[3], plot.SERIES[4], plot.SERIES[7]])
    if name == "paged":
        bound = [(r.stored + r.running * (config.block_size - 1)) * kib for r in rec]
        ax.plot(steps, bound, "k--", lw=1, label="stored + bound on internal waste")
    ax.axhline(result.pool_tokens * kib, color=plot.INK, lw=0.8)
    ax.set(title=f"{name} (measured)", ylabel="KiB of the pool")
    ax.grid(alpha=0.3)
axes[-1].set_xlabel("engine step")
fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=3, fontsize=8)
fig_records = fig
notebook.show(fig, alt="For each of the paged, static and growing caches, the pool's slots per engine step, "
                       "stacked: stored keys and values, internal waste, reservation waste and fragmentation")

# %% [markdown]
# ## The ledger's view of the paged run
#
# The memory ledger watched the run: the weights (parameters), the pool (labelled `kv_cache`, allocated
# once, the same bytes whatever it holds) and the short-lived tensors of each prefill and decode step.

# %%
fig_ledger, ax_ledger = plt.subplots(figsize=(10, 5.2), dpi=110, layout="constrained")
plot.plot_timeline(result.ledgers["paged"].timeline(), ax=ax_ledger, max_points=400,
                   title=f"Paged cache, {len(result.requests)} requests (ledger)")
notebook.show(fig_ledger, alt="The memory ledger's timeline of the paged run: the parameters, the KV pool "
                              "allocated once, and each step's temporaries")

# %% [markdown]
# ## Block size: waste against table size
#
# The same trace and pool at each block size (the allocator's own counts; the schedule depends on lengths
# alone, so these runs keep the bookkeeping and skip the model: `tests/test_lab14.py` holds the two equal,
# step for step). Block tables are counted at 4 bytes per entry.

# %%
blocks = measure.block_sizes(result.requests, pool=result.pool_tokens, config=config)
display(blocks)

# %% [markdown]
# ## A shared system prompt
#
# The same trace with a 32-token system prompt in front of every prompt: the paged cache keeps the
# prompt's full blocks once, reference-counted, and later requests skip their prefill.

# %%
with_prompt = lab.Config(device=nb.device.type, system_prompt=32)
prefix = measure.prefix_sharing(lab.requests_of(with_prompt, result.spec),
                                pool=result.pool_tokens, config=with_prompt)
display(prefix)

# %% [markdown]
# ## Attention layout and KV dtype: bytes per token, and what quantizing costs
#
# Bytes per token are derived from each configuration (2 x layers x KV heads x head size x bytes) and
# measured on the toy model's pools by the ledger. The quantized caches keep float32 scales: one per layer
# (fp8, vLLM's default), per layer and KV head (fp8-per-head), or per token and KV head (fp8-per-token, int8);
# their attention outputs and logits are compared with an fp32 cache over a 48-token prompt and 32 decode
# steps (teacher-forced with the fp32 run's tokens).

# %%
layouts = measure.attention_layouts()
torch.manual_seed(0)
model = lab.ServingLlama(result.spec.build().to(nb.device).eval())
prompt = lab.serving_trace.prompt_tokens(result.requests[0], result.spec.vocab, config.seed)[:48]
kv_dtypes = measure.kv_dtype_errors(model, prompt, steps=32)
display(layouts, kv_dtypes)

# %% [markdown]
# ## At real scale: Llama-3-8B and Llama-3-70B on an 80 GB H100
#
# The serving budget the way vLLM 0.22 sizes it (`serving_budget.py`): of the card's total memory, the
# `--gpu-memory-utilization` fraction (0.9); less the weights (counted per tensor at the published size:
# bf16, or each block's matrices as a quantized format stores them), the peak of one prefill (**traced on
# fake tensors** through this lab's serving forward; nothing is allocated), the non-torch memory that grows
# after vLLM's baseline (**cited** from a vLLM log) and the CUDA graphs (the first, largest capture
# **traced**, and vLLM's 1 MiB floor for each further graph); the rest is the KV pool. The CUDA context
# stays in the share the flag leaves out. Bytes per token come from each configuration. Tensor parallelism
# is traced as the per-GPU model. Each row's prefill is its whole context (8,192 tokens; 32,768 for
# Llama-3.1-8B), at once or in 2,048-token chunks. Beside each budget, the most tokens per second decode
# can make (**derived**: the card's bandwidth over the bytes a step reads).

# %%
cases = [("llama-3-8b", 1, "bf16", "bf16", 8192, None), ("llama-3-8b", 1, "bf16", "fp8", 8192, None),
         ("llama-3-8b", 1, "bf16", "fp8-per-token", 8192, None), ("llama-3-8b", 1, "bf16", "int8", 8192, None),
         ("llama-3-8b", 1, "int4-awq", "fp8", 8192, None),
         ("llama-3.1-8b", 1, "bf16", "bf16", 32768, None), ("llama-3.1-8b", 1, "bf16", "bf16", 32768, 2048),
         ("llama-3-70b", 1, "bf16", "bf16", 8192, None), ("llama-3-70b", 2, "bf16", "bf16", 8192, None),
         ("llama-3-70b", 4, "bf16", "bf16", 8192, None), ("llama-3-70b", 8, "bf16", "bf16", 8192, None),
         ("llama-3-70b", 4, "bf16", "fp8", 8192, None), ("llama-3-70b", 1, "int4-awq", "fp8", 8192, None),
         ("deepseek-v2-lite", 1, "bf16", "bf16", 8192, None)]
real_scale, real_speed, plans = measure.budgets(cases)
by_case = dict(zip(cases, plans))
prefill = measure.prefill_peaks()
display(real_scale, real_speed, prefill)

# %% [markdown]
# ## Quantized weights: the lab's int4 and int8, and what every format stores
#
# `quantize.py` quantizes for real in plain PyTorch: group-wise asymmetric int4 (an fp16 scale and a 4-bit
# zero per 128 inputs, eight values packed in an int32) and per-channel int8. On a random matrix, **measured**:
# the bytes stored are the bytes the format lists (vLLM's tensors for it), no weight is off by more than
# half a step (plus the fp16 scale's rounding), and the group-by-group product equals `F.linear` on the
# dequantized matrix. Then Llama-3-8B in every format (fp8 and NVFP4 counted from their layouts), the pool
# each leaves on an H100, and the 8k requests it holds.

# %%
quantizers = measure.quantizer_checks()
formats, format_plans = measure.weight_formats()
display(quantizers, formats)

# %% [markdown]
# ## An fp8 KV cache holds twice the tokens, measured
#
# vLLM's fp8 keeps one float32 scale per layer for the keys and one for the values: the pool's bytes per
# token are exactly half of bf16's. The ledger counts a real pool of the toy model in bf16, in fp8 (per
# tensor) and in this lab's first choice, fp8 with a scale per token and head; the traced budgets give
# the tokens each holds on an H100.

# %%
def pool_bytes(kind, slots=1024):
    with Ledger("cpu") as ledger, marks.category("kv_cache"):
        lab.KVStore(layers=result.spec.layers, slots=slots, kv_heads=result.spec.kv_heads,
                    head_dim=result.spec.head_dim, kv_dtype=kind)
    return ledger.peak()["kv_cache"]


kv_kinds = ("bf16", "fp8", "fp8-per-head", "fp8-per-token")
kv_pools = {kind: pool_bytes(kind) for kind in kv_kinds}
kv_tokens = {kind: by_case[("llama-3-8b", 1, "bf16", kind if kind != "fp8-per-head" else "fp8", 8192, None)]
             .max_tokens_in_flight for kind in ("bf16", "fp8", "fp8-per-token")}
kv_double = report.Table(
    ["KV dtype", ("toy pool, measured", "B"), ("of bf16's", "x:3"), ("Llama-3-8B tokens on an H100, traced", "int"),
     ("of bf16's tokens", "x:3")],
    [[kind, kv_pools[kind], kv_pools[kind] / kv_pools["bf16"], kv_tokens.get(kind),
      kv_tokens[kind] / kv_tokens["bf16"] if kind in kv_tokens else None] for kind in kv_kinds])
display(kv_double)

# %% [markdown]
# ## Engines' other tenants: speculative decoding, latent attention, the 24 GB cards
#
# A draft model (Llama-3.2-1B proposing 3 tokens for Llama-3.1-8B) stays resident and keeps its own keys and
# values for every token in flight. DeepSeek-V2-Lite's multi-head latent attention (MLA) caches one
# compressed vector per layer instead of K and V per head. And the 24 GB cards Lab 13 accepts.

# %%
spec_8b, spec_31 = zoo.get("llama-3-8b"), zoo.get("llama-3.1-8b")
draft = budget.plan(spec_31, seq_len=8192, draft=zoo.get("llama-3.2-1b"), speculative_tokens=3)
alone = budget.plan(spec_31, seq_len=8192)
deepseek = by_case[("deepseek-v2-lite", 1, "bf16", "bf16", 8192, None)]
deepseek_heads = budget.plan(zoo.get("deepseek-v2-lite"), seq_len=8192, kv_layout="per-head")
tenants = report.Table(
    ["budget", ("weights", "size"), ("CUDA graphs", "size"), ("KV / token", "size"), ("KV pool", "size"),
     ("sequences of 8k", "int")],
    [[name, b.weights_bytes + b.draft_weights_bytes, b.cuda_graph_bytes, b.kv_bytes_per_token, b.kv_pool_bytes,
      b.sequences(8192)] for name, b in (
        ("llama-3.1-8b alone", alone), ("llama-3.1-8b + llama-3.2-1b draft", draft),
        ("deepseek-v2-lite, latent (MLA)", deepseek), ("deepseek-v2-lite, K and V per head", deepseek_heads))])
cards = {}
for gpu in ("l4-24gb", "a10-24gb", "rtx4090-24gb"):
    for weights in ("bf16", "int4-awq"):
        cards[(gpu, weights)] = budget.plan(spec_8b, gpu=gpu, seq_len=8192, weights=weights, kv_dtype="fp8")
small_cards = report.Table(
    ["GPU", "weights", ("usable", "size"), ("KV pool", "size"), ("sequences of 8k, fp8 KV", "int"),
     ("decode tokens/s, one, at most", "float:0")],
    [[gpu, weights, b.usable_bytes, b.kv_pool_bytes, b.sequences(8192), report.decode_bounds(b)[0]]
     for (gpu, weights), b in cards.items()])
display(tenants, small_cards)

# %% [markdown]
# ## Held against vLLM's own logs
#
# Published vLLM start-up logs, each with the configuration its thread states (`serving_logs.py`): the
# weights they print against the lab's count, and, where the log prints its pool, each term of the budget
# against the lab's for the same card total, utilization, TP and profiled tokens. Each gap names its
# mechanism; nothing is fitted.

# %%
log_weights = logs.weights_table()
log_terms, log_pools, log_plans = logs.compare()
log_mechanisms = logs.mechanisms_table()
display(log_weights, log_terms, log_pools, log_mechanisms)

# %% [markdown]
# ### What paging changes at real size
#
# Llama-3-8B's pool from the first row, served with each cache's bookkeeping (no tensors at this size:
# the schedule is the same code, and depends on lengths alone): 300 requests, 4 arriving per step,
# prompts of 512 to 3,072 tokens and outputs of 128 to 1,024, the static cache reserving the model's
# 8,192-token context per request.

# %%
at_8b = lab.run(lab.Config(model="llama-3-8b", fake=True, requests=300, arrival_rate=4, output_lens=(128, 1024)))
real_serving = report.caches_table(at_8b)
display(real_serving)

# %% [markdown]
# ## How fast decode can be: bandwidth, not capacity
#
# The pool above decides how many sequences fit; the memory's bandwidth decides how fast each gets its
# next token. A decode step reads every weight matrix once (the embedding table only the rows it looks
# up) and each sequence's keys and values, and does about one FLOP per byte it reads
# (`serving_speed.decode_step`, **derived**); a training matmul does over a thousand. Below the card's
# ridge point (its peak FLOP/s over its bandwidth, both **cited** from NVIDIA in `serving_speed.CHIPS`)
# a kernel waits on memory, so decode makes at most `bandwidth x batch / bytes read per step` tokens a
# second. Llama-3-8B in bf16 on an H100 SXM at an 8,192-token context: one sequence, and as many as the
# pool above holds.

# %%
speed = labs.load(14, "serving_speed")
h100, spec_8b, context = speed.CHIPS["h100-80gb"], zoo.get("llama-3-8b"), 8192
sizes, speeds = speed.sizes_table(), speed.speeds_table()
matmul_flops, matmul_bytes = speed.matmul(tokens=8192, d_in=4096, d_out=4096)
decode = [speed.decode(h100, spec_8b, context, batch) for batch in (1, by_case[cases[0]].sequences(context))]
decode_table = speed.decode_table(decode)
display(sizes, speeds, decode_table)

# %%
budget_8b, fp8_8b = by_case[cases[0]], by_case[cases[1]]
long_whole, long_chunked = by_case[cases[5]], by_case[cases[6]]
int4_fp8 = by_case[("llama-3-8b", 1, "int4-awq", "fp8", 8192, None)]
budget_70b = {plan.tp: plan for plan in plans if plan.model == "llama-3-70b" and plan.kv_dtype == "bf16"
              and plan.weights == "bf16"}
prefill_numbers = dict(zip(("zoo_8k", "whole_8k", "chunked_8k", "zoo_32k", "whole_32k", "chunked_32k", "decode_256"),
                           (row[2] for row in prefill.rows)))
real_metrics = {name: served.metrics() for name, served in at_8b.served.items()}
kv_rows = {row[0]: row for row in kv_dtypes.rows}
quant_rows = {row[0]: row for row in quantizers.rows}
bounds_8b, bounds_int4 = report.decode_bounds(budget_8b), report.decode_bounds(int4_fp8)
log_gaps = {f"{log.model}, {log.card}, TP {log.tp}, {log.tokens} tokens": b.kv_pool_bytes / (log.kv_gib * 2**30) - 1
            for log, b in zip([log for log in logs.LOGS if log.kv_gib is not None], log_plans)}
notebook.publish(
    nb, tables={"caches": caches, "cost": cost, "block_sizes": blocks, "prefix": prefix, "layouts": layouts,
                "kv_dtypes": kv_dtypes, "real_scale": real_scale, "real_speed": real_speed, "prefill": prefill, "real_serving": real_serving,
                "gpu_sizes": sizes, "gpu_speeds": speeds, "decode_bound": decode_table, "quantizers": quantizers,
                "weight_formats": formats, "kv_double": kv_double, "tenants": tenants, "small_cards": small_cards,
                "log_weights": log_weights, "log_terms": log_terms, "log_pools": log_pools, "log_mechanisms": log_mechanisms,
                "budget_8b": report.budget_table(budget_8b)},
    figures={"records": fig_records, "ledger": fig_ledger},
    summary=result.summary(),
    pool_tokens=result.pool_tokens, pool_bytes=result.pool_bytes, identical_tokens=result.identical_tokens(),
    block16_waste=blocks.rows[4][1], block1_tables=blocks.rows[0][5], block16_tables=blocks.rows[4][5],
    prefix_saving=prefix.rows[1][1], prefix_concurrent={"copied": prefix.rows[0][2], "shared": prefix.rows[1][2]},
    int8_error=kv_rows["int8"][2], fp8_error=kv_rows["fp8"][2], bf16_error=kv_rows["bf16"][2],
    fp8_token_error=kv_rows["fp8-per-token"][2],
    quantizer={fmt: {"worst_half_steps": row[3], "product_difference": row[4]} for fmt, row in quant_rows.items()},
    real={"kv_bytes_per_token_8b": budget_8b.kv_bytes_per_token, "weights_8b": budget_8b.weights_bytes,
          "prefill_8b": budget_8b.prefill_peak_bytes, "pool_8b": budget_8b.kv_pool_bytes,
          "tokens_8b": budget_8b.max_tokens_in_flight, "seqs_8k_8b": budget_8b.sequences(8192),
          "seqs_2k_8b": budget_8b.sequences(2048),
          "long": {"pool_whole": long_whole.kv_pool_bytes, "pool_chunked": long_chunked.kv_pool_bytes,
                   "seqs_whole": long_whole.sequences(32768), "seqs_chunked": long_chunked.sequences(32768)},
          "non_torch": budget_8b.non_torch_bytes, "outside_8b": budget_8b.outside_bytes,
          "graphs_8b": budget_8b.cuda_graph_bytes, "graph_count_8b": budget_8b.cuda_graphs,
          "kv_int8_8b": by_case[cases[3]].kv_bytes_per_token,
          "kv_half_8b": budget_8b.kv_bytes_per_token // 2, "kv_8k_request_8b": 8192 * budget_8b.kv_bytes_per_token,
          "kv_mha_8b": layouts.rows[0][2], "kv_mqa_8b": layouts.rows[2][2],
          "tokens_8b_fp8": fp8_8b.max_tokens_in_flight, "seqs_8k_8b_fp8": fp8_8b.sequences(8192),
          "fp8_ratio": fp8_8b.max_tokens_in_flight / budget_8b.max_tokens_in_flight,
          "fp8_token_ratio": kv_tokens["fp8-per-token"] / kv_tokens["bf16"],
          "toy_fp8_pool_ratio": kv_pools["fp8"] / kv_pools["bf16"],
          "int4_fp8": {"weights": int4_fp8.weights_bytes, "pool": int4_fp8.kv_pool_bytes,
                       "tokens": int4_fp8.max_tokens_in_flight, "seqs_8k": int4_fp8.sequences(8192)},
          "weights_by_format": {row[0]: row[2] for row in formats.rows},
          "seqs_8k_by_format": {row[0]: row[4] for row in formats.rows},
          "weights_70b_tp1": budget_70b[1].weights_bytes, "usable": budget_8b.usable_bytes,
          "pool_70b": {tp: p.kv_pool_bytes for tp, p in budget_70b.items()},
          "seqs_8k_70b": {tp: p.sequences(8192) for tp, p in budget_70b.items() if p.kv_pool_bytes > 0},
          "seqs_8k_70b_int4": by_case[("llama-3-70b", 1, "int4-awq", "fp8", 8192, None)].sequences(8192),
          "prefill": prefill_numbers,
          "concurrent": {name: m["max_concurrent"] for name, m in real_metrics.items()},
          "tokens_per_step": {name: m["tokens_per_step"] for name, m in real_metrics.items()},
          "static_waste": real_metrics["static"]["waste_fraction"],
          "draft": {"weights": draft.draft_weights_bytes, "kv_per_token": draft.kv_bytes_per_token,
                    "seqs_8k": draft.sequences(8192), "alone_seqs_8k": alone.sequences(8192)},
          "deepseek": {"weights": deepseek.weights_bytes, "kv_per_token": deepseek.kv_bytes_per_token,
                       "seqs_8k": deepseek.sequences(8192), "heads_kv_per_token": deepseek_heads.kv_bytes_per_token,
                       "heads_seqs_8k": deepseek_heads.sequences(8192), "params": zoo.get("deepseek-v2-lite").param_count()},
          "cards": {f"{gpu}-{weights}": b.sequences(8192) for (gpu, weights), b in cards.items()},
          "decode_8b": {"one": bounds_8b[0], "all": bounds_8b[1]},
          "decode_8b_int4": {"one": bounds_int4[0], "all": bounds_int4[1]}},
    logs={"pool_gap": log_gaps, "worst_pool_gap": max(abs(g) for g in log_gaps.values()),
          "count": len(logs.LOGS)},
    speed={"ridge_h100": h100.ridge, "bandwidth_h100_tb": h100.bandwidth.value / 1e12,
           "bf16_h100_tflops": h100.bf16_dense.value / 1e12,
           "matmul": {"flops": matmul_flops, "bytes": matmul_bytes, "intensity": matmul_flops / matmul_bytes},
           "decode_8b": decode[0], "decode_8b_pool": decode[1],  # and in GB, as bandwidths are quoted:
           "gb": {name: {key: d[key] / 1e9 for key in ("bytes", "weight_bytes", "kv_bytes")}
                  for name, d in (("decode_8b", decode[0]), ("decode_8b_pool", decode[1]))},
           "rounded": {name: float(f"{d['tokens_per_s']:.2g}")
                       for name, d in (("decode_8b", decode[0]), ("decode_8b_pool", decode[1]))}})
