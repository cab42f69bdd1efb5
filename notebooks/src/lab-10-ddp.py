# %% [markdown]
# # Lab 10 · Data parallel (DDP), measured per rank
#
# This notebook launches the Lab 10 starter, `code/lab-10-ddp/train_ddp.py`, with `torchrun` on
# two processes (ranks) and draws what they reported: rank 0's JSON summary, and the memory
# ledger each rank wrote for itself. It is executed by `scripts/run_notebooks.py`, never edited by
# hand; the table below says where and on which code. On a CPU the two ranks talk through gloo
# and the byte counts are exact; speed and NCCL need a GPU run.
#
# What to look for:
#
# 1. Every rank holds the same model state: the whole model, its gradients, AdamW's moments, and
#    on top of them DDP's gradient buckets, 4 bytes per parameter, the `communication` category.
# 2. Step 0 reduces one bucket holding every gradient; from step 1 on, DDP has rebuilt its buckets
#    in the order the gradients became ready, each closed at `--bucket-cap-mb`.
# 3. The replicas are bit-identical after every step, and training equals one process on the
#    concatenated batch up to rounding.

# %%
import json
from dataclasses import replace

import matplotlib.pyplot as plt
from IPython.display import display

from labkit import dist, labs, notebook, plot
from labkit.table import Table
from labkit.timeline import Timeline

nb = notebook.setup(10)
lab, ddp_report = nb.lab, labs.load(10, "ddp_report")  # the starter, and its tables
# small on a CPU, GPU-sized on a GPU: the same code either way
size = dict(width=1024, layers=8, heads=16, seq_len=512, batch_size=8, bucket_cap_mb=25) if nb.on_gpu else {}
config = lab.Config(device=nb.device.type, steps=3, ledger_dir=nb.results / "ledger",
                    snapshot=nb.results / "memory_snapshot.pickle" if nb.on_gpu else None, **size)

# %% [markdown]
# ## Two runs under torchrun
#
# The starter cannot run in this kernel: DDP needs one process per rank, started by `torchrun`.
# So the notebook launches it twice, at the same time (each launch is mostly process start-up):
# once as it is, with gradients copied into the buckets, and once with `--grad-as-bucket-view`,
# where the gradients are views into the buckets. Only rank 0 prints, one JSON object; with
# `--ledger-dir` every rank of the first run also writes its own ledger.

# %%
runs = dist.launch(lab, {"copy": config,
                         "view": replace(config, grad_as_bucket_view=True, ledger_dir=None, snapshot=None)})
result = runs["copy"]
P, T = result["params"], result["param_tensors"]
print(f"{result['world_size']} ranks over {result['backend']}; TinyGPT with {P:,} parameters in {T} tensors; "
      f"global losses {[round(v, 4) for v in result['losses']]}")

# %% [markdown]
# ## Each rank's memory, over time
#
# Every rank ran its own ledger and wrote its timeline. The phases are Lab 02's, plus `wrap`
# (the `DDP(...)` call: rank 0's weights are broadcast and the first bucket is allocated) and
# `check` (the replica digests and the global loss). The dashed line is **derived**, not
# measured (`lab.predicted_model_state`): parameters and buckets (4 + 4 bytes per parameter) from
# the start, gradients (4 bytes per parameter) from the end of backward to the next `zero_grad`,
# and AdamW's moments (8 bytes per parameter + 4 per tensor) from the first optimizer step.

# %%
timelines = {rank: Timeline.from_dict(json.loads((config.ledger_dir / f"rank{rank}.json").read_text())["timeline"])
             for rank in range(result["world_size"])}
fig, axes = plt.subplots(len(timelines), 1, figsize=(10, 3.8 * len(timelines)), dpi=110, layout="constrained",
                         sharex=True)
for ax, (rank, tl) in zip(axes, timelines.items()):
    plot.plot_timeline(tl, ax=ax, title=f"rank {rank} of {len(timelines)} on {nb.device.type} (measured by its own ledger)",
                       overlay={"derived: params + buckets + grads + AdamW": lab.predicted_model_state(tl, P, T)},
                       legend=rank == 0)
notebook.show(fig, alt="Two stacked memory timelines, one per rank, by category, with phase bands and a dashed "
                       "model-state prediction")

# %% [markdown]
# ## Memory per rank, by category
#
# Two moments of each rank: its peak (here at the turn from forward to backward, where the
# activations are) and the optimizer phase, where the whole model state is alive. Left: buckets
# separate from the gradients (DDP's default). Right: `--grad-as-bucket-view`.

# %%
moments = {mode: [(f"rank {m['rank']}\n{what}", row) for m in runs[mode]["memory"]
                  for what, row in (("peak", m["peak"]), ("optimizer", m["peaks_by_phase"]["optimizer"]))]
           for mode in runs}
