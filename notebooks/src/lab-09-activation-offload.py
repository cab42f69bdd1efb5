# %% [markdown]
# # Lab 09 · Activation offload, measured
#
# This notebook runs the Lab 09 starter, `code/lab-09-activation-offload/activation_offload.py`,
# and measures five ways of keeping the tensors that backward needs: on the device (`none`), on
# the host through PyTorch's `save_on_cpu`, on the host through the lab's streamed hooks, inside
# checkpointed blocks (`checkpoint`, Lab 04's full checkpointing), and checkpointing with the block
# inputs streamed to the host (`checkpoint+streamed`). It is executed by
# `scripts/run_notebooks.py`, never edited by hand; the table below says where and on which code.
#
# **How to read a CPU run.** On a CPU-only machine the "device" and the host are the same RAM.
# The ledger keeps them apart by label: every buffer the offload hooks allocate on the host is
# allocated inside `marks.category("host_copies")` and counted on the host side; everything else
# is device memory. The byte counts are exact. The times are not shown: a CPU has no copy engine
# beside its cores, so a CPU run says nothing about whether a transfer hides under compute.
#
# **Activation peak** is the highest value, over forward and backward, of the ledger's device
# `activations` + `temporaries` (tensors fetched back or recomputed in backward are born there, so
# they are temporaries). **Kept after forward** is the device `activations` when forward ends.

# %%
import matplotlib.pyplot as plt
from IPython.display import display

from labkit import labs, notebook, plot
from labkit.table import Table, format_bytes, pick_unit

nb = notebook.setup(9)
lab = nb.lab
derived = labs.load(9, "offload_checks")
# on a CPU the command line's defaults (so `run_cpu` prints these bytes) and one timed step (CPU
# times are not shown); GPU-sized on a GPU
size = dict(width=1024, layers=32, heads=16, seq_len=1024, batch_size=8, steps=10) if nb.on_gpu else dict(steps=1)
config = lab.Config(device=nb.device.type, **size)
block_input = config.block_input_bytes  # one fp32 block input, I_blk

# %% [markdown]
# ## Five modes, one step each under the ledger
#
# `lab.run` is what the command line calls: a reference step with no hooks and no checkpointing,
# then for each mode one step under the memory ledger, one plain step (gradients without the
# ledger), and finally `steps` timed steps, modes interleaved. The modes table shows the step times
# on a GPU only.

# %%
result = lab.run(config)
R = result.results
modes = lab.modes_table(result, times=nb.on_gpu)
display(modes)

# %% [markdown]
# ## Gradients: with and without the hooks, with and without the ledger
#
# The ledger is a `TorchDispatchMode`; the hooks run inside it; checkpointing adds its own
# saved-tensor hooks inside ours. None of them may change a number. Dropout is on, so equal
# gradients also mean equal random masks.

# %%
gradients = lab.gradients_table(result)
display(gradients)

# %% [markdown]
# ## The timelines, on one scale
#
# Device bytes by category (stacked), and the bytes labelled `host_copies` as a dashed line, one
# panel per mode, forward and backward only.

# %%
def draw_timelines(result, evidence):
    """One panel per mode of ``result``: device bytes by category, host copies dashed, one scale."""
    tls = {m: result.ledgers[m].timeline().window("forward", "backward") for m in result.results}
    top = max(max(max(tl.device_total()), max(tl.host["host_copies"])) for tl in tls.values())
    unit, _ = pick_unit(top)
    figure, axes = plt.subplots(len(tls), 1, figsize=(10, 2.3 * len(tls)), dpi=110, layout="constrained")
    for ax, (m, tl) in zip(axes, tls.items()):
        r = result.results[m]
        plot.plot_timeline(tl, ax=ax, overlay={"host copies": tl.host["host_copies"]}, ymax_bytes=top,
                           legend=(m == "none"), max_points=260, unit=unit,
                           title=f"{m}: activation peak {format_bytes(r['activation_peak_bytes'])}, host copies up to "
                                 f"{format_bytes(r['host_peak_bytes'])} ({evidence})")
        ax.set_ylabel(f"live bytes ({unit})")
        if ax is not axes[-1]:
            ax.set_xlabel("")
    return figure


