# %% [markdown]
# # Lab 04 · Activation checkpointing, measured
#
# This notebook runs the Lab 04 starter, `code/lab-04-activation-checkpointing/checkpointing.py`,
# and measures four ways of keeping activations for backward: none, full (one checkpoint per
# block), every-k (one checkpoint per segment of k blocks) and save-matmuls (an op-level policy that
# keeps matmul outputs and recomputes the rest; on a CPU with dropout that includes the T×T attention
# scores, which Korthikanti et al.'s "selective recomputation" drops instead). It is executed by
# `scripts/run_notebooks.py`, never edited by hand; the table below says where and on which code.
#
# What to look for:
#
# 1. Checkpointing lowers the activation mountain; the recomputed tensors reappear in backward.
# 2. Every strategy gives the same gradients as no checkpointing, bit for bit, with dropout on.
# 3. The segment size k trades kept boundaries (n/k of them) against the recompute window (k
#    blocks): the derived curves sit on the measured points. A chain of simple blocks is lowest at
#    the textbook k = √n; the TinyGPT, whose blocks keep far more than their input, at k = 1.
#
# **Activation memory** in this lab is the highest value, over forward and backward, of the
# ledger's `activations` + `temporaries` categories. Recomputed tensors are born in backward, so
# the ledger counts them as temporaries: they are part of the peak, as they are on a real GPU.
# We also report the bytes **kept after forward** (`activations` alive when forward ends).

# %%
import matplotlib.pyplot as plt
from IPython.display import display

from labkit import labs, notebook, plot
from labkit.table import Table, format_bytes, pick_unit

nb = notebook.setup(4)
lab = nb.lab
costs, seg = labs.load(4, "block_costs"), labs.load(4, "segments")
# small on a CPU (the command line's defaults, so `run_cpu` prints these bytes), GPU-sized on a GPU
size = dict(width=1024, layers=16, heads=16, seq_len=1024, batch_size=8, steps=10) if nb.on_gpu else dict(steps=3)
config = lab.Config(device=nb.device.type, **size)

# %% [markdown]
# ## Four strategies, one step each under the ledger
#
# `lab.run` is what the command line calls: a reference step without checkpointing, then for each
# strategy one step under the memory ledger, one plain step (gradients without the ledger), one
# step under `FlopCounterMode`, and finally `steps` timed steps, strategies interleaved.

# %%
result = lab.run(config)
R = result.results
print(f"{config.layers} blocks, every-k with k = {result.every}; one block input b = {result.block_input_bytes:,} B")

# %% [markdown]
# ## The timelines
#
# Same model, same batch, same dropout masks; only the checkpointing differs. The y-axes are shared.
# Temporaries are hatched, so the recomputed tensors stand out without relying on colour.

# %%
names = list(R)
timelines, axes = plt.subplots(len(names), 1, figsize=(10, 2.6 * len(names)), dpi=110, layout="constrained")
top = max(r["peak_bytes"] for r in R.values())
unit, unit_size = pick_unit(top)
for ax, s in zip(axes, names):
    plot.plot_timeline(result.ledgers[s].timeline(), ax=ax,
                       title=f"{s}: activation peak {format_bytes(R[s]['activation_peak_bytes'])} "
                             f"(measured, {nb.device.type})")
    ax.set_ylim(0, top / unit_size * 1.12)
    ax.set_ylabel(f"live bytes ({unit})")
    legend = ax.get_legend()
    marked = [a for a in ax.collections if a.get_label() == "temporaries"]
    if ax is axes[0]:
        marked += [h for h, t in zip(legend.legend_handles, legend.get_texts()) if t.get_text() == "temporaries"]
    for area in marked:  # white hatching (matplotlib >= 3.10 colours hatches on their own)
        area.set_hatch("///")
        if hasattr(area, "set_hatchcolor"):
            area.set_hatchcolor("white")
        else:
            area.set_edgecolor("white")
    if ax is not axes[0]:
        legend.remove()

# %% [markdown]
# ## Memory and recompute per strategy (measured)
#
# Step times are wall clock on this device. On a CPU they show the direction of the cost, not
# what a GPU would pay: the GPU targets (`GPU_TARGETS` in the starter, second table) are checked
# only by a GPU run.

