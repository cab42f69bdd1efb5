# %% [markdown]
# # Lab 08 · Offload and memory saving, measured
#
# This notebook runs the Lab 08 starter, `code/lab-08-offload-memory-saving/offload.py`, on the
# toy diffusion pipeline (text encoder, a denoiser run for several steps, decoder) under each
# placement of the weights, and reads every run as a residency schedule: what is on the device,
# what stays on the host, what moves, and when. It is executed by `scripts/run_notebooks.py`.
#
# On a CPU-only machine the "device" and the host are the same RAM. The ledger still tells the two
# sides apart (host masters are labelled `host_copies`), so every byte count below is exact; the
# times are CPU times and the transfers are memcpy, so nothing here says how fast PCIe is.

# %%
import os
import sys
from pathlib import Path

ROOT = Path(os.environ.get("INFRALAB_ROOT") or next(
    p for p in [Path.cwd(), *Path.cwd().parents] if (p / "code" / "labkit").is_dir()))
sys.path.insert(0, str(ROOT / "code"))

import matplotlib.pyplot as plt  # noqa: E402

from labkit import notebook as nbk  # noqa: E402
from labkit import plot, provenance  # noqa: E402

lab = nbk.load_lab("lab-08-offload-memory-saving/offload.py")
plan = nbk.load_lab("lab-08-offload-memory-saving/make_plan.py")
DEVICE = lab.pick_device(nbk.device_name())
OUT = nbk.results_dir(lab.LAB)
ON_GPU = DEVICE.type == "cuda"
SIZE = (["--width", "1024", "--heads", "16", "--denoiser-layers", "16", "--latent-tokens", "4096",
         "--steps", "4", "--dtype", "bfloat16", "--repeats", "3"]
        if ON_GPU else ["--repeats", "2"])  # the timed run: one warm-up, one measured
BASE = ["--device", DEVICE.type, *SIZE]
print("device:", DEVICE, "| results go to:", OUT.relative_to(OUT.parents[1]))

# %% tags=["provenance"]
record = provenance.collect(lab.LAB, DEVICE)
nbk.show_provenance(record)

# %% [markdown]
# ## Four placements of the same weights
#
# One process runs every mode on the same pipeline and the same inputs. `max |diff|` compares each
# output with the all-resident one: offload moves weights, it must not change a single number.

