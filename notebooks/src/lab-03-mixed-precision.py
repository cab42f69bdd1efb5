# %% [markdown]
# # Lab 03 · Mixed precision, measured
#
# This notebook runs the Lab 03 starter, `code/lab-03-mixed-precision/mixed_precision.py`: the same
# toy GPT trained in three recipes (fp32, fp16 autocast with `torch.amp.GradScaler`, bf16 autocast),
# with the memory ledger watching every tensor. It is executed by `scripts/run_notebooks.py`, never
# edited by hand; the table below says where and on which code. On a CPU the byte counts and the
# scaler's behaviour are exact; speed needs a GPU run.
#
# What to look for:
#
# 1. The three loss curves lie on top of each other (within the lab's stated tolerance).
# 2. Parameters, gradients and AdamW state are the same bytes in every recipe: fp32 master weights.
# 3. Activations shrink, but not to half: what autocast runs in 16 bits halves exactly, the rest stays
#    fp32, and autocast adds 16-bit copies of the weights.
# 4. An inf in a gradient makes GradScaler skip the step and halve its scale; the weights do not move.

# %%
import math
from dataclasses import replace

import matplotlib.pyplot as plt
from IPython.display import display

from labkit import labs, notebook, plot
from labkit.table import pick_unit

nb = notebook.setup(3)
lab = nb.lab
harness = labs.load(3, "precision_report")  # the lab's formulas and tables, next to its starter
# the lab's default model on a CPU; GPU-sized on a GPU (the same code either way)
size = dict(width=1024, layers=8, heads=16, seq_len=512, batch_size=16) if nb.on_gpu else {}
config = lab.Config(device=nb.device.type, steps=50 if nb.on_gpu else 20, **size)
COLORS = {"fp32": plot.SERIES[0], "fp16": plot.SERIES[1], "bf16": plot.SERIES[2]}

# %% [markdown]
# ## Three recipes, one model, the same batches
#
# `lab.run` is what the command line calls with `--recipe all`. Each recipe starts from the same
# seed, so the three models begin identical and see the same batches. The ledger records the first
# two steps; the later steps run without it and are timed.

# %%
result = lab.run(replace(config, snapshot=nb.results / "memory_snapshot.pickle" if nb.on_gpu else None))
runs = result.runs
print(f"{runs['fp32'].params:,} parameters; {config.steps} steps per recipe; final losses "
      + ", ".join(f"{n} {r.losses[-1]:.4f}" for n, r in runs.items()))

# %% [markdown]
# ## Loss curves
#
# The lab's tolerance (`LOSS_RTOL`) is that every step's loss stays within 2 % of the fp32 loss at the
# same step. The lower panel shows how far each 16-bit recipe actually is
# (`harness.loss_differences`).

# %%
FLOOR = 1e-4  # percent
fig_loss, (ax_loss, ax_diff) = plt.subplots(2, 1, figsize=(7, 7), dpi=110, layout="constrained")  # stacked: phones
for name, r in runs.items():
    ax_loss.plot(range(len(r.losses)), r.losses, label=name, color=COLORS[name], lw=1.6,
                 ls={"fp32": "-", "fp16": "--", "bf16": ":"}[name])
    if name != "fp32":  # drawn on a log axis; a step where the losses are equal sits on the floor
        rel = [max(100 * d, FLOOR) for d in harness.loss_differences(r.losses, runs["fp32"].losses)]
        ax_diff.plot(range(len(rel)), rel, label=name, color=COLORS[name], marker="o", ms=3)
ax_diff.axhline(100 * lab.LOSS_RTOL, color=plot.SERIES[3], ls="--", lw=1, label="tolerance (2 %)")
ax_loss.set(title="training loss (measured)", xlabel="step", ylabel="loss")
ax_diff.set(title="|loss - fp32 loss| / fp32 loss (measured)", xlabel="step", ylabel="% (log scale)",
            yscale="log", ylim=(FLOOR, 10))
for ax in (ax_loss, ax_diff):
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
notebook.show(fig_loss, alt="Training loss of the fp32, fp16 and bf16 recipes over the same steps, and each "
                            "one's relative difference from fp32 against the 2 % tolerance")

# %% [markdown]
# ## What each recipe keeps in memory
#
# Bytes from the ledger. Parameters, gradients and AdamW state are read in the optimizer phase;
# activations are the most the ledger held at once (the end of forward). The step time is the median
# of the steps run without the ledger; on a CPU it is **CPU timing** (one thread), not a statement about
# GPUs: a CPU has no tensor cores, and fp16 matmuls on most CPUs go through conversions.

# %%
recipes = harness.recipes_table(result)
display(recipes)

# %% [markdown]
# ## The ledger timelines, side by side
#
# Two steps of each recipe on the same scale. The blue band (parameters) and the purple band (AdamW
# state, from step 0's optimizer phase on) are identical in all three: autocast never touches the
# fp32 master weights. The green mountain (activations) is lower in fp16 and bf16.