# %%
strategies = lab.strategies_table(result)
gpu_targets = lab.gpu_targets_table()
display(strategies, gpu_targets)

# %%
cost, (ax_mem, ax_flop, ax_time) = plt.subplots(3, 1, figsize=(6.5, 8.5), dpi=110, layout="constrained")
colors = ["#8C8C8C", "#4C72B0", "#DD8452", "#55A868"]
ax_mem.bar(names, [R[s]["activation_peak_bytes"] / 2**20 for s in names], color=colors)
ax_mem.bar(names, [R[s]["kept_bytes"] / 2**20 for s in names], color="white", alpha=0.45, hatch="//",
           label="kept after forward")
ax_mem.set(title="activation peak (measured)", ylabel="MiB")
ax_mem.legend(fontsize=8)
ax_flop.bar(names, [100 * R[s]["recompute_flops_of_forward"] for s in names], color=colors)
ax_flop.set(title="recompute FLOPs (counted)", ylabel="% of forward FLOPs")
ax_time.bar(names, [R[s]["step_time_s"] * 1e3 for s in names], color=colors)
ax_time.set(title=f"step time ({nb.device.type} wall clock)", ylabel="ms, median")
for ax in (ax_mem, ax_flop, ax_time):
    ax.grid(axis="y", alpha=0.3)
    ax.tick_params(axis="x", labelsize=8)

# %% [markdown]
# ## Formula against measurement
#
# Each row is **derived** (formula shown, `block_costs.py`) next to the **measured** figure. With
# B = batch, T = sequence, w = width, h = heads, N = B·T tokens and b = 4·N·w bytes (one fp32
# block input):
#
# - a checkpointed segment keeps exactly its input, so full and every-k differ by
#   (n − ⌈n/k⌉)·b kept bytes;
# - the save-matmuls policy keeps every matmul output in each block: the four linear layers
#   (3w + w + 4w + w per token) and, on the CPU math attention path that dropout selects, the two
#   attention matmuls (scores B·h·T², and B·T·w); all fp32;
# - a checkpointed block recomputes its forward matmuls in backward: 2·N·12w² for the linear
#   layers plus 4·B·T²·w for attention, per block;
# - a block without checkpointing keeps 72·N·w + 12·B·h·T² + 16·N bytes: the per-layer count of
#   Korthikanti et al. (2022), 34·s·b·h + 5·a·s²·b bytes for 2-byte tensors and 1-byte dropout
#   masks, rewritten for fp32 tensors and the 4-byte masks that CPU dropout uses, plus the two
#   layer norms' fp32 mean and 1/std per token (16·N).
#
# The last three rows hold on the CPU path only, and only a CPU run shows them.

# %%
checks = costs.checks(result)
display(checks)

# %% [markdown]
# ## The segment rule: how big should a segment be?
#
# Checkpoint n blocks in segments of k. After forward, each segment has kept only its input:
# ⌈n/k⌉·b. In backward, a segment is recomputed as a whole, so for a while its k blocks hold
# everything a block saves, a bytes each. With C for what lives outside the blocks (embedding,
# head, loss) and G for what backward itself holds at that moment (the gradients in flight, less
# what the loss and head have already freed), the derivation in `segments.py` gives, for k dividing n,
#
# kept(k) = C + ⌈n/k⌉·b and peak(k) = C + G + (n/k)·b + k·a,
#
# and peak(k) is smallest where its derivative −n·b/k² + a is zero: **k\* = √(n·b/a)**. G does not
# depend on k, so it moves the curve, not its minimum. We measure two models of n = 16 blocks:
#
# - a **chain of simple blocks** (Linear, then ReLU): a block keeps one tensor, its ReLU output, the
#   size of its input, so a = b and k\* = √n, the textbook rule;
# - the **TinyGPT**: a block keeps far more than its input, so k\* is much smaller.
#
# C and a come from the `none` and k = 1 runs, G from the k = 1 run's peak; nothing is fitted to the
# other points. The lines are `segments.predict` at every whole k (short last segments included);
# the points are measured.

# %%
n, ks = 16, [1, 2, 4, 8, 16]
shape = (dict(width=1024, heads=16, seq_len=1024, batch_size=4) if nb.on_gpu
         else dict(width=32, heads=2, seq_len=32, batch_size=4, vocab=64))
