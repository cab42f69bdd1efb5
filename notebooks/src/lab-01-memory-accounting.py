# %% [markdown]
# # Lab 01 · Memory accounting, derived and measured
#
# This notebook uses the Lab 01 starter, `code/lab-01-memory-accounting/memory_accounting.py`, in two
# ways. First as a calculator: the formulas for model state, ZeRO shards, activations and the KV cache,
# applied to a 7B-parameter model (`accounting_sweeps.py`). Those figures are **derived**, not measured.
# Then as an experiment: `--measure` runs one training step of the toy GPT under the memory ledger, and
# the measured bytes are set next to the same formulas. It is executed by `scripts/run_notebooks.py`,
# never edited by hand; the table below says where and on which code.
#
# What to look for:
#
# 1. Mixed-precision AdamW costs 16 bytes per parameter, the same as fp32 AdamW: mixed precision shrinks
#    the activations that run in 16 bits (Lab 03 measures by how much), not model-state memory.
# 2. ZeRO divides that model state by the number of ranks, one category per stage.
# 3. Activations grow with the sequence, and with stored attention scores they grow with its square.
# 4. On CPU the ledger agrees with the formulas to the byte for parameters, gradients and optimizer
#    state, and with a per-op list of what TinyGPT saves for activations.

# %%
from dataclasses import replace

import matplotlib.pyplot as plt
from IPython.display import display

from labkit import labs, notebook, plot

nb = notebook.setup(1)
lab = nb.lab
sweeps = labs.load(1, "accounting_sweeps")  # the formulas across recipes, stages, sequences, KV caches
tables = labs.load(1, "accounting_tables")  # the tables the console prints, for one run
toy = labs.load(1, "toy_gpt")  # TinyGPT's side: what it saves for backward
GB = sweeps.GB

# %% [markdown]
# ## Bytes per parameter, by recipe (derived)
#
# `model_state_bytes(P, precision, optimizer)` for one parameter, and for a 7B model. The recipes are
# the `RECIPES` table in the starter: fp32; **mixed** (16-bit working weights and gradients, fp32
# master weights and fp32 optimizer moments, as in the ZeRO paper's accounting); pure **bf16** (every
# tensor in bf16, moments included).

# %%
recipes = sweeps.recipes_table()
display(recipes)

# %% [markdown]
# ## ZeRO stages 0–3 for a 7B model on 8 ranks (derived)
#
# `zero_model_state(P, "mixed", "adamw", stage, dp=8)`: stage 1 shards the optimizer state (the fp32
# master weights with it), stage 2 also the gradients, stage 3 also the parameters. Every rank keeps
# its own activations, so they are not part of this picture.

# %%
stages = sweeps.zero_stages()
colors = {**plot.CATEGORY_COLORS, "master_weights": plot.SERIES[9]}
fig_zero, ax = plt.subplots(figsize=(8, 4), dpi=110, layout="constrained")
bottom = [0.0] * len(stages)
for cat in sweeps.STATE:
    values = [b[cat] / GB for b in stages.values()]
    ax.bar([f"stage {s}" for s in stages], values, bottom=bottom, color=colors[cat], label=cat.replace("_", " "))
    bottom = [b + v for b, v in zip(bottom, values)]
for s, top in enumerate(bottom):
    ax.text(s, top + 1.5, f"{top:.2f} GB", ha="center", fontsize=9)
ax.set(ylabel="model-state bytes per rank (GB, 1e9)", ylim=(0, 125),
       title="7B parameters, mixed precision AdamW, 8 data-parallel ranks (derived)")
ax.legend(fontsize=8, frameon=False)
ax.grid(axis="y", alpha=0.3)
zero_table = sweeps.zero_stage_table(stages)
per_rank = sweeps.model_state_per_rank(stages)
display(zero_table)
notebook.show(fig_zero, alt="Stacked bars of model-state bytes per rank for ZeRO stages 0 to 3 of a 7B model "
                            "with mixed-precision AdamW on 8 ranks, falling from 112 GB at stage 0 to 14 GB at "
                            "stage 3")

# %% [markdown]
# ## Activations against sequence length (derived)
#
# Korthikanti et al.'s per-layer formula for a 7B-class shape (32 layers, hidden 4096, 32 heads, one
# sequence per rank) in mixed precision: 16-bit activations, 1-byte dropout masks. Three policies:
# keep everything (`none`, the `5as/h` term grows with the square of the sequence), recompute the
# attention scores (`selective`), or keep only each layer's input and recompute the rest (`full`).

# %%
seqs = sweeps.SEQS_7B
act = sweeps.activations_by_sequence(seqs)
fig_act, ax = plt.subplots(figsize=(8, 4.2), dpi=110, layout="constrained")
for policy, style in zip(sweeps.POLICIES, ("-o", "-s", "-^")):
    ax.plot(seqs, [v / GB for v in act[policy]], style, label=f"recompute={policy}", ms=4)
ax.axhline(sweeps.model_state_of() / GB, color=plot.CATEGORY_COLORS["optimizer_state"], ls="--", lw=1.2, label="model state, mixed AdamW (16 B x P)")
ax.set(xscale="log", yscale="log", xlabel="sequence length (tokens)", ylabel="activation bytes (GB, 1e9)",
       title="Activations of a 7B-class model, batch 1, mixed precision (derived)")
