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
# 3. The segment size k trades kept boundaries (L/k of them) against the recompute window (k
#    blocks): the derived curves sit on the measured points. A chain of simple blocks is lowest at
#    the textbook k = √L; the TinyGPT, whose blocks keep far more than their input, at k = 1.
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
print(f"{config.layers} blocks, every-k with k = {result.every}; one block input I_blk = {result.block_input_bytes:,} B")

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
            area.set_hatchcolor(plot.PAPER)
        else:
            area.set_edgecolor(plot.PAPER)
    if ax is not axes[0]:
        legend.remove()
notebook.show(timelines, alt="Stacked memory timelines of one training step for each checkpointing strategy on "
                             "one scale, by category, with forward and backward bands")

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
colors = [plot.SERIES[7], plot.SERIES[0], plot.SERIES[1], plot.SERIES[2]]
ax_mem.bar(names, [R[s]["activation_peak_bytes"] / 2**20 for s in names], color=colors)
ax_mem.bar(names, [R[s]["kept_bytes"] / 2**20 for s in names], color=plot.PAPER, alpha=0.45, hatch="//",
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
notebook.show(cost, alt="Three bar charts, one bar per strategy: activation peak with the bytes kept after "
                        "forward hatched, recompute FLOPs as a share of the forward, and step time")

# %% [markdown]
# ## Formula against measurement
#
# Each row is **derived** (formula shown, `block_costs.py`) next to the **measured** figure. In the
# handbook's notation, b = batch, s = sequence, h = width, a = heads, L = blocks, and
# I_blk = 4·s·b·h bytes (one fp32 block input):
#
# - a checkpointed segment keeps exactly its input, so full and every-k differ by
#   (L − ⌈L/k⌉)·I_blk kept bytes;
# - the save-matmuls policy keeps every matmul output in each block: the four linear layers
#   (3h + h + 4h + h per token) and, on the CPU math attention path that dropout selects, the two
#   attention matmuls (scores a·s²·b, and s·b·h); all fp32;
# - a checkpointed block recomputes its forward matmuls in backward: 2·s·b·12h² for the linear
#   layers plus 4·s²·b·h for attention, per block;
# - a block without checkpointing keeps K_blk = 72·s·b·h + 12·a·s²·b + 16·s·b bytes: the per-layer
#   count of Korthikanti et al. (2022), 34·s·b·h + 5·a·s²·b bytes for 2-byte tensors and 1-byte
#   dropout masks, rewritten for fp32 tensors and the 4-byte masks that CPU dropout uses, plus the
#   two layer norms' fp32 mean and 1/std per token (16·s·b).
#
# The last three rows hold on the CPU path only, and only a CPU run shows them.

# %%
checks = costs.checks(result)
display(checks)

# %% [markdown]
# ## The segment rule: how big should a segment be?
#
# Checkpoint L blocks in segments of k. After forward, each segment has kept only its input:
# ⌈L/k⌉·I_blk. In backward, a segment is recomputed as a whole, so for a while its k blocks hold
# everything a block saves, K_blk bytes each. With C for what lives outside the blocks (embedding,
# head, loss) and G for what backward itself holds at that moment (the gradients in flight, less
# what the loss and head have already freed), the derivation in `segments.py` gives, for k dividing L,
#
# kept(k) = C + ⌈L/k⌉·I_blk and peak(k) = C + G + (L/k)·I_blk + k·K_blk,
#
# and peak(k) is smallest where its derivative −L·I_blk/k² + K_blk is zero: **k\* = √(L·I_blk/K_blk)**.
# G does not depend on k, so it moves the curve, not its minimum. We measure two models of L = 16 blocks:
#
# - a **chain of simple blocks** (Linear, then ReLU): a block keeps one tensor, its ReLU output, the
#   size of its input, so K_blk = I_blk and k\* = √L, the textbook rule;
# - the **TinyGPT**: a block keeps far more than its input, so k\* is much smaller.
#
# C and K_blk come from the `none` and k = 1 runs, G from the k = 1 run's peak; nothing is fitted to the
# other points. The lines are `segments.predict` at every whole k (short last segments included);
# the points are measured.

# %%
L, ks = 16, [1, 2, 4, 8, 16]
shape = (dict(width=1024, heads=16, seq_len=1024, batch_size=4) if nb.on_gpu
         else dict(width=32, heads=2, seq_len=32, batch_size=4, vocab=64))
chain_width, chain_batch = (1024, 1024) if nb.on_gpu else (64, 64)
gpt = lab.Config(device=nb.device.type, layers=L, **shape)
rules = {"TinyGPT": seg.compare(seg.sweep(*lab.build(gpt, nb.device), ks), L, 4 * gpt.batch_size * gpt.seq_len * gpt.width),
         "chain": seg.compare(seg.sweep(*seg.chain(L, chain_width, chain_batch, nb.device), ks), L, 4 * chain_batch * chain_width)}
segment_tables = {name: seg.table(rule, L) for name, rule in rules.items()}
findings = seg.findings(rules)
display(*segment_tables.values())

# %%
segments, axes3 = plt.subplots(2, 1, figsize=(7.5, 9), dpi=110, layout="constrained")  # stacked: phones
grid = range(1, L + 1)
for ax, (name, r) in zip(axes3, rules.items()):
    mem, K_blk, I_blk = r["measured"], r["per_block_bytes"], r["block_input_bytes"]
    unit, unit_size = pick_unit(max(m["activation_peak_bytes"] for m in mem.values()))
    derived = [seg.predict(L, k, K_blk, I_blk, r["outside_bytes"], r["backward_extra_bytes"]) for k in grid]
    ax.plot(grid, [p / unit_size for _, p in derived], color=plot.SERIES[3], lw=1.4, ls="--",
            label="derived peak (segments.predict)")
    ax.plot(ks, [mem[k]["activation_peak_bytes"] / unit_size for k in ks], "o", color=plot.SERIES[3], ms=7,
            label="measured activation peak")
    ax.plot(grid, [kept / unit_size for kept, _ in derived], color=plot.SERIES[0], lw=1.2, ls=":",
            label="derived kept after forward (C + ⌈L/k⌉·I_blk)")
    ax.plot(ks, [mem[k]["kept_bytes"] / unit_size for k in ks], "s", color=plot.SERIES[0], ms=6,
            label="measured kept after forward")
    ax.axhline(r["none"]["activation_peak_bytes"] / unit_size, color=plot.SERIES[7], lw=1,
               label="none: activation peak (measured)")
    best = r["best_k_measured"]
    ax.plot([best], [mem[best]["activation_peak_bytes"] / unit_size], "o", mfc="none", mec=plot.INK, mew=1.4, ms=15,
            label="lowest measured peak")
    if r["k_star"] >= 1:
        ax.axvline(r["k_star"], color=plot.INK, lw=1, ls=":", label="derived k* = √(L·I_blk/K_blk)")
    ax.set(xscale="log", xlabel="k: blocks per checkpointed segment", ylabel=unit,
           title=f"{L}-block {'chain of Linear + ReLU' if name == 'chain' else name}: K_blk = {K_blk / I_blk:.2f}·I_blk, "
                 f"so k* = √(L·I_blk/K_blk) = {r['k_star']:.2f} ({nb.device.type})")
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_ylim(0, max(m["activation_peak_bytes"] for m in mem.values()) / unit_size * 1.08)
    ax.grid(alpha=0.3)
legend = segments.legend(*axes3[1].get_legend_handles_labels(), loc="outside lower center", ncols=2, fontsize=8)
notebook.show(segments, alt="Two panels: measured activation peak and kept bytes against segment size k, with "
                            "derived curves, for a 16-block TinyGPT and a 16-block chain of Linear and ReLU "
                            "blocks")

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

# %% [markdown]
# ## At real scale: Llama 3 8B and 70B, traced on fake tensors
#
# The same `lab.run`, with `model=` a zoo architecture and `fake=True`: the lab's own four
# strategies, through the same `run_blocks` seam, on Llama-3-8B (32 blocks) at 8,192 and 32,768
# tokens and Llama-3-70B (80 blocks) at 8,192, batch 1, **pure bf16** weights and activations (no
# autocast; the loss upcasts the logits to fp32, as Hugging Face and torchtitan do). Every figure in
# this section is **traced on fake tensors** (`labkit.fake`): the ledger counts every storage the
# step would hold, rounded to the CUDA caching allocator's 512-byte blocks, and `FlopCounterMode`
# counts FLOPs from shapes; nothing is allocated, no value is computed, no time is measured.
# The trace follows PyTorch's CPU dispatch (CPU flash attention, which saves what CUDA's flash
# kernel saves) and has no CUDA context, cuBLAS workspace, NCCL buffer or fragmentation. Llama 3's
# published context is 8,192 tokens; at 32,768 read it as Llama 3.1, whose blocks are the same.
# The step peak is parameters + gradients + activations: this lab runs no optimizer.

# %%
at_scale = labs.load(4, "at_scale")
traced = {(m, t): at_scale.trace(m, t) for m, t in at_scale.CONFIGS}
real_scale = at_scale.table(traced)
display(real_scale)

# %% [markdown]
# ## The segment rule at 80 blocks
#
# Every-k above uses the textbook k = round(√80) = 9. At Llama-3-70B, 8,192 tokens, we trace
# k = 2, 3 and 4 as well (k = 1 and k = 9 come from the run above). A second peak appears that the
# toy models did not have: as backward starts, the loss and the head hold S bytes (the fp32 logits
# of a 128,256-token vocabulary and their gradient) on top of every kept block input. The rule
# becomes peak(k) = max(C + G + (L/k)·I_blk + k·K_blk, C + ⌈L/k⌉·I_blk + S): `segments.predict_with_head`,
# its constants from three runs (none and k = 1 give C, K_blk and S; k = 9, where the recompute window
# is the higher, gives G). k = 2, 3 and 4 are predictions, not fits.

# %%
rule70 = at_scale.segment_rule(traced["llama-3-70b", 8192], ks=(1, 2, 3, 4, 9))
L70, k70 = traced["llama-3-70b", 8192].config.depth, traced["llama-3-70b", 8192].every
real_scale_segments = seg.table(rule70, L70, kind="bytes", evidence="traced")
display(real_scale_segments)

# %%
real_segments, ax = plt.subplots(figsize=(7.5, 4.6), dpi=110, layout="constrained")
K70, I70, C70, G70, S70 = (rule70[k] for k in ("per_block_bytes", "block_input_bytes", "outside_bytes",
                                               "backward_extra_bytes", "head_spike_bytes"))
grid70 = range(1, 17)
window, head = zip(*(seg.two_peaks(L70, k, K70, I70, C70, G70, S70) for k in grid70))
window, head = [w / 2**30 for w in window], [h / 2**30 for h in head]
ax.plot(grid70, window, color=plot.SERIES[0], lw=1.2, ls=":", label="derived: recompute window, C + G + (L/k)·I_blk + k·K_blk")
ax.plot(grid70, head, color=plot.SERIES[1], lw=1.2, ls=":", label="derived: head's peak, C + ⌈L/k⌉·I_blk + S")
ax.plot(grid70, [max(w, h) for w, h in zip(window, head)], color=plot.SERIES[3], lw=1.6, ls="--",
        label="derived peak: the higher of the two")
traced_ks = list(rule70["measured"])
ax.plot(traced_ks, [rule70["measured"][k]["activation_peak_bytes"] / 2**30 for k in traced_ks], "o", color=plot.SERIES[3],
        ms=7, label="traced activation peak")
ax.axvline(k70, color=plot.INK, lw=1, ls="-.", label="textbook k = round(√L)")
ax.set(xscale="log", xlabel="k: blocks per checkpointed segment", ylabel="GiB", ylim=(0, 40),
       title="Llama-3-70B, 80 blocks, 8,192 tokens, bf16 (traced on fake tensors)")
ax.set_xticks([1, 2, 3, 4, 9, 16], ["1", "2", "3", "4", "9", "16"])
ax.grid(alpha=0.3)
ax.legend(fontsize=7.5, loc="upper left")
notebook.show(real_segments, alt="Activation peak against segment size k for Llama-3-70B at 8,192 tokens: traced"
                                 " points on the derived curve, the higher of a recompute-window curve and a "
                                 "head's-peak curve")

# %%
notebook.publish(
    nb, tables={"strategies": strategies, "gpu_targets": gpu_targets, "checks": checks,
                "segments": segment_tables["TinyGPT"], "segments_chain": segment_tables["chain"],
                "real_scale": real_scale, "real_scale_segments": real_scale_segments},
    figures={"timelines": timelines, "cost": cost, "segments": segments, "real_scale_segments": real_segments},
    summary=result.summary(), segments={"blocks": L, "tolerance": seg.TOLERANCE, **rules}, segment_findings=findings,
    real_scale=at_scale.numbers(traced), real_scale_rule=rule70 | {
        "blocks": L70, "textbook_k": k70, "kept_over_input": rule70["per_block_bytes"] / rule70["block_input_bytes"],
        "textbook_k_peak_bytes": rule70["measured"][k70]["activation_peak_bytes"],
        "best_k_peak_bytes": rule70["measured"][rule70["best_k_measured"]]["activation_peak_bytes"]})