# %%
args = lab.parse_args([*BASE, "--mode", "all"])
runs = {r.mode: r for r in lab.run_all(args)}
none = runs["none"].summary
# Step times come from a second run of each mode without the memory ledger (the ledger's dispatch
# mode costs time on every op); they are shown from GPU runs only: on a CPU the "transfers" are
# memcpy on the same cores.
rows = ["| mode | peak device bytes | vs resident | denoiser blocks resident | host to device per run | "
        "device to host | max abs diff |" + (" time per denoising step (run without the ledger) |" if ON_GPU else ""),
        "|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if ON_GPU else "")]
for mode, run in runs.items():
    s = run.summary
    name = f"layerwise (k={s['prefetch_depth']})" if mode == "layerwise" else mode
    rows.append(f"| {name} | {plot.format_bytes(s['peak_device_bytes'])} | "
                f"{s['peak_device_bytes'] / none['peak_device_bytes']:.2f}x | {s['max_resident_blocks']} of "
                f"{s['denoiser_blocks']} | {plot.format_bytes(s['h2d_bytes'])} | {s['d2h_bytes']} B | "
                f"{s['max_abs_diff']:.1e} |" + (f" {s['step_ms']:.2f} ms |" if ON_GPU else ""))
modes_table = "\n".join(rows)
nbk.show_markdown(modes_table)
peak = {m: r.summary["peak_device_bytes"] for m, r in runs.items()}
assert all(r.summary["max_abs_diff"] == 0 for r in runs.values()) or ON_GPU
assert peak["sequential"] <= peak["layerwise"] < peak["model"] < peak["none"], peak
assert all(r.summary["d2h_bytes"] == 0 for r in runs.values())

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
host_rows = ["| mode | weights on the host | arena (measured: ledger `host_copies`) | vs weights | "
             "one pinned buffer per unit would take | vs weights |", "|---|---:|---:|---:|---:|---:|"]
for mode, run in runs.items():
    s = run.summary
    if not s["host_weight_bytes"]:
        continue
    host_rows.append(f"| {mode} | {plot.format_bytes(s['host_weight_bytes'])} | {plot.format_bytes(s['host_bytes'])} | "
                     f"{s['host_bytes'] / s['host_weight_bytes']:.2f}x | "
                     f"{plot.format_bytes(s['host_bytes_one_buffer_per_unit'])} | "
                     f"{s['host_bytes_one_buffer_per_unit'] / s['host_weight_bytes']:.2f}x |")
host_table = "\n".join(host_rows)
nbk.show_markdown(host_table)
if not ON_GPU:  # on a GPU the masters are pinned and the ledger sees them too; on a CPU it is exact
    assert all(r.summary["peak_host_copy_bytes"] == r.summary["host_bytes"] for r in runs.values())
assert all(r.summary["host_bytes"] < r.summary["host_bytes_one_buffer_per_unit"] for m, r in runs.items() if m != "none")

# %% [markdown]
# ## Memory timelines, one per mode
#
# Each panel is the ledger's record of one pipeline run (encode, the denoising steps, decode),
# device bytes by category on the same scale. The engines open the ledger's `transfer` phase around
# every copy to the device: the ticks along the bottom mark them. Host masters are not drawn: they
# live on the host.

# %%
import dataclasses  # noqa: E402

fig, axes = plt.subplots(2, 2, figsize=(12, 6.4), dpi=110, layout="constrained")
for ax, (mode, run) in zip(axes.flat, runs.items()):
    tl = run.ledger.timeline().window("encode", "denoise", "decode")
    copies = [span.start for span in tl.spans if span.name == "transfer"]
    bands = dataclasses.replace(tl, spans=[span for span in tl.spans if span.name != "transfer"])
    ax.vlines(copies, 0.0, 0.05, transform=ax.get_xaxis_transform(), color="#2b6a2b", lw=0.8, zorder=5,
              label="a copy in (ledger phase: transfer)")  # drawn first, so the legend lists it
    plot.plot_timeline(bands, ax=ax, legend=(mode == "model"), max_points=160, unit="MiB",
                       ymax_bytes=none["peak_device_bytes"],
                       title=f"{mode}: peak {plot.format_bytes(run.summary['peak_device_bytes'])}, "
                             f"{len(copies)} copies in")
    ax.set_xlabel("ledger events")
plot.save(fig, OUT / "timelines.svg")

# %% [markdown]
# ## The residency schedule of layerwise offload
#
# Per pipeline stage: what reached the device, what never left the host, the bytes moved in, and
# the peak. The same table for every mode is in `code/lab-08-offload-memory-saving/offload_plan.md`,
# which `make_plan.py` writes from a run.

# %%
residency_table = "\n".join(plan.mode_table(runs["layerwise"], args.steps))
nbk.show_markdown(residency_table)

# %% [markdown]
# ## Compute stream against copy stream
#
# Each bar is a transfer (hatched) or a block's compute, coloured by stage. On a GPU the
# layerwise copies run on their own stream, under the compute of the block before. On a CPU there
# is one stream of execution: every copy sits between two computes, which is exactly what
# overlap exists to remove.

# %%
fig2, (ax_seq, ax_layer) = plt.subplots(2, 1, figsize=(11, 4.6), dpi=110, layout="constrained")
for ax, mode in ((ax_seq, "sequential"), (ax_layer, "layerwise")):
    bars = [b for b in runs[mode].recorder.intervals() if b.stage == "denoise"]
    plot.plot_gantt(bars, ax=ax, title=f"{mode}: the denoising steps ({DEVICE.type})")
plot.save(fig2, OUT / "gantt.svg")
overlap = {m: runs[m].recorder.overlap_ms() for m in ("sequential", "layerwise")}
copy_ms = {m: sum(b.ms for b in runs[m].recorder.intervals() if b.lane == "copy") for m in overlap}
print("copy-stream transfer time (ms):", {m: round(v, 3) for m, v in copy_ms.items()},
      "| of it overlapped with compute (ms):", {m: round(v, 3) for m, v in overlap.items()})

# %% [markdown]
# ## Prefetch depth: memory against depth
#
# With depth k, block i computes while blocks i+1 to i+k are copied in, so k + 1 blocks are
# resident. Here the text encoder and the decoder stay resident, so only the blocks change. The
# dashed line is derived: the resident weights (encoder, decoder, the denoiser's non-block weights
# in their flat buffer), plus (k + 1) flat block buffers, plus the activations the all-resident
# run measured while denoising.

# %%
depths = [0, 1, 2, 4]
sweep = {}
for k in depths:
    a = lab.parse_args([*BASE, "--mode", "layerwise", "--prefetch-depth", str(k),
                        "--encoder-offload", "off", "--decoder-offload", "off"])
    sweep[k] = lab.run_mode("layerwise", a, DEVICE, runs["none"].output).summary
layout = sys.modules["offload_engines"].HostMaster.plan  # (layout, bytes) of a flat buffer
probe = lab.ToyDiffusionPipeline(lab.config(args), seed=args.seed)
block_bytes = layout(list(probe.denoiser.blocks[0].parameters()))[1]
block_ids = {id(p) for p in probe.denoiser.blocks.parameters()}
shell_bytes = layout([p for p in probe.denoiser.parameters() if id(p) not in block_ids])[1]
resident = sum(p.numel() * p.element_size() for m in (probe.text_encoder, probe.decoder) for p in m.parameters())
tl_none = runs["none"].ledger.timeline().window("denoise")
acts = max(sum(tl_none.device[c][i] for c in ("activations", "temporaries", "other")) for i in range(len(tl_none)))
derived = [resident + shell_bytes + (k + 1) * block_bytes + acts for k in depths]
measured = [sweep[k]["peak_device_bytes_by_stage"]["denoise"] for k in depths]
fig3, ax = plt.subplots(figsize=(6.5, 3.4), dpi=110, layout="constrained")
ax.plot(depths, [m / 2**20 for m in measured], "o-", label="measured: peak device bytes while denoising")
ax.plot(depths, [d / 2**20 for d in derived], "k--", label="derived: resident + (k+1) blocks + activations")
ax.set(xlabel="prefetch depth k", ylabel="MiB", xticks=depths, title="layerwise offload: memory against depth")
ax.grid(alpha=0.3)
ax.legend(fontsize=8)
plot.save(fig3, OUT / "depth.svg")
depth_table = "\n".join(
    ["| depth k | blocks resident | peak while denoising (measured) | derived | host to device per run |",
     "|---:|---:|---:|---:|---:|"]
    + [f"| {k} | {sweep[k]['max_resident_blocks']} | {plot.format_bytes(m)} | {plot.format_bytes(d)} | "
       f"{plot.format_bytes(sweep[k]['h2d_bytes'])} |" for k, m, d in zip(depths, measured, derived)])
nbk.show_markdown(depth_table)
if not ON_GPU:
    assert all(sweep[k]["max_resident_blocks"] == k + 1 for k in depths)
    assert all(abs(m - d) <= 4096 for m, d in zip(measured, derived)), list(zip(measured, derived))

# %% [markdown]
# ## Results written for the page

# %%
from labkit.provenance import write_results  # noqa: E402

summary = {"modes": [r.summary for r in runs.values()], "depth_sweep": {str(k): v for k, v in sweep.items()},
           "overlap_ms": overlap, "copy_lane_transfer_ms": copy_ms, "block_bytes": block_bytes,
           "shell_bytes": shell_bytes}
wall = sum(s["provenance"]["wall_time_s"] for s in [*summary["modes"], *sweep.values()])
write_results(OUT / "summary.json", summary, provenance.collect(lab.LAB, DEVICE, wall))
tables = {"modes": modes_table, "host": host_table, "residency": residency_table, "depth": depth_table}
for name, text in tables.items():
    (OUT / f"{name}.md").write_text(text + "\n")
(OUT / "provenance.md").write_text(nbk.provenance_markdown(record))
print(sorted(p.name for p in OUT.iterdir()))