ax.set_xticks(seqs, [str(s) for s in seqs])
ax.legend(fontsize=8, frameon=False)
ax.grid(alpha=0.3, which="both")
act_table = sweeps.activations_table(seqs, act)
display(act_table)
notebook.show(fig_act, alt="Activation bytes of a 7B-class model against sequence length for three recomputation"
                           " policies on log-log axes, with the model state drawn as a dashed line")

# %% [markdown]
# ## KV cache for inference (derived)
#
# `kv_cache_bytes`: a key and a value per layer, token and KV head, in bf16. Grouped-query attention
# (8 KV heads for 32 query heads) divides it by 4. Each cache is set against the bf16 weights of a 7B
# model, 2 B × 7e9. Sizes in GB (1e9 bytes), like the other 7B tables.

# %%
kv = sweeps.kv_cache_cases()
kv_table = sweeps.kv_cache_table(kv)
display(kv_table)

# %% [markdown]
# ## One step of TinyGPT under the ledger (measured)
#
# `lab.run(Config(measure=True))` is what `--measure` runs: the toy GPT of the default shape, fp32, one
# AdamW step. On CPU the ledger counts `storage.nbytes()`, so formula and measurement must agree to the
# byte for parameters, gradients and optimizer state. For activations there are two derivations: the
# paper's formula, and the list in `toy_gpt.py` of what each op of TinyGPT saves. On a GPU, AdamW keeps
# its `step` counters on the host unless `capturable` or `fused` is set (`torch/optim/adam.py`), so the
# device's optimizer state is derived as 8 B × P there, and the counters get a row of their own.

# %%
size = dict(layers=8, hidden=1024, heads=16, seq=512, batch=8, vocab=8192) if nb.on_gpu else {}
config = lab.Config(device=nb.device.type, measure=True, **size)
result = lab.run(config)
measure_table = tables.measured_table(result)
display(measure_table)

# %% [markdown]
# ### The mixed recipe, measured
#
# `--measure --precision mixed` runs the recipe the `mixed` row describes, on the same shape: a bf16
# working copy of the model (forward and backward run on it, so parameters, gradients and activations are
# 16-bit), an fp32 master copy of every parameter, and AdamW stepping the masters with fp32 moments. In the
# optimizer phase each bf16 gradient is copied to fp32 for its master (a temporary), and after the step
# each master is rounded back into the working copy. Model state should come to 2 + 2 + 4 + 8 = 16 bytes
# per parameter, plus the step counters.

# %%
mixed = lab.run(replace(config, precision="mixed"))
mixed_table = tables.model_state_table(mixed)
display(mixed_table)

# %% [markdown]
# ### Why TinyGPT keeps more than the paper's formula says (derived, term by term)
#
# The paper counts a Megatron layer in 16-bit with 1-byte masks and nothing outside the layers. The
# rows below are the differences, each computed by `gap_to_paper`; the paper's figure plus these rows
# is the measured figure.

# %%
gap = tables.gap_table(result)
display(gap)

# %% [markdown]
# ### What one layer saves, op by op
#
# `tinygpt_saved_tensors` for layer 0 of the same run, next to the paper's terms. The paper's sixteen
# `s·b·h` units are there: eight h-wide tensors and two 4h-wide ones (1 + 1 + 3 + 1 + 1 + 1 + 4 + 4);
# with dropout on, the CPU keeps noise tensors in fp32 where the paper keeps 1-byte masks, and the
# attention probabilities are materialised because PyTorch's CPU flash kernel does not do dropout.

# %%
saved = toy.saved_table(result.measurement.model_config, result.shape.batch, elem=4)
display(saved)

# %% [markdown]
# ## The step on the ledger's timeline (measured)
#
# The two dashed lines are derived (`derived_levels`): parameters plus TinyGPT's saved tensors (the
# stack must touch it at the end of forward), and the model state after the step (parameters +
# gradients + AdamW state).

# %%
tl = result.measurement.ledger.timeline()
fig_timeline = plot.plot_timeline(
    tl, title=f"Lab 01 · one AdamW step of TinyGPT on {nb.device.type} (measured by the ledger)",
    overlay={label: [level] * len(tl) for label, level in tables.derived_levels(result).items()})
notebook.show(fig_timeline, alt="Stacked memory timeline of one AdamW step of TinyGPT by category, with phase "
                                "bands and two dashed derived levels")

# %% [markdown]
# ## Measured activations against sequence length (TinyGPT)
#
# The same measurement at several sequence lengths, with and without dropout. With dropout, PyTorch's
# CPU attention falls back to the math path and keeps the N×N probabilities: the curve bends up with
# the square of the sequence. Without dropout, the flash kernel keeps one number per row and the curve
# stays linear. The paper's formula is drawn for the matching policy (`paper_policy`): scores kept
# (`none`) with dropout, scores not kept (`selective`) without. Points are measured; lines are derived.

