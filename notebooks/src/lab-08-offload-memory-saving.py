# %% [markdown]
# # Lab 08 · Offload and memory saving, measured
#
# This notebook runs the Lab 08 starter, `code/lab-08-offload-memory-saving/offload.py`, on the
# toy diffusion pipeline (text encoder, a denoiser run for several steps, decoder) under each
# placement of the weights, and reads every run as a residency schedule: what is on the device,
# what stays on the host, what moves, and when. It is executed by `scripts/run_notebooks.py`.
#
# On a CPU-only machine the "device" and the host are the same RAM. The ledger still tells the two
# sides apart (the engines' host memory is labelled `host_copies`), so every byte count below is
# exact; the times are CPU times and the transfers are memcpy, so nothing here says how fast PCIe is.

# %%
import dataclasses
from dataclasses import replace

import matplotlib.pyplot as plt
from IPython.display import display

from labkit import labs, notebook, plot
from labkit.table import Table, format_bytes

nb = notebook.setup(8)
lab = nb.lab
plan = labs.load(8, "make_plan")  # the schedule tables and the plan's arithmetic
tables = labs.load(8, "offload_report")  # the tables the command line prints
# small on a CPU, GPU-sized on a GPU: the same code either way; the timed runs: one warm-up, then measured
size = dict(width=1024, heads=16, denoiser_layers=16, latent_tokens=4096, steps=4, dtype="bfloat16", repeats=3) \
    if nb.on_gpu else {}
config = lab.Config(device=nb.device.type, **size)

# %% [markdown]
# ## Four placements of the same weights
#
# `lab.run` is what the command line runs: every mode on the same pipeline and the same inputs.
# `max abs diff` compares each output with the all-resident one: offload moves weights, it must not
# change a single number. Step times come from a second run of each mode without the memory ledger
# (its dispatch mode costs time on every op); they are shown from GPU runs only: on a CPU the
# "transfers" are memcpy on the same cores.

# %%
result = lab.run(config)
runs = {r.mode: r for r in result.runs}
modes = tables.modes_table(result.runs, times=nb.on_gpu)
display(modes)

# %% [markdown]
# ## Host memory: what the masters cost
#
# PyTorch's pinned (caching host) allocator rounds every request up to the next power of two, and a
# transformer block's weights sit just above one. Pinned one buffer per block, the host would hold
# nearly twice the weights. Each engine instead packs its units (blocks, component pieces, modules)
# into a `PinnedArena` of power-of-two chunks, which the allocator has nothing to round. On a CPU
# the same chunks are allocated unpinned, so the ledger's `host_copies` bytes are exactly what a
# GPU run pins.

# %%
host = tables.host_table(result.runs)
display(host)

# %% [markdown]
# ## Memory timelines, one per mode
#
# Each panel is the ledger's record of one pipeline run (encode, the denoising steps, decode),
# device bytes by category on the same scale. The engines mark every copy to the device with the
# `transfer` phase: the ticks along the bottom. Host masters are not drawn: they live on the host.

# %%
fig, axes = plt.subplots(2, 2, figsize=(12, 6.4), dpi=110, layout="constrained")
for ax, (mode, run) in zip(axes.flat, runs.items()):
    tl = run.ledger.timeline().window("encode", "denoise", "decode")
    copies = [span.start for span in tl.spans if span.name == "transfer"]
    bands = dataclasses.replace(tl, spans=[span for span in tl.spans if span.name != "transfer"])
    ax.vlines(copies, 0.0, 0.05, transform=ax.get_xaxis_transform(), color=plot.SERIES[2], lw=0.8, zorder=5,
              label="a copy in (ledger phase: transfer)")  # drawn first, so the legend lists it
    plot.plot_timeline(bands, ax=ax, legend=(mode == "model"), max_points=160, unit="MiB",
                       ymax_bytes=runs["none"].summary["peak_device_bytes"],
                       title=f"{mode}: peak {format_bytes(run.summary['peak_device_bytes'])}, "
                             f"{len(copies)} copies in")
    ax.set_xlabel("ledger events")
notebook.show(fig, alt="Four memory timelines on one scale, one per offload mode, by category, with each copy to"
                       " the device ticked along the bottom")

# %% [markdown]
# ## The residency schedule of every mode
#
# Per pipeline stage: what reached the device, what never left the host, the bytes moved in, and
# the peak. The layerwise table is on the lab's page; all four are on its plan page.
# `make_plan.py` writes the same tables to `offload_plan.md` from a run of its own.

# %%
residency = {mode: plan.schedule_table(run, config.steps) for mode, run in runs.items()}
display(residency["layerwise"])

# %% [markdown]
# ## Compute stream against copy stream
#
# Each bar is a transfer (hatched) or a block's compute, coloured by stage, from the last timed run
# of each mode. On a GPU the layerwise copies run on their own stream, under the compute of the
# block before. On a CPU there is one stream of execution: every copy sits between two computes,
# which is exactly what overlap exists to remove.

# %%
fig2, (ax_seq, ax_layer) = plt.subplots(2, 1, figsize=(11, 4.6), dpi=110, layout="constrained")
for ax, mode in ((ax_seq, "sequential"), (ax_layer, "layerwise")):
    bars = [b for b in runs[mode].schedule.intervals() if b.stage == "denoise"]
    plot.plot_gantt(bars, ax=ax, title=f"{mode}: the denoising steps ({nb.device.type})")
