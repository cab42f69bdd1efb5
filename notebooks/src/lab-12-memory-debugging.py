# %% [markdown]
# # Lab 12 · Memory debugging, measured
#
# This notebook runs the Lab 12 starter, `code/lab-12-memory-debugging/memory_debugging.py`, and
# draws what the memory ledger recorded. It is executed by `scripts/run_notebooks.py`, never
# edited by hand; the table below says where and on which code.
#
# What to look for:
#
# 1. Two leaking training loops and the fixed one, on one scale: the leaks climb step after step,
#    the fixed loop is flat.
# 2. The growth per step in bytes, measured by the ledger, next to the growth derived from the
#    shapes. On CPU they are equal to the byte.
# 3. The live-tensor table: what grew in the last step, by the line of code that allocated it
#    (inside the model) and by the line of the lab that called the model.
# 4. Allocated against reserved with and without `expandable_segments`, and
#    `torch.OutOfMemoryError` messages read number by number: measured on a GPU; on a CPU,
#    simulated by Lab 16's model of the caching allocator.

# %%
import matplotlib.pyplot as plt
from IPython.display import display

from labkit import labs, notebook, plot

nb = notebook.setup(12)
lab = nb.lab
scenarios = labs.load(12, "cuda_scenarios")
tables = labs.load(12, "leak_report")  # the tables the command line prints
# small on a CPU, GPU-sized on a GPU: the same code either way
size = dict(width=1024, layers=8, heads=16, seq_len=512, batch_size=8, steps=4) if nb.on_gpu else {}
config = lab.Config(device=nb.device.type, top=12, snapshot=nb.results / "memory_snapshot.pickle" if nb.on_gpu
                    else None, **size)

# %% [markdown]
# ## Three loops under the ledger
#
# `lab.run` is the function the command line calls. Each loop trains for a few steps and, after
# every step, computes a monitoring loss on a held-out batch. The three loops differ in what they
# get wrong: `leak-losses` computes the monitoring loss with autograd on and keeps the losses as
# tensors, `leak-activations` keeps every block's output from a forward hook, `fixed` computes the
# monitoring loss under `torch.no_grad()` and keeps numbers. Each loop is read after every step
# while what it kept is still alive, then dropped before the next loop starts. On a GPU the same
# call also runs the allocator scenarios, each in a fresh process.
#
# Every allocation and free, stacked by category, on one scale. Each step has four bands: the
# training forward, backward, the optimizer, and a second forward band for the monitoring loss.

# %%
result = lab.run(config)
leaks = result.leaks
ymax = max(max(leak.timeline.device_total()) for leak in leaks.values())
fig, axes = plt.subplots(len(leaks), 1, figsize=(10, 9), dpi=110, layout="constrained")
for i, (ax, (name, leak)) in enumerate(zip(axes, leaks.items())):
    plot.plot_timeline(leak.timeline, ax=ax, ymax_bytes=ymax, legend=(i == 0),
                       title=f"{name}: {config.steps} steps on {nb.device.type} (measured by the ledger)")
notebook.show(fig, alt="Three stacked memory timelines on one scale: leak-losses climbs every step, leak-"
                       "activations climbs slightly, fixed stays level")

# %% [markdown]
# ## Growth per step: measured against derived
#
# The derived figures (`lab.expected_growth`; Lab 01 counts what TinyGPT saves for backward on
# CPU, `tinygpt_activation_bytes`):
#
# - `leak-losses`: each kept monitoring loss pins its whole graph, all it saved for a backward that
#   never comes, plus the 4-byte training loss, whose graph `backward()` already emptied.
# - `leak-activations`: one fp32 block output per layer, layers x batch x seq x width x 4 B.
# - `fixed`: nothing.
#
# The dashed lines start at the first step and add the derived growth per step
# (`Leak.derived_after_step`).

# %%
growth = tables.growth_table(result)
display(growth)
fig2, ax = plt.subplots(figsize=(8, 3.8), dpi=110, layout="constrained")
colors = {"leak-losses": plot.SERIES[3], "leak-activations": plot.SERIES[1], "fixed": plot.SERIES[0]}
for name, leak in leaks.items():
    steps = range(len(leak.after_step))
    ax.plot(steps, [b / 2**20 for b in leak.live_after_step], marker="o", color=colors[name], label=f"{name} (measured)")
    if (derived := leak.derived_after_step()) is not None:
        ax.plot(steps, [b / 2**20 for b in derived], ls="--", lw=1, color=plot.INK,
                label="derived" if name == "leak-losses" else None)
ax.set(xlabel="step", ylabel="live device MiB after the step", title="Live bytes after each step")
ax.legend(fontsize=8)
ax.grid(alpha=0.3)
notebook.show(fig2, alt="Live device bytes after each step for the three training loops, measured, with the "
                        "derived growth as dashed lines")

# %% [markdown]
# ## The tool: what grew, by the line that allocated it
#
# `labkit.stacks.live_by_origin(ledger)` groups what is alive by category, by the line that
# allocated it and, when that line is inside the model (labkit's `models.py`), by the lab line
# that called the model (the ledger runs with `stacks=True`). Comparing the readings after the last
# two steps (`lab.what_grew`) leaves only what the loop gained in one step: the leak, where in the
# model each piece was made, and the lab line it came from.

# %%
grew = tables.grew_table(result)
display(grew)

# %% [markdown]
# What is alive at the end of the last step of `leak-losses` and of `fixed`. Parameters show the
# line that registered them with the ledger (they existed before it started). `fixed` holds no
# graph: its only activations are the two 4-byte losses.