# %%
small = lab.Config(device=nb.device.type, measure=True, layers=2, hidden=64, heads=4, batch=2, vocab=64)
sweep_seqs = [256, 512, 1024, 2048] if nb.on_gpu else [64, 128, 256, 512]
curves = {dropout: [sweeps.sweep_point(lab.run(replace(small, seq=s, dropout=dropout))) for s in sweep_seqs]
          for dropout in (0.1, 0.0)}
fig_sweep, ax = plt.subplots(figsize=(8, 4.2), dpi=110, layout="constrained")
for (dropout, points), color in zip(curves.items(), (plot.SERIES[3], plot.SERIES[0])):
    seq, _, measured, listed, paper = zip(*points)
    label = "dropout 0.1: scores kept" if dropout else "dropout 0: flash, no scores"
    ax.plot(seq, [v / 2**20 for v in measured], "o", color=color, ms=7, label=f"measured, {label}")
    ax.plot(seq, [v / 2**20 for v in listed], "-", color=color, lw=1.2, label="derived: TinyGPT list")
    ax.plot(seq, [v / 2**20 for v in paper], ":", color=color, lw=1.2,
            label=f"derived: paper, recompute={sweeps.paper_policy(dropout)}, e=4")
ax.set(xscale="log", yscale="log", xlabel="sequence length (tokens)", ylabel="activation bytes (MiB)",
       title=f"TinyGPT activations on {nb.device.type}: measured points, derived lines")
ax.set_xticks(sweep_seqs, [str(s) for s in sweep_seqs])
ax.minorticks_off()
ax.legend(fontsize=7.5, frameon=False)
ax.grid(alpha=0.3, which="both")
sweep = sweeps.sweep_table([p for points in curves.values() for p in points])
display(sweep)
notebook.show(fig_sweep, alt="Measured activation bytes of TinyGPT against sequence length, with and without "
                             "dropout, on log-log axes, with the derived TinyGPT list and the paper's formula as"
                             " lines")

# %% [markdown]
# ## Real architectures (derived, from exact parameter counts)
#
# The same formulas for the zoo's real models: the parameter counts are the closed forms of
# `labkit.zoo`, equal to the published ones (a test holds them to the digit). Lab 13 traces the
# steps of these models on fake tensors and sets these formulas beside the trace.

# %%
zoo_models = sweeps.zoo_model_state()
real_scale = sweeps.zoo_table(zoo_models)
display(real_scale)

# %% [markdown]
# ## Model parallelism: what one GPU holds at 70B (derived)
#
# Llama-3-70B trained with one 8,192-token sequence per micro-batch. Activations per GPU come from
# Korthikanti et al.'s Table 2 (`activation_bytes_per_layer` with `tp`, `sp` and `recompute`), in
# 16-bit with 1-byte dropout masks: the paper's block at 70B's s, b, h, a and L. Model state is
# mixed-precision AdamW, 16 B times the parameters on the GPU (`llama_params_per_gpu`: every matrix
# and the vocabulary divided by t, the norms whole; a pipeline stage holds L/p layers). Under 1F1B,
# stage 0 keeps p micro-batches of its L/p layers: L layers' worth, as on one pipeline stage.

# %%
parallel = sweeps.parallel_70b()
parallelism = sweeps.parallel_table(parallel)
display(parallelism)

# %% [markdown]
# ## Tensor parallelism traced: one 70B-width layer on one GPU of 8 (traced)
#
# `tp_trace.trace_block` splits a plain transformer layer (the paper's block without dropout, at
# h = 8192, a = 64) with DTensor's `ColwiseParallel`/`RowwiseParallel` (and `SequenceParallel`),
# plays rank 0 of 8 under PyTorch's fake process group, and runs forward on fake tensors in bf16
# under the memory ledger. The formula is the same block's: no masks, and flash attention keeps no
# scores. With SP, PyTorch keeps the all-gathered inputs of Q/K/V and of the MLP whole; Megatron
# keeps this GPU's shard and gathers it again in backward.

# %%
traced_layer = sweeps.traced_70b_layer()
parallelism_traced = sweeps.traced_table(traced_layer)
display(parallelism_traced)

# %%
notebook.publish(
    nb, tables={"recipes": recipes, "zero_stages": zero_table, "activations_7b": act_table, "kv_cache": kv_table,
                "measure": measure_table, "measure_mixed": mixed_table, "gap": gap, "saved": saved,
                "sweep": sweep, "real_scale": real_scale, "parallelism": parallelism,
                "parallelism_traced": parallelism_traced},
    figures={"zero_stages": fig_zero, "activations_vs_seq": fig_act, "timeline": fig_timeline,
             "toy_activations_vs_seq": fig_sweep},
    summary=result.summary(), mixed=mixed.summary(), kv_cache=kv,
    sweep={str(dropout): [[s, meas, listed, paper] for s, _, meas, listed, paper in points]
           for dropout, points in curves.items()},
    derived_7b={"mixed_adamw_bytes": per_rank[0], "zero3_dp8_bytes_per_rank": per_rank[3]},
    zoo=zoo_models, parallel_70b=parallel, traced_70b_layer=traced_layer,
    llama_3_70b_params=zoo_models["llama-3-70b"]["params"])
