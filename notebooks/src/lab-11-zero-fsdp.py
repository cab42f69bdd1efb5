# %% [markdown]
# # Lab 11 · ZeRO and FSDP, measured per rank
#
# This notebook launches the two Lab 11 starters with `torchrun` on two processes (ranks), reads
# the one JSON summary rank 0 prints for each, and draws what every rank's memory ledger recorded.
# It is executed by `scripts/run_notebooks.py`, never edited by hand; the table below says where
# and on which code. On a CPU the two ranks talk through gloo and the byte counts are exact; no
# number here is a GPU time.
#
# 1. `code/lab-11-zero-fsdp/zero_fsdp.py` trains one small GPT at ZeRO stages 0 to 3 (DDP,
#    `ZeroRedundancyOptimizer`, FSDP2 with `reshard_after_forward=False` and `True`). Its bytes per
#    rank are held against Lab 01's formulas (`zero_model_state`), category by category.
# 2. `code/lab-11-zero-fsdp/fsdp_inference.py` runs Lab 08's toy diffusion pipeline with its
#    weights sharded across the ranks (with and without CPU offload of the shards) and compares it
#    with Lab 08's single-device engines.

# %%
import matplotlib.pyplot as plt
from IPython.display import display

from labkit import dist, labs, notebook, plot
from labkit.timeline import Timeline

nb = notebook.setup(11)
lab, inference = nb.lab, labs.load(11, "fsdp_inference")  # the two starters
zero_report, inference_report = labs.load(11, "zero_report"), labs.load(11, "inference_report")  # their tables
# small on a CPU, GPU-sized on a GPU: the same code either way
train_size = dict(width=1024, layers=8, heads=16, seq_len=512, vocab=32000, batch_size=4) if nb.on_gpu else {}
infer_size = dict(width=1024, heads=16, denoiser_layers=16, latent_tokens=4096, steps=4,
                  dtype="bfloat16") if nb.on_gpu else {}

# %% [markdown]
# ## Two torchrun launches
#
# The starters cannot run in this kernel: every rank is its own process, started by `torchrun`.
# Each launch starts two; rank 0 gathers every rank's numbers and prints them as one JSON object,
# the other ranks print nothing. With `timelines=True` the object also holds rank 0's ledger
# timelines, which the figures below draw.

# %%
train = dist.launch(lab, {"train": lab.Config(device=nb.device.type, timelines=True, **train_size)})["train"]
infer = dist.launch(inference, {"infer": inference.Config(device=nb.device.type, timelines=True, **infer_size)})["infer"]
train_timelines, infer_timelines = train.pop("timelines"), infer.pop("timelines")
P, T, N = train["params"], train["tensors"], train["world_size"]
stages = {s["stage"]: s for s in train["stages"]}
print(f"training: {P:,} parameters in {T} tensors on {N} ranks ({train['backend']}); "
      f"inference: {infer['world_size']} ranks ({infer['backend']})")

# %% [markdown]
# ## Model state per rank against Lab 01
#
# Measured: each rank's ledger at the end of the run, counting only what that rank holds (a
# DTensor counts as its local shard). Derived: Lab 01's `zero_model_state(P, "fp32", "adamw",
# zero_stage, dp=N, tensors=T)`, which the starter calls on every stage.

# %%
model_state = zero_report.model_state_table(train)
display(model_state)
categories = zero_report.MODEL_STATE
fig_state, axes = plt.subplots(1, 3, figsize=(12, 3.6), dpi=110, layout="constrained", sharey=True)
width = 0.8 / (N + 1)
for ax, cat in zip(axes, categories):
    for r in range(N):
        ax.bar([n + (r - N / 2) * width for n in stages], [stages[n]["ranks"][r]["at_end"][cat] / 2**20 for n in stages],
               width, color=plot.CATEGORY_COLORS[cat], alpha=1.0 - 0.35 * r, label=f"rank {r} (measured)")
    ax.bar([n + (N / 2) * width for n in stages], [stages[n]["lab01"][cat] / 2**20 for n in stages], width,
           facecolor=plot.PAPER, edgecolor=plot.INK, hatch="///", label="Lab 01 (derived)")
    ax.set_title(cat.replace("_", " "), loc="left", fontsize=10)
    ax.set_xticks(list(stages), [f"stage {n}" for n in stages])
    ax.grid(axis="y", alpha=0.3)
