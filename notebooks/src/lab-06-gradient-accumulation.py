# %% [markdown]
# # Lab 06 · Gradient accumulation, measured
#
# This notebook runs the Lab 06 starter, `code/lab-06-gradient-accumulation/grad_accumulation.py`,
# and measures three claims. It is executed by `scripts/run_notebooks.py`, never edited by hand;
# the table below says where and on which code. On a CPU the byte counts are exact; speed and
# allocator behaviour need a GPU run.
#
# 1. k micro-batches, each loss divided by k, give the gradients of one large batch: not bit for
#    bit, but within a few roundings of fp32.
# 2. At a fixed micro-batch the peak does not grow with the effective batch; a large batch's peak
#    grows with every sample.
# 3. Given a byte budget, the trainer measures candidate runs with the ledger, picks a micro-batch
#    size and checkpointing that fit, and its run stays under the budget.

# %%
from dataclasses import replace

import matplotlib.pyplot as plt
from IPython.display import display

from labkit import labs, notebook, plot
from labkit.table import Table, by_category, format_bytes, pick_unit

nb = notebook.setup(6)
lab = nb.lab
derived = labs.load(6, "accumulation_math")
reporting = labs.load(6, "accumulation_report")  # the lab's tables
# small on a CPU, GPU-sized on a GPU: the same code either way
size = dict(width=1024, layers=8, heads=16, seq_len=512) if nb.on_gpu else {}
config = lab.Config(device=nb.device.type, steps=2, **size)

# %% [markdown]
# ## 1 · The same gradients, up to summation order
#
# `lab.gradient_gap` computes the gradients of one batch of 16 samples, then the gradients of the
# same 16 samples as k micro-batches through `lab.accumulate` (the function the trainer uses),
# and compares them parameter by parameter. It runs in fp32 on the CPU at the small size, dropout
# off. The second table repeats k micro-batches but forgets to divide each loss by k.

# %%
small = lab.Config(device="cpu").model_config()
gaps = [lab.gradient_gap(small, 16, k) for k in (1, 2, 4, 8, 16)]
unscaled = [lab.gradient_gap(small, 16, k, scale=False) for k in (2, 4, 8, 16)]


def gap_table(rows, ulps: str, ratio: str) -> Table:
    return Table(["k", ("max abs diff", "sci:2"), ("÷ max abs grad", "sci:2"), ("fp32 ulps", ulps),
                  ("bit-exact", "yes"), ("norm ratio", ratio)],
                 [[g["k"], g["max_abs_diff"], derived.relative_gap(g), derived.gap_in_ulps(g), g["bit_exact"],
                   g["norm_ratio"]] for g in rows])


equivalence, forgot_1_over_k = gap_table(gaps, "float:2", "float:7"), gap_table(unscaled, "sci:1", "float:4")
display(equivalence, forgot_1_over_k)

# %%
fig_gap, ax = plt.subplots(figsize=(7.5, 3.8), dpi=110, layout="constrained")
ks = [g["k"] for g in gaps[1:]]
ax.semilogy(ks, [derived.relative_gap(g) for g in gaps[1:]], "o-", color=plot.SERIES[0], label="loss / k (measured)")
ax.semilogy(ks, [derived.relative_gap(g) for g in unscaled], "s--", color=plot.SERIES[3], label="without 1/k (measured)")
ax.axhline(lab.TOLERANCE, color=plot.INK, lw=1, ls=":", label=f"tolerance {lab.TOLERANCE:g} (asserted)")
ax.axhline(2.0 ** -23, color=plot.SERIES[2], lw=1, ls="-.", label="fp32 machine epsilon, 2^-23")
ax.set_xscale("log", base=2)
ax.set_xticks(ks, [str(k) for k in ks])
ax.set(xlabel="micro-batches k (16 samples in all)", ylabel="max |g_acc - g_large| / max |g_large|")
ax.set_title("Accumulated against large-batch gradients (k = 1 is bit-exact: not drawn on a log axis)", fontsize=9)
ax.legend(fontsize=8, loc="center right")
ax.grid(alpha=0.3, which="both")
notebook.show(fig_gap, alt="Relative gradient difference against the number of micro-batches k, for accumulation"
                           " with and without the 1/k, with the tolerance and fp32 machine epsilon drawn")