overlap_ms = {m: runs[m].schedule.overlap_ms() for m in ("sequential", "layerwise")}
copy_ms = {m: runs[m].schedule.bar_ms(lane="copy") for m in overlap_ms}
overlap = Table(["mode", ("copy-stream transfer time (ms)", "float:3"), ("of it under compute (ms)", "float:3")],
                [[m, copy_ms[m], overlap_ms[m]] for m in overlap_ms])
display(overlap)
notebook.show(fig2, alt="Gantt chart of the compute stream against the copy stream during the denoising steps, "
                        "for sequential and layerwise offload")

# %% [markdown]
# ## Prefetch depth: memory against depth
#
# With depth k, block i computes while blocks i+1 to i+k are copied in, so k + 1 blocks are
# resident. Here the text encoder and the decoder stay resident, so only the blocks change. The
# dashed line is derived (`plan.predicted_denoise_peak`): the resident weights (encoder, decoder,
# the denoiser's weights outside the blocks in their flat buffer), plus (k + 1) flat block buffers,
# plus what the all-resident run measured besides weights while denoising.

# %%
depths = [0, 1, 2, 4]
streaming = replace(config, mode="layerwise", encoder_offload="off", decoder_offload="off")
sweep = {k: lab.run_mode("layerwise", replace(streaming, prefetch_depth=k), nb.device, runs["none"].output).summary
         for k in depths}
measured = [sweep[k]["peak_device_bytes_by_stage"]["denoise"] for k in depths]
derived = [plan.predicted_denoise_peak(streaming, k, runs["none"]) for k in depths]
fig3, ax = plt.subplots(figsize=(6.5, 3.4), dpi=110, layout="constrained")
ax.plot(depths, [m / 2**20 for m in measured], "o-", label="measured: peak device bytes while denoising")
ax.plot(depths, [d / 2**20 for d in derived], "k--", label="derived: resident + (k+1) blocks + activations")
ax.set(xlabel="prefetch depth k", ylabel="MiB", xticks=depths, title="layerwise offload: memory against depth")
ax.grid(alpha=0.3)
ax.legend(fontsize=8)
depth = Table([("depth k", "int"), ("blocks resident", "int"), ("peak while denoising (measured)", "bytes"),
               ("derived", "bytes"), ("host to device per run", "bytes")],
              [[k, sweep[k]["max_resident_blocks"], m, d, sweep[k]["h2d_bytes"]]
               for k, m, d in zip(depths, measured, derived)])
display(depth)
notebook.show(fig3, alt="Peak device bytes while denoising against prefetch depth: measured points on the "
                        "derived dashed line")

# %% [markdown]
# ## At real scale: Flux.1-dev, traced on fake tensors
#
# The same `run`, with the zoo's Flux.1-dev transformer (11.9 B parameters, bf16) in the
# denoiser's place: a 1024 x 1024 image, 4096 latent tokens of 64 channels and 512 prompt tokens
# of 4096, batch 1, two denoising steps. `fake=True` runs every mode on fake tensors: the ledger
# counts every byte a GPU would hold (rounded to the CUDA allocator's 512-byte blocks) and the
# engines' marks count every byte they move in, but nothing is allocated: no values, no times,
# nothing pinned, and each op takes its CPU path (`labkit.fake` says where that differs from CUDA).
# The text encoders (T5-XXL, CLIP) and the VAE are not modelled: the prompt's embeddings are the
# input, so the pipeline's one component is the denoiser, and model-level offload has nothing else
# to swap it with.

# %%
flux = lab.run(lab.Config(model="flux-dev", fake=True, dtype="bfloat16", latent_tokens=4096, text_len=512, steps=2))
traced = {r.mode: r for r in flux.runs}
real_scale = tables.steps_table(flux.runs)
display(real_scale)
fig4, axes4 = plt.subplots(1, 2, figsize=(12, 3.4), dpi=110, layout="constrained", sharey=True)
for ax, mode in zip(axes4, ("none", "layerwise")):
    plot.plot_timeline(traced[mode].ledger.timeline().window("denoise"), ax=ax, legend=(mode == "none"),
                       max_points=400, unit="GiB", ymax_bytes=traced["none"].summary["peak_device_bytes"],
                       title=f"Flux.1-dev, {mode}: two denoising steps (traced on fake tensors)")
    ax.set_xlabel("ledger events")
notebook.show(fig4, alt="Device bytes of Flux.1-dev over two denoising steps, traced on fake tensors, all "
                        "resident and with layerwise offload")

# %%
weights = plan.flat_bytes(config)
notebook.publish(
    nb, tables={"modes": modes, "host": host, "depth": depth, "overlap": overlap, "real_scale": real_scale,
                **{f"residency_{mode}": table for mode, table in residency.items()}},
    figures={"timelines": fig, "gantt": fig2, "depth": fig3, "real_scale": fig4},
    summary=result.summary(), depth_sweep={str(k): s for k, s in sweep.items()}, overlap_ms=overlap_ms,
    copy_lane_transfer_ms=copy_ms, block_bytes=weights["block"], shell_bytes=weights["shell"],
    real_scale={mode: run.summary for mode, run in traced.items()})