axes[0].set_ylabel("MiB per rank")
legend = axes[-1].legend(fontsize=8, loc="upper right")
notebook.show(fig_state, alt="Three panels of bars: parameters, gradients and optimizer state per rank for ZeRO "
                             "stages 0 to 3, measured on each rank, beside Lab 01's derived bars")

# %% [markdown]
# ## The peak of a training step, per stage
#
# The last step of each stage (the steady state: AdamW state exists, DDP has rebuilt its buckets,
# FSDP has initialised), rank 0, at its highest moment. `communication` is every buffer a
# collective filled: DDP's gradient buckets, FSDP's gathered weights and its all-gather and
# reduce-scatter buffers (labelled by `labkit.traffic`, which watches the collectives from outside).

# %%
peak = zero_report.peak_table(train)
display(peak)
short = {0: "stage 0\nDDP", 1: "stage 1\nZeroRedundancyOptimizer", 2: "stage 2\nFSDP2, reshard=False",
         3: "stage 3\nFSDP2, reshard=True"}
peaks = {n: s["ranks"][0]["peak_last_step"] for n, s in stages.items()}
fig_peak, ax = plt.subplots(figsize=(8, 3.8), dpi=110, layout="constrained")
bottom = [0.0] * len(stages)
for cat in [c for c in plot.CATEGORY_COLORS if any(p[c] for p in peaks.values())]:
    heights = [peaks[n][cat] / 2**20 for n in stages]
    ax.bar([short[n] for n in stages], heights, bottom=bottom, color=plot.CATEGORY_COLORS[cat],
           label=cat.replace("_", " "))
    bottom = [b + h for b, h in zip(bottom, heights)]
ax.set(ylabel="MiB on rank 0", title="peak of the last training step, by category (measured)")
ax.tick_params(axis="x", labelsize=8)
legend = ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
ax.grid(axis="y", alpha=0.3)
notebook.show(fig_peak, alt="Stacked bars of rank 0's peak in the last training step for each ZeRO stage, by "
                            "category")

# %% [markdown]
# ## One training step, stage by stage
#
# Rank 0's ledger over the last step of each stage, on one scale. Watch the pink communication
# band: DDP's buckets sit there all the time; stage 2 gathers every block in forward and keeps
# them until backward is done; stage 3 gathers a block, frees it, and gathers it again in backward.

# %%
fig_steps, axes = plt.subplots(len(stages), 1, figsize=(10, 2.75 * len(stages)), dpi=110, layout="constrained")
for ax, (n, s) in zip(axes, stages.items()):
    plot.plot_timeline(Timeline.from_dict(train_timelines[str(n)]), ax=ax, legend=n == 0, max_points=220, unit="MiB",
                       ymax_bytes=max(p["total"] for p in peaks.values()),
                       title=f"stage {n}: {s['name']} (rank 0, last step, measured)")
    ax.set_xlabel("ledger events")
notebook.show(fig_steps, alt="Four memory timelines on one scale, one training step each for ZeRO stages 0 to 3 "
                             "on rank 0")

# %% [markdown]
# ## Bytes through the collectives
#
# Counted on rank 0 by `labkit.traffic`, per training step (the run's total over its steps). The
# ZeRO paper (section 7) derives the volumes: an all-reduce moves 2 x 4P bytes per rank (a
# reduce-scatter and an all-gather), stages 1 and 2 the same, stage 3 one more all-gather (3 x 4P).

# %%
traffic = zero_report.traffic_table(train)
display(traffic)

# %% [markdown]
# ## The same training, whatever the stage
#
# Sharding moves bytes between ranks; it must not change a number. Losses are the mean over ranks;
# the parameters are compared whole after the last step (`DTensor.full_tensor()` for FSDP). Stage
# 0, DDP, is the reference; the starter fails the run if a stage is further from it than its
# stated tolerance.

# %%
losses = zero_report.losses_table(train)
display(losses)