# %%
alive_losses = tables.origin_table(leaks["leak-losses"].after_step[-1], config.top)
alive_fixed = tables.origin_table(leaks["fixed"].after_step[-1], config.top)
display(alive_losses, alive_fixed)

# %% [markdown]
# ## Fragmentation: allocated against reserved
#
# `cuda_scenarios.changing_batch` grows the batch by one sample per iteration, once with the default
# caching allocator and once with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, each in a
# fresh process (the allocator reads the setting when CUDA starts). A CPU has no caching allocator:
# there, `cuda_scenarios.simulated` traces the same function on fake tensors and replays it through
# Lab 16's model of the allocator (`result.simulated` says so).

# %%
fragmentation = scenarios.fragmentation_table(result.fragmentation)
display(fragmentation)
figures = {"timelines": fig, "growth": fig2}
if nb.on_gpu:
    figures["fragmentation"], axes3 = plt.subplots(1, 2, figsize=(11, 3.6), dpi=110, layout="constrained",
                                                   sharey=True)
    for ax3, r in zip(axes3, result.fragmentation):
        batch = [row["batch"] for row in r["rows"]]
        ax3.plot(batch, [row["allocated"] / 2**30 for row in r["rows"]], marker="o", label="memory_allocated")
        ax3.plot(batch, [row["reserved"] / 2**30 for row in r["rows"]], marker="s", label="memory_reserved")
        ax3.set(title=r["alloc_conf"], xlabel="batch size", ylabel="GiB")
        ax3.grid(alpha=0.3)
        ax3.legend(fontsize=8)
    notebook.show(figures["fragmentation"], alt="Allocated and reserved GiB against batch size under two "
                                                "allocator settings, measured on a GPU")

# %% [markdown]
# ## An out-of-memory error, caught and read
#
# `cuda_scenarios.oom_experiments` caps the allocator with `set_per_process_memory_fraction` (so
# the error is cheap on a big GPU) and, in fresh processes: fills it with live buffers; fragments
# it so that half is free but not in one piece; and repeats the fragmented pattern with
# expandable segments. Every `torch.OutOfMemoryError` message is read by `oom_reader.read_oom`,
# and `oom_reader.next_levers` names the pattern. On a CPU the messages are the ones Lab 16's model
# of the allocator gives for the same allocations (simulated).

# %%
oom = scenarios.oom_table(result.oom)
oom_numbers = scenarios.oom_numbers_table(result.oom)
display(oom, oom_numbers)

# %% [markdown]
# ## At real scale: Llama-3-8B, traced on fake tensors
#
# The same loops, on the zoo's Llama-3-8B: 4096 tokens, batch 1, each forward under bf16 autocast
# (fp32 weights, gradients and AdamW state), foreach AdamW (what CUDA runs by default), two steps.
# `fake=True` traces them on fake tensors: the ledger, with stacks, counts every byte a GPU would
# hold (rounded to the CUDA allocator's 512-byte blocks) and remembers the line that allocated it,
# but nothing is allocated, so there are no losses to print (`.item()` reads NaN) and no times.
# Each op takes its CPU path (`labkit.fake` says where that differs from CUDA). First the fixed
# loop, read at its peak (`Leak.at_peak`: the ledger's record read back to its highest row); then
# the loop that keeps its monitoring loss as a tensor, read after each step.

# %%
at_8b = dict(model="llama-3-8b", fake=True, seq_len=4096, batch_size=1, precision="bf16", steps=2)
step_8b = lab.run(lab.Config(**at_8b, scenario="fixed")).leaks["fixed"]
leak_8b = lab.run(lab.Config(**at_8b, scenario="leak-losses")).leaks["leak-losses"]
real_scale = tables.origin_table(step_8b.at_peak, config.top)
real_scale_grew = tables.origin_table(leak_8b.grew(config.top), config.top)
display(real_scale, real_scale_grew)
ymax_8b = max(max(leak.timeline.device_total()) for leak in (step_8b, leak_8b))
fig4, axes4 = plt.subplots(2, 1, figsize=(10, 6), dpi=110, layout="constrained")
for ax, (name, leak) in zip(axes4, (("fixed", step_8b), ("leak-losses", leak_8b))):
    plot.plot_timeline(leak.timeline, ax=ax, ymax_bytes=ymax_8b, unit="GiB", legend=(name == "fixed"),
                       title=f"Llama-3-8B, {name}: 2 steps (traced on fake tensors)")
figures["real_scale"] = fig4
notebook.show(fig4, alt="Two memory timelines of Llama-3-8B training, traced, on one scale: the fixed loop, and "
                        "one that keeps a monitoring loss")

# %%
notebook.publish(
    nb, tables={"growth": growth, "grew": grew, "alive_losses": alive_losses, "alive_fixed": alive_fixed,
                "fragmentation": fragmentation, "oom": oom, "oom_numbers": oom_numbers,
                "real_scale": real_scale, "real_scale_grew": real_scale_grew},
    figures=figures, summary=result.summary(),
    graph_growth=leaks["leak-losses"].growth_per_step[-1],
    block_outputs_growth=leaks["leak-activations"].growth_per_step[-1],
    real_scale={"peak": step_8b.timeline.peak(), "peaks_by_phase": step_8b.timeline.peaks_by_phase(),
                "kept_graph": leak_8b.growth_per_step[-1], "live_after_step": leak_8b.live_after_step})