# %%
fig_timelines, axes = plt.subplots(3, 1, figsize=(10, 10.5), dpi=110, layout="constrained")
top = max(max(r.ledger.timeline().device_total()) for r in runs.values())
for i, (ax, (name, r)) in enumerate(zip(axes, runs.items())):
    plot.plot_timeline(r.ledger.timeline(), ax=ax, max_points=300, ymax_bytes=top, legend=i == 0,
                       title=f"{name}: 2 training steps on {nb.device.type} (ledger, measured)")
notebook.show(fig_timelines, alt="Stacked memory timelines of two training steps for fp32, fp16 and bf16 on one "
                                 "scale, by category, with phase bands")

# %% [markdown]
# ## Where the bytes go, by category and by saved tensor
#
# Top: each recipe's bytes by ledger category at its highest moment. Bottom: what autograd saved
# for backward in one forward pass, by kind, found with `torch.autograd.graph.saved_tensors_hooks`
# (`saved_for_backward` in the starter). A tensor whose autograd history is a dtype cast of a
# parameter is a **16-bit weight copy**: autocast makes one per matmul weight in every forward, and
# the matmul keeps it for backward.

# %%
cats = ["parameters", "optimizer_state", "activations", "temporaries"]  # no gradient is alive at the peak
kind_colors = {"float32": plot.SERIES[0], "float16": plot.SERIES[1], "bfloat16": plot.SERIES[2],
               "16-bit weight copies": plot.SERIES[3], "int64": plot.SERIES[7]}
peaks = {n: r.ledger.timeline().peak() for n, r in runs.items()}
unit, scale = pick_unit(max(p[c] for p in peaks.values() for c in cats))
fig_bytes, (ax_cat, ax_saved) = plt.subplots(2, 1, figsize=(7, 7.5), dpi=110, layout="constrained")  # stacked: phones
for i, name in enumerate(runs):
    ax_cat.bar([j + (i - 1) * 0.26 for j in range(len(cats))], [peaks[name][c] / scale for c in cats], 0.26,
               label=name, color=COLORS[name])
ax_cat.set_xticks(range(len(cats)), [c.replace("_", " ") for c in cats], fontsize=8)
ax_cat.set(title="bytes by category at each recipe's peak (measured)", ylabel=unit)
ax_cat.legend(fontsize=8)
s_unit, s_scale = pick_unit(max(sum(r.saved.values()) for r in runs.values()))
for i, r in enumerate(runs.values()):
    bottom = 0.0
    for kind, color in kind_colors.items():
        if value := r.saved.get(kind, 0) / s_scale:
            shown = ax_saved.get_legend_handles_labels()[1]
            ax_saved.bar(i, value, 0.6, bottom=bottom, color=color, label=None if kind in shown else kind)
            bottom += value
ax_saved.set_xticks(range(len(runs)), list(runs))
ax_saved.set(title="saved for backward in one forward, by kind (measured)", ylabel=s_unit)
ax_saved.legend(fontsize=8, loc="upper right")
for ax in (ax_cat, ax_saved):
    ax.grid(axis="y", alpha=0.3)
notebook.show(fig_bytes, alt="Bars of bytes by ledger category at each recipe's peak, and stacked bars of the "
                             "bytes saved for backward by dtype")

# %%
saved = harness.saved_table(result)
display(saved)

# %% [markdown]
# ## Formula against measurement
#
# Each row is an identity the ledger and the saved-tensor census must satisfy. On a CPU they hold to
# the byte (`tests/test_lab03.py` asserts it); on a GPU the ledger rounds to the allocator's 512-byte
# blocks, so only the first rows are exact there.

# %%
checks = harness.checks(result)
display(checks)

# %% [markdown]
# ## Where the 16-bit weight casts live in the ledger
#
# The ledger files every storage under one category. A weight copy is born in forward (by the
# `_to_copy` op that autocast inserts) and is still alive when forward ends, because the matmul saved
# it, so the ledger calls it an **activation**. Below: the activations of step 0 by the op that made
# them (`harness.activations_by_op`). In the 16-bit recipes `_to_copy` holds the weight copies and the
# 16-bit copies of the layer-norm outputs that feed the matmuls; in fp32 there is no `_to_copy` at all.

# %%
ops = harness.ops_table(result)
display(ops)

# %% [markdown]
# ## The scaler's state
#
# `GradScaler.state_dict()` is what a checkpoint must save next to the optimizer. Inside, the state is
# two one-element tensors on the training device: the scale (float32) and the growth tracker (int32),
# the count of clean steps since the scale last changed. Only the fp16 recipe has an enabled scaler.

# %%
scaler = harness.scaler_table(runs["fp16"])
display(scaler)