# %% [markdown]
# ## Inference: sharded weights against Lab 08's single device
#
# Every rank generates from its own prompt. Per GPU: the peak device bytes, the weights kept on
# the host, what crossed from host to device, and what arrived from the other GPUs (the part of
# the all-gathers a rank did not send itself). With CPU offload the shards live in host memory, so
# on a GPU what a rank sends is also what crossed PCIe to its device; on a CPU nothing crosses a
# bus and that value is derived. Lab 08's engines run on rank 0's device with rank 0's prompt.

# %%
per_gpu = inference_report.per_gpu(infer)
inference_rows = inference_report.inference_table(infer)
display(inference_rows)
names = [v["name"].replace(" (", "\n(") for v in per_gpu.values()]
mib = {key: [v[key] / 2**20 for v in per_gpu.values()] for key in ("device", "host", "h2d", "received")}
fig_infer, (ax_mem, ax_move) = plt.subplots(1, 2, figsize=(12, 3.8), dpi=110, layout="constrained")
ax_mem.barh(names, mib["device"], color=plot.SERIES[0], label="peak device bytes")
ax_mem.barh(names, mib["host"], left=mib["device"], color=plot.CATEGORY_COLORS["host_copies"], alpha=0.6, label="weights kept on the host")
ax_mem.set(xlabel="MiB per GPU (measured)", title="where the bytes live")
ax_move.barh(names, mib["h2d"], color=plot.SERIES[2], label="host to device")
ax_move.barh(names, mib["received"], left=mib["h2d"], color=plot.CATEGORY_COLORS["communication"], label="received from other GPUs (all-gather)")
ax_move.set(xlabel="MiB per image per GPU",
            title=f"what moves (host to device of FSDP+offload: {per_gpu['offload']['h2d_is']})")
ax_move.tick_params(axis="y", labelleft=False)
for ax in (ax_mem, ax_move):
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
notebook.show(fig_infer, alt="Bars of device and host bytes per GPU, and bytes moved per image per GPU, for FSDP"
                             " sharded, FSDP with CPU offload, Lab 08 resident and Lab 08 layerwise")

# %% [markdown]
# ## Inference timelines: gathered unit by unit, or streamed block by block
#
# Rank 0's ledger for FSDP with CPU offload, and Lab 08's layerwise offload on one device, on one
# scale. In both, the weights on the device are one unit at a time; FSDP's communication band holds
# the gathered unit *and* the flat buffer the all-gather wrote into, which FSDP2 keeps until the
# next all-gather. The table holds the largest unit against that band at its peak.

# %%
fsdp_tl = Timeline.from_dict(infer_timelines["sharded+offload"])
layer_tl = Timeline.from_dict(infer_timelines["lab08 layerwise"])
top = max(max(fsdp_tl.device_total()), max(layer_tl.device_total()))
fig_infer_steps, axes = plt.subplots(2, 1, figsize=(10, 6), dpi=110, layout="constrained")
plot.plot_timeline(fsdp_tl, ax=axes[0], ymax_bytes=top, unit="MiB" if nb.on_gpu else "KiB", max_points=220,
                   title=f"FSDP sharded + CPU offload, rank 0 of {infer['world_size']} (measured)")
plot.plot_timeline(layer_tl, ax=axes[1], ymax_bytes=top, unit="MiB" if nb.on_gpu else "KiB", max_points=220,
                   title="Lab 08 layerwise offload, one device (measured)")
units = inference_report.units_table(infer)
display(units)
notebook.show(fig_infer_steps, alt="Two memory timelines of one pipeline run: FSDP with CPU offload on rank 0, "
                                   "and Lab 08 layerwise offload on one device")

# %% [markdown]
# ## What runs where
#
# Tried here, in this process, on a one-rank gloo group: FSDP2's `CPUOffloadPolicy` with its
# default `pin_memory=True`. The other features ran in the torchrun launches above.

# %%
pinned = inference_report.pinned_offload_support()
support = inference_report.support_table(train, infer, pinned)
display(support)