categories = [c for c in plot.CATEGORY_COLORS if any(row[c] for bars in moments.values() for _, row in bars)]
unit, unit_bytes = plot.pick_unit(max(sum(row[c] for c in categories) for bars in moments.values() for _, row in bars))
fig2, axes2 = plt.subplots(1, 2, figsize=(11, 3.8), dpi=110, layout="constrained", sharey=True)
for ax, (mode, bars) in zip(axes2, moments.items()):
    bottom = [0.0] * len(bars)
    for c in categories:
        heights = [row[c] / unit_bytes for _, row in bars]
        ax.bar(range(len(bars)), heights, bottom=bottom, color=plot.CATEGORY_COLORS[c], label=c.replace("_", " "))
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize=8)
    ax.set_title(f"{'gradients copied into buckets' if mode == 'copy' else '--grad-as-bucket-view'} (measured)",
                 fontsize=10, loc="left")
    ax.grid(axis="y", alpha=0.3)
axes2[0].set_ylabel(f"device bytes per rank ({unit})")
legend = axes2[1].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
notebook.show(fig2, alt="Stacked bars of device bytes per rank by category, at the peak and in the optimizer "
                        "phase, for gradients copied into buckets and as bucket views")

# %% [markdown]
# The optimizer phase of each rank, byte for byte, under the formulas (**derived**; P parameters
# in T tensors): `copy` is DDP's default, `view` the run with `--grad-as-bucket-view`; "the rest"
# is activations, temporaries and other. Then each rank's peak. The ledger counts what PyTorch
# allocates through its dispatcher: gloo's own buffers (NCCL's on a GPU) are not in these figures.

# %%
memory = ddp_report.memory_table(runs)
peaks = ddp_report.peaks_table(runs)
display(memory, peaks)

# %% [markdown]
# ## The buckets
#
# What the communication hook saw in the last step: each bucket's parameters in the order DDP laid
# them out, and its bytes. The layout is **derived** twice: from the parameter sizes in reverse
# definition order (the bytes must match), and from the order in which gradients became ready in
# step 0, which a post-accumulate-grad hook recorded (the parameters must match, in order). DDP's
# own logging data (a private API, read guardedly) must agree as well.

# %%
b = result["buckets"]
groups = dict(zip(("embeddings, head", "attention", "MLP", "norms"), plot.SERIES))


def group(name: str) -> str:
    return "attention" if ".attn." in name else "MLP" if ".mlp." in name else "norms" if "ln" in name \
        else "embeddings, head"


fig3, ax3 = plt.subplots(figsize=(10, 0.5 * len(b["buckets"]) + 1.4), dpi=110, layout="constrained")
unit3, unit3_bytes = plot.pick_unit(max(x["bytes"] for x in b["buckets"]))
for row, bucket in enumerate(b["buckets"]):
    left = 0
    for name in bucket["params"]:
        width = b["param_bytes"][name]
        ax3.barh(row, width / unit3_bytes, left=left / unit3_bytes, color=groups[group(name)], edgecolor=plot.PAPER, lw=0.6)
        left += width
ax3.axvline(b["cap_bytes"] / unit3_bytes, color=plot.INK, ls="--", lw=1.2,
            label=f"cap: --bucket-cap-mb {result['bucket_cap_mb']}")
ax3.set_yticks(range(len(b["buckets"])), [f"bucket {x['index']}" for x in b["buckets"]])
ax3.invert_yaxis()
ax3.set_xlabel(f"bytes ({unit3}), parameters in the order DDP laid them out")
ax3.set_title("DDP's buckets after the rebuild, as the communication hook saw them (measured)", loc="left", fontsize=10)
ax3.legend([plt.Rectangle((0, 0), 1, 1, color=c) for c in groups.values()] + ax3.get_legend_handles_labels()[0],
           [*groups, *ax3.get_legend_handles_labels()[1]], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
           frameon=False)
ax3.grid(axis="x", alpha=0.3)
buckets, bucket_checks = ddp_report.buckets_table(result), ddp_report.bucket_checks_table(result)
display(buckets, bucket_checks)
notebook.show(fig3, alt="Horizontal bars, one per DDP bucket, split into the parameters it holds, coloured by "
                        "layer group, with the bucket cap as a dashed line")

# %% [markdown]
# ## Identical replicas, every step
#
# After each step every rank hashes its parameters' bytes (SHA-256) and the digests are
# all-gathered. The ranks start from different seeds on purpose (`seed + rank`): `DDP(...)`
# broadcasts rank 0's weights, and from then on the averaged gradients keep them equal.

# %%
identical = ddp_report.identical_table(result)
display(identical)