chain_width, chain_batch = (1024, 1024) if nb.on_gpu else (64, 64)
gpt = lab.Config(device=nb.device.type, layers=n, **shape)
rules = {"TinyGPT": seg.compare(seg.sweep(*lab.build(gpt, nb.device), ks), n, 4 * gpt.batch_size * gpt.seq_len * gpt.width),
         "chain": seg.compare(seg.sweep(*seg.chain(n, chain_width, chain_batch, nb.device), ks), n, 4 * chain_batch * chain_width)}
segment_tables = {name: seg.table(rule, n) for name, rule in rules.items()}
findings = seg.findings(rules)
display(*segment_tables.values())

# %%
segments, axes3 = plt.subplots(2, 1, figsize=(7.5, 9), dpi=110, layout="constrained")  # stacked: phones
grid = range(1, n + 1)
for ax, (name, r) in zip(axes3, rules.items()):
    mem, a, b = r["measured"], r["per_block_bytes"], r["block_input_bytes"]
    unit, unit_size = pick_unit(max(m["activation_peak_bytes"] for m in mem.values()))
    derived = [seg.predict(n, k, a, b, r["outside_bytes"], r["backward_extra_bytes"]) for k in grid]
    ax.plot(grid, [p / unit_size for _, p in derived], color="#d62728", lw=1.4, ls="--",
            label="derived peak (segments.predict)")
    ax.plot(ks, [mem[k]["activation_peak_bytes"] / unit_size for k in ks], "o", color="#d62728", ms=7,
            label="measured activation peak")
    ax.plot(grid, [kept / unit_size for kept, _ in derived], color="#4C72B0", lw=1.2, ls=":",
            label="derived kept after forward (C + ⌈n/k⌉·b)")
    ax.plot(ks, [mem[k]["kept_bytes"] / unit_size for k in ks], "s", color="#4C72B0", ms=6,
            label="measured kept after forward")
    ax.axhline(r["none"]["activation_peak_bytes"] / unit_size, color="#8C8C8C", lw=1,
               label="none: activation peak (measured)")
    best = r["best_k_measured"]
    ax.plot([best], [mem[best]["activation_peak_bytes"] / unit_size], "o", mfc="none", mec="black", mew=1.4, ms=15,
            label="lowest measured peak")
    if r["k_star"] >= 1:
        ax.axvline(r["k_star"], color="black", lw=1, ls=":", label="derived k* = √(n·b/a)")
    ax.set(xscale="log", xlabel="k: blocks per checkpointed segment", ylabel=unit,
           title=f"{n}-block {'chain of Linear + ReLU' if name == 'chain' else name}: a = {a / b:.2f}·b, "
                 f"so k* = √(n·b/a) = {r['k_star']:.2f} ({nb.device.type})")
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_ylim(0, max(m["activation_peak_bytes"] for m in mem.values()) / unit_size * 1.08)
    ax.grid(alpha=0.3)
legend = segments.legend(*axes3[1].get_legend_handles_labels(), loc="outside lower center", ncols=2, fontsize=8)

# %% [markdown]
# ## Allocated against the ledger (CUDA only)
#
# On a GPU, `lab.run` also records `max_memory_allocated` for each strategy's ledger step; the
# ledger's peak should be within a few percent of it. On a CPU there is no caching allocator to
# compare with, and the table says so with dashes.

# %%
display(Table(["strategy", ("ledger peak", "bytes"), ("max_memory_allocated", "bytes"), ("ratio", "float:3")],
              [[s, r["peak_bytes"], (r["cuda"] or {}).get("max_memory_allocated"),
                (r["cuda"] or {}).get("ledger_over_allocator")] for s, r in R.items()]))

# %%
notebook.publish(
    nb, tables={"strategies": strategies, "gpu_targets": gpu_targets, "checks": checks,
                "segments": segment_tables["TinyGPT"], "segments_chain": segment_tables["chain"]},
    figures={"timelines": timelines, "cost": cost, "segments": segments},
    summary=result.summary(), segments={"n": n, "tolerance": seg.TOLERANCE, **rules}, segment_findings=findings)
