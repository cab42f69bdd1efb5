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

from labkit import labs, notebook, plot, zoo

nb = notebook.setup(14)
lab = nb.lab
measure = labs.load(14, "serving_measure")
report = labs.load(14, "serving_report")
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
                 colors=["#CCB974", "#C44E52", "#8172B3", "#8C8C8C"], alpha=0.9)
    if name == "paged":
        bound = [(r.stored + r.running * (config.block_size - 1)) * kib for r in rec]
        ax.plot(steps, bound, "k--", lw=1, label="stored + bound on internal waste")
    ax.axhline(result.pool_tokens * kib, color="black", lw=0.8)
    ax.set(title=f"{name} (measured)", ylabel="KiB of the pool")
    ax.grid(alpha=0.3)
axes[-1].set_xlabel("engine step")
fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=3, fontsize=8)
fig_records = fig

# %% [markdown]
# ## The ledger's view of the paged run
#
# The memory ledger watched the run: the weights (parameters), the pool (labelled `kv_cache`, allocated
# once, the same bytes whatever it holds) and the short-lived tensors of each prefill and decode step.

# %%
fig_ledger, ax_ledger = plt.subplots(figsize=(10, 5.2), dpi=110, layout="constrained")
plot.plot_timeline(result.ledgers["paged"].timeline(), ax=ax_ledger, max_points=400,
                   title=f"Lab 14 · paged cache serving {len(result.requests)} requests (measured by the ledger)")

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
# measured on the toy model's pools by the ledger. The quantized caches store one float32 scale per token
# and KV head; their attention outputs and logits are compared with an fp32 cache over a 48-token prompt
# and 32 decode steps (teacher-forced with the fp32 run's tokens).

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
# The serving budget the way vLLM sizes it: of the GPU's memory, the `--gpu-memory-utilization`
# fraction (0.9), less the weights and the peak of one prefill (both **traced on fake tensors**: the
# zoo's models at their published sizes in bf16, through this lab's own serving forward; nothing is
# allocated), less Lab 13's CUDA context allowance for the memory outside PyTorch (**cited**: its source
# is `fit_gpus.CUDA_CONTEXT_SOURCE`), is the KV pool. Bytes per token come from each configuration. Tensor
# parallelism is traced as the per-GPU model: heads, KV heads, MLP width and vocabulary divided by the TP
# degree. Each row's prefill is its whole context (8,192 tokens; 32,768 for Llama-3.1-8B, whose shapes are
# Llama-3-8B's), at once or in 2,048-token chunks: each pool is sized for the prefill it must run.

# %%
cases = [("llama-3-8b", 1, "bf16", 8192, None), ("llama-3-8b", 1, "fp8", 8192, None),
         ("llama-3-8b", 1, "int8", 8192, None),
         ("llama-3.1-8b", 1, "bf16", 32768, None), ("llama-3.1-8b", 1, "bf16", 32768, 2048),
         ("llama-3-70b", 1, "bf16", 8192, None), ("llama-3-70b", 2, "bf16", 8192, None),
         ("llama-3-70b", 4, "bf16", 8192, None), ("llama-3-70b", 8, "bf16", 8192, None),
         ("llama-3-70b", 4, "fp8", 8192, None)]
real_scale, plans = measure.budgets(cases)
prefill = measure.prefill_peaks()
display(real_scale, prefill)

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
decode = [speed.decode(h100, spec_8b, context, batch) for batch in (1, plans[0].sequences(context))]
decode_table = speed.decode_table(decode)
display(sizes, speeds, decode_table)

# %%
budget_8b, long_whole, long_chunked = plans[0], plans[3], plans[4]
budget_70b = {plan.tp: plan for plan in plans if plan.model == "llama-3-70b" and plan.kv_dtype == "bf16"}
prefill_numbers = dict(zip(("zoo_8k", "whole_8k", "chunked_8k", "zoo_32k", "whole_32k", "chunked_32k", "decode_256"),
                           (row[2] for row in prefill.rows)))