timelines = draw_timelines(result, f"measured, {nb.device.type}")
notebook.show(timelines, alt="Stacked memory timelines of one step per activation-offload mode on one scale, "
                             "with the host copies as a dashed line")

# %% [markdown]
# ## Formula against measurement
#
# With checkpointing, the hooks see only what `checkpoint` keeps: each block's input, I_blk
# bytes. The last k_keep stay on the device; the other L − k_keep go to the host in forward. In backward the first
# recompute (of the last block) is where the activation peak sits. At that moment checkpointing
# alone holds all L inputs; with the streamed hooks the device holds the kept one(s) and the k_ahead
# inputs fetched ahead, max(k_keep, 1) + k_ahead in all (`offload_checks.blocks_held`). So:
#
# - host copies after forward = (L − k_keep)·I_blk,
# - kept after forward = checkpoint's kept − (L − k_keep)·I_blk,
# - activation peak = checkpoint's peak − (L − max(k_keep, 1) − k_ahead)·I_blk.
#
# The other checks compare the ledger with the hooks' own count of the bytes they copied, and the
# bytes `save_on_cpu` moves with what the streamed hooks move when they filter nothing. On a GPU a
# tensor whose copy out has not landed is read from the device, so fewer bytes may come back.

# %%
checks = derived.checks(result)
display(checks)

# %% [markdown]
# ## Depth: checkpointing grows by I_blk per block, checkpointing + streamed does not
#
# From the formula above, checkpointing's activation peak grows by one block input I_blk per
# block, while with the inputs streamed the device holds max(k_keep, 1) + k_ahead of them whatever the depth. So the
# reduction against checkpointing alone, 1 − (C′ + (k_keep + k_ahead)·I_blk) / (C′ + L·I_blk), grows with depth, with
# C′ what the peak holds besides the block inputs (the head and loss, one block's recompute). The
# derived lines use C′ from the shallowest run only (`offload_checks.depth_rule`); the points are
# measured.

# %%
shape = (dict(width=1024, heads=16, seq_len=1024, batch_size=4) if nb.on_gpu
         else dict(width=32, heads=2, seq_len=32, batch_size=4, vocab=64))
narrow = lab.Config(device=nb.device.type, **shape)
held = derived.blocks_held(narrow.keep_last, narrow.prefetch)
depth_rule = derived.depth_rule(derived.depth_sweep(narrow, nb.device), narrow.block_input_bytes,
                                narrow.keep_last, narrow.prefetch)
depth = derived.depth_table(depth_rule, held)
display(depth)

# %%
depths, sweep = list(depth_rule["measured"]), depth_rule["measured"]
grid = list(range(depths[0], depths[-1] + 1))
depth_figure, (ax, ax2) = plt.subplots(1, 2, figsize=(11.5, 3.8), dpi=110, layout="constrained")
ax.plot(grid, [derived.depth_peak(depth_rule, L) / 2**20 for L in grid], color=plot.SERIES[0], lw=1.2, ls="--",
        label="derived: C′ + L·I_blk")
ax.plot(depths, [sweep[L]["checkpoint"] / 2**20 for L in depths], "o", color=plot.SERIES[0], label="checkpoint")
ax.plot(grid, [derived.depth_peak(depth_rule, L, held) / 2**20 for L in grid], color=plot.SERIES[2], lw=1.2, ls="--",
        label="derived: C′ + (k_keep + k_ahead)·I_blk")
ax.plot(depths, [sweep[L]["checkpoint+streamed"] / 2**20 for L in depths], "s", color=plot.SERIES[2],
        label="checkpoint+streamed")
ax.set(xlabel="blocks L", ylabel="activation peak (MiB)", title=f"points measured ({nb.device.type}), lines derived",
       ylim=(0, None))
ax.legend(fontsize=8)
ax2.plot(grid, [100 * (1 - derived.depth_peak(depth_rule, L, held) / derived.depth_peak(depth_rule, L)) for L in grid],
         color=plot.SERIES[2], lw=1.4, label="derived reduction")
ax2.plot(depths, [100 * (1 - sweep[L]["checkpoint+streamed"] / sweep[L]["checkpoint"]) for L in depths], "s",
         color=plot.SERIES[2], label="measured")
ax2.axhline(50, color=plot.SERIES[7], lw=1, ls=":", label="50 %: the GPU run's target")
ax2.set(xlabel="blocks L", ylabel="% lower than checkpoint alone", title="activation peak: reduction vs depth",
        ylim=(0, 100))