# %% [markdown]
# ## At real scale: one rank of 8 or 64, traced
#
# The same `wrap`, step and ledger for ONE rank (rank 0) of a job of 8 or 64 ranks, in this kernel:
# `world_size=N` puts the process in PyTorch's fake process group (every collective returns at
# once and moves no data; the buffers it needs are still allocated, so the ledger counts them), and
# `fake=True` runs it on fake tensors (**traced on fake tensors: bytes, no values, no time**).
# Llama-3-8B and Llama-3-70B as this lab trains (fp32 weights, fp32 AdamW in its `foreach`
# implementation, CUDA's default), one 4,096-token sequence per rank, two steps: the second, with
# AdamW's state in place, is the one shown. The trace follows CPU dispatch (`labkit.fake` says
# where CUDA's would differ) and holds neither the CUDA context, cuBLAS workspaces, NCCL's own
# buffers nor the allocator's fragmentation. Every stage at 8 ranks; at 64, ZeRO-1 (whose rank 0
# gets whole tensors), ZeRO-2 (its gathered weights stay from forward to backward, whatever the
# shard) and ZeRO-3, the stage a 64-rank job runs (DDP's rank holds at 64 what it holds at 8: Lab 10
# traces both). Llama-3-70B at stage 3: DDP and ZeRO-1 would keep its fp32 weights, gradients and
# buckets whole on every rank.

# %%
at_scale = dict(fake=True, seq_len=4096, batch_size=1, steps=2)
jobs = {"llama_3_8b_8": dict(model="llama-3-8b", world_size=8),
        "llama_3_8b_64_zero1": dict(model="llama-3-8b", world_size=64, stage="1"),
        "llama_3_8b_64_zero2": dict(model="llama-3-8b", world_size=64, stage="2"),
        "llama_3_8b_64_zero3": dict(model="llama-3-8b", world_size=64, stage="3"),
        "llama_3_70b_64_zero3": dict(model="llama-3-70b", world_size=64, stage="3")}
traces = {key: lab.run(lab.Config(**job, **at_scale)).summary() for key, job in jobs.items()}
for summary in traces.values():
    summary.pop("provenance")  # the notebook's own record is the one publish writes
real_scale = zero_report.real_scale_table(traces)
real_scale_gap = zero_report.gap_table(traces)
display(real_scale, real_scale_gap)
rows = zero_report.trace_rows(traces)
fig_real, ax = plt.subplots(figsize=(5.2, 0.45 * len(rows) + 1.4), dpi=110, layout="constrained")
labels = [f"{s['model'].split('-')[-1].upper()} ×{s['world_size']} s{st['stage']}" for _, s, st in rows]  # 8B ×64 s3
left = [0.0] * len(rows)
for cat in [c for c in plot.CATEGORY_COLORS if any(st["peak_last_step"].get(c) for _, _, st in rows)]:
    widths = [st["peak_last_step"][cat] / 2**30 for _, _, st in rows]
    ax.barh(labels, widths, left=left, color=plot.CATEGORY_COLORS[cat], label=cat.replace("_", " "))
    left = [a + b for a, b in zip(left, widths)]
ax.scatter([st["lab01_model_state"] / 2**30 for _, _, st in rows], labels, marker="|", s=250, color=plot.INK,
           zorder=3, label="Lab 01 model state (derived)")
ax.invert_yaxis()
ax.set(xlabel="GiB on rank 0 at its peak", title="Llama 3, one rank of N (traced)")
ax.grid(axis="x", alpha=0.3)
legend = ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
notebook.show(fig_real, alt="Horizontal stacked bars of rank 0's peak by category for Llama-3-8B on 8 and 64 "
                            "ranks and Llama-3-70B on 64 ranks, traced, with Lab 01's model state marked")

# %%
unit_name, unit_bytes = inference_report.largest_unit(infer)
notebook.publish(
    nb, tables={"model_state": model_state, "peak": peak, "traffic": traffic, "losses": losses,
                "inference": inference_rows, "units": units, "support": support, "real_scale": real_scale,
                "real_scale_gap": real_scale_gap},
    figures={"model_state": fig_state, "peak": fig_peak, "timelines": fig_steps, "inference": fig_infer,
             "inference_timelines": fig_infer_steps, "real_scale": fig_real},
    train=train, infer=infer, pinned_offload_probe=pinned, per_gpu=per_gpu,
    largest_unit={"name": unit_name, "bytes": unit_bytes}, real_scale=traces)