# %% [markdown]
# ## 2 · Peak memory against the effective batch
#
# Two sweeps over the same effective batches B = 4 · k, k = 1, 2, 4, 8. **Accumulation** keeps the
# micro-batch at 4 samples and runs k of them per step; the **large batch** runs all B samples in
# one pass. Each point is the ledger's peak over two AdamW steps (step 1 carries the optimizer
# state).
#
# Derived lines (`accumulation_math.py`): the model state is 4 B (parameters) + 4 B (gradients) +
# 8 B (AdamW moments) per parameter + 4 B per parameter tensor (AdamW's step counters), a floor no
# batch size can go under. The large batch's line is linear in B through the two smallest measured
# batches; the accumulation line is flat at the k = 2 measurement.

# %%
MICRO, KS = 4, (1, 2, 4, 8)
acc = {k: lab.run(replace(config, micro_batch=MICRO, accum_steps=k)) for k in KS}
large = {k: acc[1] if k == 1 else lab.run(replace(config, batch=MICRO * k)) for k in KS}
acc_peak = {k: r.ledger.peak() for k, r in acc.items()}
large_peak = {k: r.ledger.peak() for k, r in large.items()}
B = [MICRO * k for k in KS]
P, T = acc[1].params, acc[1].summary()["param_tensors"]
floor = derived.model_state_floor(P, T)
slope, large_line = derived.line_through_first_two(B, [large_peak[k]["total"] for k in KS])
flat = Table(["effective batch", "accumulation", ("its peak", "bytes"), ("large-batch peak", "bytes"),
              ("derived line", "bytes"), ("large ÷ accumulation", "x:2")],
             [[b, f"{k} x {MICRO}", acc_peak[k]["total"], large_peak[k]["total"], line,
               large_peak[k]["total"] / acc_peak[k]["total"]] for k, b, line in zip(KS, B, large_line)])
display(flat)

# %%
fig_batch, ax = plt.subplots(figsize=(8, 4.2), dpi=110, layout="constrained")
unit, unit_bytes = pick_unit(max(large_peak[k]["total"] for k in KS))
ax.plot(B, [large_peak[k]["total"] / unit_bytes for k in KS], "s", color=plot.SERIES[3], ms=7,
        label="one large batch (measured)")
ax.plot(B, [v / unit_bytes for v in large_line], "--", color=plot.SERIES[3], lw=1,
        label="derived: linear in B (slope from the first two points)")
ax.plot(B, [acc_peak[k]["total"] / unit_bytes for k in KS], "o", color=plot.SERIES[0], ms=7,
        label=f"accumulation, micro-batch {MICRO} (measured)")
ax.axhline(acc_peak[2]["total"] / unit_bytes, color=plot.SERIES[0], lw=1.2, ls="-.", label="derived: flat at the k = 2 peak")
ax.axhline(floor / unit_bytes, color=plot.CATEGORY_COLORS["optimizer_state"], lw=1, ls=":", label="derived: model state, 16 B/param + 4 B/tensor")
ax.set_xticks(B, [str(b) for b in B])
ax.set_xlim(0, B[-1] * 1.05)
ax.set_ylim(0, None)
ax.set(xlabel="effective batch (samples per optimizer step)", ylabel=f"peak live bytes ({unit})")
ax.set_title(f"Peak against effective batch on {nb.device.type} (ledger, 2 AdamW steps each)", fontsize=10)
ax.legend(fontsize=8, loc="upper left")
ax.grid(alpha=0.3)
notebook.show(fig_batch, alt="Peak bytes against effective batch: flat for accumulation, linear for one large "
                             "batch, above the model-state floor")