ax2.legend(fontsize=8, loc="lower right")
for a in (ax, ax2):
    a.grid(alpha=0.3)
notebook.show(depth_figure, alt="Left: activation peak against depth for checkpoint and checkpoint+streamed, "
                                "measured points on derived lines. Right: the reduction against checkpointing "
                                "alone, with the 50 % line")

# %% [markdown]
# ## The two knobs: keep-last and min-bytes
#
# **Keep-last k_keep**: the last k_keep saved tensors that would be offloaded stay on the device. They are
# the first that backward reads, so moving them out and straight back is traffic for nothing. In
# `streamed`, the last two saved tensors are the same one: `cross_entropy` saves the log-softmax
# output twice (for its own backward and for the loss's), so offloading only one of them frees no
# device byte. **min-bytes**: saved tensors smaller than this stay (layer-norm statistics, position
# indices): each would cost a transfer for almost no memory.

# %%
keep_last = derived.keep_last_table(config, nb.device)
min_bytes = derived.min_bytes_table(config, nb.device, (0, 1024, 4096, block_input + 1))
display(keep_last, min_bytes)

# %% [markdown]
# ## Allocated against the ledger (CUDA only)
#
# On a GPU, `lab.run` records `max_memory_allocated` for each mode's ledger step; the ledger's peak
# should be within a few percent of it, and the step times become meaningful. On a CPU there is no
# caching allocator and no copy engine, and the table says so with dashes.

# %%
display(Table(["mode", ("ledger peak", "bytes"), ("max_memory_allocated", "bytes"), ("ratio", "float:3")],
              [[m, r["peak_bytes"], (r["cuda"] or {}).get("max_memory_allocated"),
                (r["cuda"] or {}).get("ledger_over_allocator")] for m, r in R.items()]))

# %% [markdown]
# ## At real scale: Llama-3-8B at 4k and 16k tokens
#
# The same `lab.run`, the same five modes and knobs, on Llama-3-8B (the zoo's `llama-3-8b`) in
# bf16, batch 1, at 4,096 and 16,384 tokens: one forward and backward each, no optimizer. Every
# figure here is **traced on fake tensors** (`--fake`): each op computes shapes and storages and
# allocates nothing; the ledger counts the storages, rounded to the CUDA allocator's 512-byte
# blocks. The trace follows the CPU dispatch (`labkit/fake.py`; CPU flash attention keeps what
# CUDA's keeps, less two 8-byte RNG tensors per layer) and leaves out the CUDA context, cuBLAS
# workspaces and allocator fragmentation. The streamed hooks pin their host buffers on CUDA only and
# `save_on_cpu` when a CUDA driver is present: on a CPU-only build nothing is pinned in a trace; the
# bytes are the same. No values (no gradient check), no time.

# %%
traced = {s: lab.run(lab.Config(model="llama-3-8b", fake=True, dtype="bfloat16", seq_len=s, batch_size=1))
          for s in derived.REAL_SCALE_LENGTHS}
real_scale = derived.real_scale_table(traced)
display(real_scale)
longest = max(traced)
real_timelines = draw_timelines(traced[longest], f"traced, Llama-3-8B, {longest:,} tokens")
for ax in real_timelines.axes:  # GiB: the largest value picks the unit
    ax.axhline(80, color=plot.SERIES[3], lw=1.0, ls="--", zorder=5)
    ax.text(0, 80, " 80 GiB: one H100", color=plot.SERIES[3], fontsize=8, va="bottom")
notebook.show(real_timelines, alt="Device timelines with host copies of the five modes for Llama-3-8B at the "
                                  "longest sequence, traced, against one H100's 80 GiB")

# %%
notebook.publish(
    nb, tables={"modes": modes, "gradients": gradients, "checks": checks, "depth": depth, "keep_last": keep_last,
                "min_bytes": min_bytes, "real_scale": real_scale},
    figures={"timelines": timelines, "depth": depth_figure, "real_scale": real_timelines},
    summary=result.summary(), depth=depth_rule, blocks_held=held,
    real_scale={"model": "llama-3-8b", "dtype": "bfloat16", "batch_size": 1, "traced": lab.TRACED,
                "tokens": derived.real_scale(traced)})
