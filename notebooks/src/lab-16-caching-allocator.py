# %% [markdown]
# # Lab 16 · The caching allocator, simulated
#
# This notebook runs the Lab 16 starter, `code/lab-16-caching-allocator/caching_allocator.py`, and the
# validation beside it (`validation.py`). It is executed by `scripts/run_notebooks.py`, never edited by
# hand; the table below says where and on which code.
#
# Every reserved byte below is **simulated**: the allocations and frees a memory ledger recorded (on
# fake tensors, at real size) are replayed through `allocator_model.py`, PyTorch's CUDA caching
# allocator written rule by rule from its source. No GPU was used. What the published figures say
# is cited, with its source.
#
# What to look for:
#
# 1. A request becomes a block, and a block lives in a segment: 1 byte reserves 2 MiB.
# 2. Lab 12's growing batch: with the default allocator, reserved climbs far above what the tensors
#    hold; with expandable segments it stays on it. The segment pictures show why.
# 3. Lab 12's fragmented cache: the out-of-memory message a GPU prints, read by Lab 12's reader.
# 4. Llama-3.1-8B under FSDP2, as torchtitan trains it: the trace, the simulation, and what torchtitan
#    published for the same run.

# %%
import matplotlib.pyplot as plt
from IPython.display import display

from labkit import labs, notebook, plot
from labkit.table import Table

nb = notebook.setup(16)
lab = nb.lab
replay, validation = labs.load(16, "replay"), labs.load(16, "validation")
scenarios = labs.load(12, "cuda_scenarios")

# %% [markdown]
# ## What a request becomes
#
# `allocator_model.round_size` and `segment_size`: the block a request gets (512-byte multiples), its
# pool (small up to 1 MiB), the segment cudaMalloc makes when no cached block fits (2 MiB, 20 MiB, or
# the request rounded to 2 MiB), and the block with `roundup_power2_divisions:4`.

# %%
sizes = lab.sizes_table()
display(sizes)

# %% [markdown]
# ## Lab 12's growing batch, replayed
#
# `scenarios.changing_batch` is Lab 12's GPU workload: each iteration keeps 8 pairs of buffers of
# n x 2 MiB and n x 8 MiB, n one larger than the last time. Here it runs on fake tensors under a
# ledger, and the ledger's events go through the model with the default allocator and with
# `expandable_segments:True`.

# %%
batch = lab.run(lab.Config(device="cpu", workload="changing-batch"))
batch_runs, batch_iterations = lab.runs_table(batch), lab.iterations_table(batch)
display(batch_runs, batch_iterations)

# %% [markdown]
# The segments at the moment the tensors hold the most, on one scale: each box is a segment (a
# cudaMalloc, or the mapped part of an expandable segment), coloured where a live tensor is,
# hatched where a cached block waits for a request that fits.

# %%
events = lab.changing_batch(batch.config)
pictures = []
for name, options in lab.settings(batch.config):
    whole = replay.replay(events, options)
    pictures.append((name, replay.replay(events, options, until=replay.peak_at(whole))))
row_bytes = max(p.peak_reserved for _, p in pictures) // 8
fig_segments, axes = plt.subplots(2, 1, figsize=(10, 6), layout="constrained")
for ax, (name, picture) in zip(axes, pictures):
    plot.plot_segments(picture.segments(), ax=ax, row_bytes=row_bytes, rows=8,
                       title=f"{name}: reserved {picture.peak_reserved / 2**30:.2f} GiB (simulated)")
notebook.show(fig_segments, alt="The cached segments of Lab 12's changing batch at its peak, simulated, one row of "
              "blocks per segment: with the default settings many segments hold cached blocks no request fits; "
              "with expandable segments one segment grows and holds the live tensors",
              caption="Notice the hatched blocks of the default setting: reserved bytes no tensor uses.")

# %% [markdown]
# ## Lab 12's fragmented cache, and the message a GPU prints
#
# One 1,020 MiB block, cached, carved into 20 MiB pieces; every other piece freed; 40 MiB asked for,
# under a 1 GiB cap (`set_per_process_memory_fraction`). The model gives the error; Lab 12's reader
# names each number and the lever.

# %%
frag = lab.run(lab.Config(device="cpu", workload="fragmented"))
frag_runs = lab.runs_table(frag)
oom = scenarios.oom_numbers_table([r for r in lab.as_lab12(frag) if r["message"]])
display(frag_runs, oom)
print(next(str(r.replay.oom) for r in frag.runs if r.replay.oom))

# %% [markdown]
# ## Llama-3.1-8B under FSDP2, as torchtitan ran it
#
# torchtitan's December 2024 benchmark, Table 1: Llama 3.1 8B, FSDP over 8 H100, local batch 2 x
# 8,192 tokens, selective op checkpointing, bf16 parameters with fp32 reduction; its launcher sets
# `expandable_segments:True`. Lab 13 traces rank 0's step (torchtitan's checkpointing policy from Lab
# 04), the model replays it twice (the second step meets the cache the first left).

# %%
checked = [validation.check(p, keep=p.key == "titan-8b-fsdp8") for p in validation.PUBLISHED if p.step]
titan = next(c for c in checked if c["key"] == "titan-8b-fsdp8")
r = titan.pop("replay")
fig_lead, ax = plt.subplots(figsize=(10, 4), layout="constrained")
x = range(len(r.reserved))
ax.plot(x, [v / 2**30 for v in r.traced], label="traced: live tensors (ledger)", color=plot.CATEGORY_COLORS["activations"])
ax.plot(x, [v / 2**30 for v in r.reserved], label="simulated: reserved (allocator model)",
        color=plot.CATEGORY_COLORS["parameters"])
ax.axhline(titan["published_bytes"] / 2**30, ls="--", color=plot.CATEGORY_COLORS["temporaries"],
           label="published: torchtitan's max reserved")
ax.set(xlabel="allocator events (two steps)", ylabel="GiB", ylim=(0, titan["published_bytes"] / 2**30 * 1.15))
ax.legend(loc="lower right", fontsize=8)
notebook.show(fig_lead, alt="Two steps of Llama-3.1-8B under FSDP2 on 8 GPUs as torchtitan ran it: the traced live "
              "bytes, the simulated reserved bytes above them, and torchtitan's published maximum reserved as a "
              "dashed line", caption="Notice the simulated reserved line ends near the published figure, well above "
              "the live tensors.")
pools = Table(["pool (stream)", ("reserved", "bytes")], [[k, v] for k, v in sorted(r.by_stream.items())], unit="GiB")
display(pools)

# %% [markdown]
# ## How close are the traces to real GPUs?
#
# Every published figure of `validation.PUBLISHED`: the ones Lab 13 can express, traced and simulated
# with the allocator setting their run used; the others, with the reason. The error is the simulation
# against the figure; beside it, Lab 13's former estimate (the traced peak plus 5 %).

# %%
published = validation.table(checked)
stats = validation.summary(checked)
display(published)
print(stats)

# %%
notebook.publish(
    nb, tables={"sizes": sizes, "batch_runs": batch_runs, "batch_iterations": batch_iterations, "frag_runs": frag_runs,
                "oom": oom, "pools": pools, "published": published},
    figures={"lead": fig_lead, "segments": fig_segments},
    batch=batch.summary(), fragmented=frag.summary(), validation=stats,
    checked=[{k: v for k, v in c.items() if k != "replay"} for c in checked])