# %% [markdown]
# ## One process on the concatenated batch
#
# Rank 0 replays the training in one process on both ranks' sequences at once, from the same
# initial weights. The result is equal up to rounding, not bit for bit: a weight gradient is a sum
# over every token, which DDP computes as two per-rank sums added by the all-reduce, in another
# order than one sum over the whole batch. The tolerance is stated in the starter (`TOLERANCE`).

# %%
reference, losses = ddp_report.reference_table(result), ddp_report.losses_table(result)
display(reference, losses)

# %% [markdown]
# ## Allocated against reserved (CUDA only)
#
# On a GPU each rank's ledger also samples `torch.cuda.memory_allocated`, and the run exports one
# `_record_memory_history` snapshot per rank. Each rank holds its ledger against the allocator
# over the last step: the allocator's peak is reset as the step starts, and the bytes it already
# held that the ledger never saw (memory a library allocates inside a kernel call and keeps, such
# as a matmul workspace) are set aside. On a CPU there is no caching allocator, and the table says so.

# %%
display(Table(["rank", ("max allocated, last step", "bytes"), ("unseen by the ledger before it", "bytes"),
               ("ledger peak / the rest", "float:4")],
              [[m["rank"], *((m["cuda"] or {}).get(k) for k in ("max_memory_allocated", "unseen_before_window",
                                                                 "ledger_over_allocator"))] for m in result["memory"]]))

# %% [markdown]
# ## At real scale: one rank of 8 or 64, traced
#
# The same `train` for ONE rank (rank 0) of a job of 8 or 64 ranks, in this kernel:
# `world_size=N` puts the process in PyTorch's fake process group (every collective returns at
# once and moves no data; DDP's buckets are still allocated, so the ledger counts them), and
# `fake=True` runs it on fake tensors (**traced on fake tensors: bytes, no values, no time**).
# Llama-3-8B as this lab trains (fp32 weights, fp32 AdamW in its `foreach` implementation, CUDA's
# default), one 4,096-token sequence per rank, PyTorch's default 25 MiB buckets, two steps (the
# second has AdamW's state and the rebuilt buckets). The trace follows CPU dispatch (`labkit.fake`
# says where CUDA's would differ) and holds neither the CUDA context, cuBLAS workspaces, NCCL's own
# buffers nor the allocator's fragmentation. There are no replicas to compare and no replay.

# %%
trace_report = labs.load(10, "ddp_trace_report")
at_scale = dict(model="llama-3-8b", fake=True, seq_len=4096, batch_size=1, steps=2, bucket_cap_mb=25)
jobs = {"llama_3_8b_8": dict(world_size=8), "llama_3_8b_64": dict(world_size=64),
        "llama_3_8b_64_view": dict(world_size=64, grad_as_bucket_view=True)}
traces = {key: {k: v for k, v in lab.run(lab.Config(**job, **at_scale)).summary().items() if k != "provenance"}
          for key, job in jobs.items()}  # the notebook's own provenance is the one publish writes
real_scale = trace_report.real_scale_table(traces)
real_scale_buckets = trace_report.real_scale_buckets_table(traces)
display(real_scale, real_scale_buckets)
phases = ("forward", "backward", "optimizer")
bars = [(f"{'view' if s['grad_as_bucket_view'] else 'copy'} · {phase}", s["memory"]["peaks_by_phase"][phase])
        for key, s in traces.items() if key != "llama_3_8b_8" for phase in phases]
fig_real, ax = plt.subplots(figsize=(5.2, 0.5 * len(bars) + 2.2), dpi=110, layout="constrained")
left = [0.0] * len(bars)
for cat in [c for c in plot.CATEGORY_COLORS if any(row.get(c) for _, row in bars)]:
    widths = [row[cat] / 2**30 for _, row in bars]
    ax.barh([label for label, _ in bars], widths, left=left, color=plot.CATEGORY_COLORS[cat], label=cat.replace("_", " "))
    left = [a + b for a, b in zip(left, widths)]
ax.invert_yaxis()
ax.set(xlabel="GiB on rank 0 of 64", title="Llama-3-8B under DDP, each phase's peak (traced)")
ax.grid(axis="x", alpha=0.3)
legend = ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
notebook.show(fig_real, alt="Horizontal stacked bars of rank 0's peak by category in the forward, backward and "
                            "optimizer phases of Llama-3-8B under DDP on 64 ranks, traced")

# %%
notebook.publish(
    nb, tables={"memory": memory, "peaks": peaks, "buckets": buckets, "bucket_checks": bucket_checks,
                "identical": identical, "reference": reference, "losses": losses, "real_scale": real_scale,
                "real_scale_buckets": real_scale_buckets},
    figures={"timeline": fig, "memory_per_rank": fig2, "buckets": fig3, "real_scale": fig_real},
    summary=result, grad_as_bucket_view_run={"losses": runs["view"]["losses"], "memory": runs["view"]["memory"]},
    real_scale=traces)