# %% [markdown]
# What sits under the accumulation peak, against the large batch's peak at the same effective
# batch (B = 32): the activations of one micro-batch of 4 samples, against those of 32 samples.

# %%
compare = by_category({f"accumulation 8 x {MICRO}": acc_peak[8], f"large batch {MICRO * 8}": large_peak[8]},
                      label="run (peak moment)")
display(compare)

# %% [markdown]
# ## 3 · The budget trainer's decisions
#
# For each budget, `lab.plan` measures candidate runs (two steps each, with at most two
# micro-batches: the peak does not depend on k beyond that, section 2) in this order: the
# smallest configuration first (micro-batch 1, checkpointing on), to fail fast; then micro-batch
# sizes upward without checkpointing until one does not fit; then, only if not even micro-batch
# 1 fits without it, the same with checkpointing. The chosen configuration then trains for two
# steps under a fresh ledger, and `lab.run` refuses a run whose peak is over the budget. The
# effective batch is 8 samples throughout.

# %%
MIB = 1 << 20
budgets = ([int(f * floor) for f in (3.0, 2.0, 1.5, 1.2, 1.05)] if nb.on_gpu
           else [16 * MIB, int(12.5 * MIB), 10 * MIB, int(8.5 * MIB), 8 * MIB])
runs, refusals = {}, {}
for budget in budgets:
    try:
        runs[budget] = lab.run(replace(config, batch=8, budget=budget))
    except lab.UsageError as err:
        refusals[budget] = str(err)
decided = [{"budget_bytes": b, "error": None, "candidates": r.candidates, "micro_batch": r.micro_batch,
            "accum_steps": r.accum_steps, "checkpoint": r.checkpoint, "run_peak_bytes": r.ledger.peak()["total"]}
           for b, r in runs.items()]
decided += [{"budget_bytes": b, "error": e, "candidates": None, "micro_batch": None, "accum_steps": None,
             "checkpoint": None, "run_peak_bytes": None} for b, e in refusals.items()]
decisions = Table([("budget", "bytes"), ("micro-batch", "int"), ("accumulation steps", "int"), ("checkpointing", "yes"),
                   ("run peak", "bytes"), "outcome"],
                  [[d["budget_bytes"], d["micro_batch"], d["accum_steps"], d["checkpoint"], d["run_peak_bytes"],
                    "refused, exit code 2: " + d["error"].split(": ", 1)[1] if d["error"] else "trained within the budget"]
                   for d in decided])
measured = {(c["micro_batch"], c["checkpoint"]): c["peak_bytes"] for r in runs.values() for c in r.candidates}
fits = {(b, c["micro_batch"], c["checkpoint"]): c["fits"] for b, r in runs.items() for c in r.candidates}
candidates = Table([("micro-batch", "int"), ("checkpointing", "yes"), ("measured peak", "bytes"),
                    *((f"fits {format_bytes(b)}", "yes") for b in runs)],
                   [[m, ckpt, peak, *(fits.get((b, m, ckpt)) for b in runs)] for (m, ckpt), peak in measured.items()])
display(decisions, candidates)

# %% [markdown]
# ## 4 · The chosen run against its budget
#
# The ledger timeline of one budgeted run from the table (the third budget: 10 MiB on CPU), both
# its steps, with the budget drawn as a horizontal line. Each forward/backward pair is one
# micro-batch.

# %%
pick = runs[budgets[2]]
tl = pick.ledger.timeline()
fig_budget = plot.plot_timeline(
    tl, title=(f"Lab 06 · budget {format_bytes(pick.config.budget)}: {pick.accum_steps} micro-batches of "
               f"{pick.micro_batch}, checkpointing {'on' if pick.checkpoint else 'off'} ({nb.device.type}, ledger)"),
    overlay={f"budget {format_bytes(pick.config.budget)}": [pick.config.budget] * len(tl)})
notebook.show(fig_budget, alt="Ledger timeline of a budgeted run: micro-batches under a horizontal budget line, "
                              "by category, with phase bands")