# %% [markdown]
# ## An injected inf: a skipped step and the scale backing off
#
# `--inject-inf-at 4` writes an inf into one gradient of the fp16 run after backward, the way an fp16
# overflow would. `scaler.step` finds it while unscaling, does not call `optimizer.step()`, and
# `scaler.update()` multiplies the scale by `backoff_factor` (0.5) and resets the growth tracker.
# The lab compares every parameter before and after that step. The last column is the fp16 run of the
# first section at the same step: the same seed and batches, without the inf.

# %%
injected = lab.run(replace(config, recipe="fp16", steps=8, inject_inf_at=4)).runs["fp16"]
inject = harness.inject_table(injected, without=runs["fp16"].losses)
display(inject)

# %% [markdown]
# ## Real overflows: how the scale finds its level
#
# No injection here. The run starts from a scale of 2^24, far too large: the scaled fp16 gradients
# overflow for real, so the first steps are skipped and the scale halves each time until it fits.
# With `--growth-interval 4` the scaler then tries a doubling after every 4 clean steps, overflows
# again, and backs off: the sawtooth is the scaler probing for the largest scale that fits.

# %%
dynamics = lab.run(replace(config, recipe="fp16", steps=24, init_scale=2.0**24, growth_interval=4)).runs["fp16"]
fig_scale, ax = plt.subplots(figsize=(10, 3.4), dpi=110, layout="constrained")
ax.step([s["step"] for s in dynamics.steps], [math.log2(s["scale_before"]) for s in dynamics.steps], where="post",
        color=COLORS["fp16"], label="log2(scale) used at the step")
skips = [s for s in dynamics.steps if s["skipped"]]
ax.scatter([s["step"] for s in skips], [math.log2(s["scale_before"]) for s in skips], color=plot.SERIES[3], zorder=3,
           label="overflow: step skipped, scale × 0.5")
ax.set(title="GradScaler's scale under real fp16 overflows (measured)", xlabel="step", ylabel="log2(scale)")
ax.legend(fontsize=8)
ax.grid(alpha=0.3)
notebook.show(fig_scale, alt="The loss scale, log2, over 24 fp16 steps started at 2^24, with each overflow "
                             "marked: a staircase down, then a sawtooth")

# %% [markdown]
# ## Allocated against reserved, and speed (CUDA only)
#
# On a GPU the ledger also samples `torch.cuda.memory_allocated` and `memory_reserved`, and the run
# exports a `_record_memory_history` snapshot for <https://pytorch.org/memory_viz>. The step-speed
# ratio is the GPU run's figure: the handbook's target is a bf16 step at least 1.8× faster than fp32
# on an H100-class GPU. On a CPU there is no caching allocator, and the speed ratio is CPU timing.

# %%
allocator = harness.allocator_table(result)
display(allocator)

# %% [markdown]
# ## At real scale: Llama-3-8B in fp32, bf16 autocast and pure bf16, traced on fake tensors
#
# The same `lab.run`, with `--model llama-3-8b --fake`: the zoo's Llama 3 8B, one sequence of 4,096
# tokens, two steps per recipe, AdamW `foreach` (CUDA's default), on **fake tensors**: every op
# computes shapes and storages, nothing is allocated, and the ledger rounds every storage to the
# CUDA allocator's 512-byte blocks. Three recipes: fp32; bf16 autocast over fp32 master weights (the
# lab's `bf16`); and `pure-bf16`, whose weights, gradients and AdamW moments are themselves bf16. The
# model's loss upcasts the logits to fp32 (as Hugging Face and torchtitan do), so every recipe keeps
# fp32 log-probabilities for backward. These figures are **traced**, not measured: no CUDA context,
# cuBLAS workspaces or fragmentation, and the ops take their CPU path (`labkit/fake.py` says where
# that differs from CUDA; `fake.autocast_audit` finds no op of this model whose autocast dtype CUDA
# would change). No losses: a fake tensor has no value.

# %%
scale = lab.Config(model="llama-3-8b", fake=True, seq_len=4096, batch_size=1, steps=2)
traced = {}
for name in ("fp32", "bf16", "pure-bf16"):
    traced |= lab.run(replace(scale, recipe=name)).runs
CARD = 80 * 2**30  # an 80 GB H100 holds at most 80 GiB (PyTorch sees a little less)
real_scale = harness.real_scale_table(traced)
real_scale_peaks = harness.real_scale_peaks_table(traced, CARD)
display(real_scale, real_scale_peaks)

# %%
notebook.publish(
    nb, tables={"recipes": recipes, "saved": saved, "checks": checks, "ops": ops, "scaler": scaler,
                "inject": inject, "allocator": allocator, "real_scale": real_scale,
                "real_scale_peaks": real_scale_peaks},
    figures={"loss_curves": fig_loss, "timelines": fig_timelines, "bytes": fig_bytes, "scale": fig_scale},
    summary=result.summary(), inject=injected.inject, scale_dynamics=dynamics.steps,
    scale_skipped_steps=len(skips), real_scale=harness.real_scale_numbers(traced))