real_metrics = {name: served.metrics() for name, served in at_8b.served.items()}
kv_rows = {row[0]: row for row in kv_dtypes.rows}
notebook.publish(
    nb, tables={"caches": caches, "cost": cost, "block_sizes": blocks, "prefix": prefix, "layouts": layouts,
                "kv_dtypes": kv_dtypes, "real_scale": real_scale, "prefill": prefill, "real_serving": real_serving,
                "gpu_sizes": sizes, "gpu_speeds": speeds, "decode_bound": decode_table},
    figures={"records": fig_records, "ledger": fig_ledger},
    summary=result.summary(),
    pool_tokens=result.pool_tokens, pool_bytes=result.pool_bytes, identical_tokens=result.identical_tokens(),
    block16_waste=blocks.rows[4][1], block1_tables=blocks.rows[0][5], block16_tables=blocks.rows[4][5],
    prefix_saving=prefix.rows[1][1], prefix_concurrent={"copied": prefix.rows[0][2], "shared": prefix.rows[1][2]},
    int8_error=kv_rows["int8"][2], fp8_error=kv_rows["fp8"][2], bf16_error=kv_rows["bf16"][2],
    real={"kv_bytes_per_token_8b": budget_8b.kv_bytes_per_token, "weights_8b": budget_8b.weights_bytes,
          "prefill_8b": budget_8b.prefill_peak_bytes, "pool_8b": budget_8b.kv_pool_bytes,
          "tokens_8b": budget_8b.max_tokens_in_flight, "seqs_8k_8b": budget_8b.sequences(8192),
          "seqs_2k_8b": budget_8b.sequences(2048),
          "long": {"pool_whole": long_whole.kv_pool_bytes, "pool_chunked": long_chunked.kv_pool_bytes,
                   "seqs_whole": long_whole.sequences(32768), "seqs_chunked": long_chunked.sequences(32768)},
          "non_torch": budget_8b.non_torch_bytes, "kv_int8_8b": plans[2].kv_bytes_per_token,
          "kv_half_8b": budget_8b.kv_bytes_per_token // 2, "kv_8k_request_8b": 8192 * budget_8b.kv_bytes_per_token,
          "kv_mha_8b": layouts.rows[0][2], "kv_mqa_8b": layouts.rows[2][2],
          "tokens_8b_fp8": plans[1].max_tokens_in_flight, "seqs_8k_8b_fp8": plans[1].sequences(8192),
          "weights_70b_tp1": budget_70b[1].weights_bytes, "usable": budget_8b.usable_bytes,
          "pool_70b": {tp: p.kv_pool_bytes for tp, p in budget_70b.items()},
          "seqs_8k_70b": {tp: p.sequences(8192) for tp, p in budget_70b.items() if p.kv_pool_bytes > 0},
          "prefill": prefill_numbers,
          "concurrent": {name: m["max_concurrent"] for name, m in real_metrics.items()},
          "tokens_per_step": {name: m["tokens_per_step"] for name, m in real_metrics.items()},
          "static_waste": real_metrics["static"]["waste_fraction"]},
    speed={"ridge_h100": h100.ridge, "bandwidth_h100_tb": h100.bandwidth.value / 1e12,
           "bf16_h100_tflops": h100.bf16_dense.value / 1e12,
           "matmul": {"flops": matmul_flops, "bytes": matmul_bytes, "intensity": matmul_flops / matmul_bytes},
           "decode_8b": decode[0], "decode_8b_pool": decode[1],  # and in GB, as bandwidths are quoted:
           "gb": {name: {key: d[key] / 1e9 for key in ("bytes", "weight_bytes", "kv_bytes")}
                  for name, d in (("decode_8b", decode[0]), ("decode_8b_pool", decode[1]))},
           "rounded": {name: float(f"{d['tokens_per_s']:.2g}")
                       for name, d in (("decode_8b", decode[0]), ("decode_8b_pool", decode[1]))}})