# %% [markdown]
# ## Allocated against reserved (CUDA only)
#
# On a GPU the ledger also samples `torch.cuda.memory_allocated` and `memory_reserved`, so the
# budgeted run's ledger peak can be compared with `max_memory_allocated`. On a CPU there is no
# caching allocator to compare with, and the table says so.

# %%
c = pick.summary()["cuda"] or {}
display(Table(["allocator", ("bytes", "bytes")],
              [["max_memory_allocated", c.get("max_memory_allocated")], ["max_memory_reserved", c.get("max_memory_reserved")],
               ["held beyond the ledger when the run began", c.get("unseen_before_window")],
               ["ledger peak", tl.peak()["total"]], ["budget", pick.config.budget]]))

# %% [markdown]
# ## At real scale: Llama-3-8B, 4 micro-batches of one 4,096-token sequence against one batch of 4
#
# The same `lab.run`, with `--model llama-3-8b --fake`: the zoo's Llama 3 8B in fp32 (the lab's
# precision), AdamW `foreach` (CUDA's default), two optimizer steps each, on **fake tensors**: every
# op computes shapes and storages, nothing is allocated, and the ledger rounds every storage to the
# CUDA allocator's 512-byte blocks. Both runs see 16,384 tokens per optimizer step. These figures are
# **traced**, not measured: no CUDA context, cuBLAS workspaces or fragmentation, and the ops take
# their CPU path (`labkit/fake.py` says where that differs from CUDA). No losses: a fake tensor has
# no value.

# %%
scale = lab.Config(model="llama-3-8b", fake=True, seq_len=4096, steps=2)
traced = {"one batch of 4": lab.run(replace(scale, batch=4)),
          "4 micro-batches of 1": lab.run(replace(scale, micro_batch=1, accum_steps=4))}
CARD = 80 * 2**30  # an 80 GB H100 holds at most 80 GiB (PyTorch sees a little less)
real_scale = reporting.real_scale_table(traced)
display(real_scale)

# %%
fig_scale, axes = plt.subplots(2, 1, figsize=(10, 7.5), dpi=110, layout="constrained")
top = max(r.ledger.peak()["total"] for r in traced.values())
for i, (ax, (name, r)) in enumerate(zip(axes, traced.items())):
    tl_big = r.ledger.timeline()
    plot.plot_timeline(tl_big, ax=ax, ymax_bytes=top, show_allocator=False, legend=i == 0,
                       title=f"Llama-3-8B, fp32: {name} (traced)",
                       overlay={"80 GiB: an H100's memory": [CARD] * len(tl_big)})
notebook.show(fig_scale, alt="Two stacked timelines on one scale of two fp32 AdamW steps of Llama-3-8B: one "
                             "batch of four sequences, and four accumulated micro-batches of one")

# %%
large_8b, acc_8b = (r.ledger.peak() for r in traced.values())
notebook.publish(
    nb, tables={"equivalence": equivalence, "forgot_1_over_k": forgot_1_over_k, "flat": flat,
                "compare": compare, "decisions": decisions, "candidates": candidates, "real_scale": real_scale},
    figures={"gradient_gap": fig_gap, "peak_vs_batch": fig_batch, "budget_timeline": fig_budget,
             "real_scale_timelines": fig_scale},
    real_scale={"large": large_8b, "accumulation": acc_8b, "saving": large_8b["total"] - acc_8b["total"],
                "activation_ratio": acc_8b["activations"] / large_8b["activations"],
                "gradient_buffer": acc_8b["gradients"]},
    summary=pick.summary(), tolerance=lab.TOLERANCE, gradient_check_config=small.to_dict(),
    gradient_gap=gaps, gradient_gap_without_1_over_k=unscaled,
    sweep={"micro_batch": MICRO, "effective_batch": B, "accumulation_peak_bytes": [acc_peak[k]["total"] for k in KS],
           "large_batch_peak_bytes": [large_peak[k]["total"] for k in KS], "large_batch_slope_bytes": slope,
           "model_state_floor_bytes": floor},
    decisions=decided)
