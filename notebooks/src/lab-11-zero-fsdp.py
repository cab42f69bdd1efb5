# %% [markdown]
# # Lab 11 · ZeRO and FSDP, measured per rank
#
# This notebook launches the two Lab 11 starters with `torchrun` (two processes: gloo on a CPU;
# NCCL on two GPUs, gloo when both ranks share one), reads the one JSON summary rank 0 prints, and
# draws what every rank's memory ledger recorded:
#
# 1. `code/lab-11-zero-fsdp/zero_fsdp.py` trains one small GPT at ZeRO stages 0 to 3 (DDP,
#    `ZeroRedundancyOptimizer`, FSDP2 with `reshard_after_forward=False` and `True`). Its bytes per
#    rank are drawn against Lab 01's formulas (`zero_model_state`), category by category.
# 2. `code/lab-11-zero-fsdp/fsdp_inference.py` runs Lab 08's toy diffusion pipeline with its
#    weights sharded across the ranks (with and without CPU offload of the shards) and compares it
#    with Lab 08's single-device engines.
#
# It is executed by `scripts/run_notebooks.py`, never edited by hand. On a CPU the byte counts are
# exact; no number here is a GPU time.

# %%
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(os.environ.get("INFRALAB_ROOT") or next(
    p for p in [Path.cwd(), *Path.cwd().parents] if (p / "code" / "labkit").is_dir()))
sys.path.insert(0, str(ROOT / "code"))

import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from labkit import notebook as nbk  # noqa: E402
from labkit import plot, provenance  # noqa: E402
from labkit.cli import pick_device  # noqa: E402

lab = nbk.load_lab("lab-11-zero-fsdp/zero_fsdp.py")
ranks = nbk.load_lab("lab-11-zero-fsdp/ranks.py")
DEVICE = pick_device(nbk.device_name())
OUT = nbk.results_dir(lab.LAB)
ON_GPU = DEVICE.type == "cuda"
NPROC = 2  # NCCL with a GPU per rank; on one GPU the two ranks share it through gloo
TRAIN_SIZE = (["--width", "1024", "--layers", "8", "--heads", "16", "--seq-len", "512", "--vocab", "32000",
               "--batch-size", "4"] if ON_GPU else [])
INFER_SIZE = (["--width", "1024", "--heads", "16", "--denoiser-layers", "16", "--latent-tokens", "4096",
               "--steps", "4", "--dtype", "bfloat16"] if ON_GPU else [])
print("device:", DEVICE, "| ranks:", NPROC, "| results go to:", OUT.relative_to(OUT.parents[1]))

# %% tags=["provenance"]
record = provenance.collect(lab.LAB, DEVICE)
nbk.show_provenance(record)

# %% [markdown]
# ## Two torchrun launches
#
# Each launch starts `NPROC` processes; rank 0 gathers every rank's numbers and prints them as one
# JSON object, the other ranks print nothing. The two runs are independent, so they start together.

# %%
def torchrun(script, *args):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={NPROC}", "--standalone",
           str(ROOT / "code" / "lab-11-zero-fsdp" / script), "--device", DEVICE.type, "--json", "--timelines", *args]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def summary_of(proc):
    out, err = proc.communicate(timeout=590)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out)


launches = {"train": torchrun("zero_fsdp.py", *TRAIN_SIZE), "infer": torchrun("fsdp_inference.py", *INFER_SIZE)}
train, infer = summary_of(launches["train"]), summary_of(launches["infer"])
P, T, N = train["params"], train["tensors"], train["world_size"]
stages = {s["stage"]: s for s in train["stages"]}
print(f"training: {P:,} parameters in {T} tensors on {N} ranks ({train['backend']}); "
      f"inference: {infer['world_size']} ranks, weights {plot.format_bytes(sum(infer['weight_bytes'][k] for k in ('text_encoder', 'denoiser', 'decoder')))}")

# %% [markdown]
# ## Model state per rank against Lab 01
#
# Measured: each rank's ledger at the end of the run, counting only what that rank holds (a
# DTensor counts as its local shard). Derived: Lab 01's `zero_model_state(P, "fp32", "adamw",
# zero_stage, dp=N, tensors=T)`, imported from `code/lab-01-memory-accounting/memory_accounting.py`.

# %%
CATS = ("parameters", "gradients", "optimizer_state")
rows = ["| stage | rank | category | measured | Lab 01 (derived) | measured - derived |", "|---|---:|---|---:|---:|---:|"]
for n, s in stages.items():
    for r, rank in enumerate(s["ranks"]):
        for cat in CATS:
            m, d = rank["at_end"][cat], s["lab01"][cat]
            rows.append(f"| {n} · {s['name']} | {r} | {cat.replace('_', ' ')} | {m:,} B | {d:,} B | {m - d:+,} B |")
model_state_table = "\n".join(rows)
nbk.show_markdown(model_state_table)
if not ON_GPU:  # CPU: the ledger counts storage bytes exactly
    for n in (0, 2, 3):
        for rank in stages[n]["ranks"]:
            for cat in CATS:
                want = 2 * P if (n, cat) == (2, "parameters") else stages[n]["lab01"][cat]  # FSDP: shards at rest
                assert rank["at_end"][cat] == want, (n, cat)
    shares = [r["at_end"]["optimizer_state"] for r in stages[1]["ranks"]]
    assert sum(shares) == 8 * P + 4 * T  # ZeRO-1: each tensor's AdamW state on exactly one rank

# %%
fig, axes = plt.subplots(1, 3, figsize=(12, 3.6), dpi=110, layout="constrained", sharey=True)
width = 0.8 / (N + 1)
for ax, cat in zip(axes, CATS):
    for r in range(N):
        ax.bar([n + (r - N / 2) * width for n in stages], [stages[n]["ranks"][r]["at_end"][cat] / 2**20 for n in stages],
               width, color=plot.CATEGORY_COLORS[cat], alpha=1.0 - 0.35 * r, label=f"rank {r} (measured)")
    ax.bar([n + (N / 2) * width for n in stages], [stages[n]["lab01"][cat] / 2**20 for n in stages], width,
           facecolor="white", edgecolor="black", hatch="///", label="Lab 01 (derived)")
    ax.set_title(cat.replace("_", " "), loc="left", fontsize=10)
    ax.set_xticks(list(stages), [f"stage {n}" for n in stages])
    ax.grid(axis="y", alpha=0.3)
axes[0].set_ylabel("MiB per rank")
axes[-1].legend(fontsize=8, loc="upper right")
plot.save(fig, OUT / "model_state.svg")

# %% [markdown]
# ## The peak of a training step, per stage
#
# The last step of each stage (the steady state: AdamW state exists, DDP has rebuilt its buckets,
# FSDP has initialised), rank 0, at its highest moment. `communication` is every buffer a
# collective filled: DDP's gradient buckets, FSDP's gathered weights and its all-gather and
# reduce-scatter buffers (labelled by `ranks.Traffic`).

# %%
SHORT = {0: "stage 0\nDDP", 1: "stage 1\nZeroRedundancyOptimizer", 2: "stage 2\nFSDP2, reshard=False",
         3: "stage 3\nFSDP2, reshard=True"}
present = [c for c in plot.CATEGORY_COLORS if any(stages[n]["ranks"][0]["peak_last_step"][c] for n in stages)]
fig2, ax = plt.subplots(figsize=(8, 3.8), dpi=110, layout="constrained")
bottom = [0.0] * len(stages)
for cat in present:
    vals = [stages[n]["ranks"][0]["peak_last_step"][cat] / 2**20 for n in stages]
    ax.bar([SHORT[n] for n in stages], vals, bottom=bottom, color=plot.CATEGORY_COLORS[cat],
           label=cat.replace("_", " "))
    bottom = [b + v for b, v in zip(bottom, vals)]
ax.set(ylabel="MiB on rank 0", title="peak of the last training step, by category (measured)")
ax.tick_params(axis="x", labelsize=8)
ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
ax.grid(axis="y", alpha=0.3)
plot.save(fig2, OUT / "peak.svg")
rows = ["| stage | " + " | ".join(c.replace("_", " ") for c in present) + " | total |",
        "|---|" + "---:|" * (len(present) + 1)]
for n, s in stages.items():
    pk = s["ranks"][0]["peak_last_step"]
    rows.append(f"| {n} · {s['name']} | " + " | ".join(plot.format_bytes(pk[c]) for c in present)
                + f" | **{plot.format_bytes(pk['total'])}** |")
peak_table = "\n".join(rows)
nbk.show_markdown(peak_table)
totals = [stages[n]["ranks"][0]["peak_last_step"]["total"] for n in stages]
if not ON_GPU:
    assert totals == sorted(totals, reverse=True), totals
    comm = [stages[n]["ranks"][0]["peak_last_step"]["communication"] for n in stages]
    assert comm[0] == comm[1] == 4 * P and comm[2] >= 4 * P > comm[3]

# %% [markdown]
# ## One training step, stage by stage
#
# Rank 0's ledger over the last step of each stage, on one scale. Watch the pink communication
# band: DDP's buckets sit there all the time; stage 2 gathers every block in forward and keeps
# them until backward is done; stage 3 gathers a block, frees it, and gathers it again in backward.

# %%
fig3, axes = plt.subplots(4, 1, figsize=(10, 11), dpi=110, layout="constrained")
for ax, (n, s) in zip(axes, stages.items()):
    tl = ranks.timeline_from_dict(s["timeline"])
    plot.plot_timeline(tl, ax=ax, legend=(n == 0), max_points=220, unit="MiB", ymax_bytes=max(totals),
                       title=f"stage {n}: {s['name']} (rank 0, last step, measured)")
    ax.set_xlabel("ledger events")
plot.save(fig3, OUT / "timelines.svg")

# %% [markdown]
# ## Bytes through the collectives
#
# Counted by `ranks.Traffic` on rank 0, per training step (the run's total over its steps). The
# ZeRO paper (section 7) derives the volumes: an all-reduce moves 2 x 4P bytes per rank (a
# reduce-scatter and an all-gather), stages 1 and 2 the same, stage 3 one more all-gather (3 x 4P).

# %%
steps = train["config"]["steps"]
rows = [f"| stage | collective | calls in {steps} steps | output bytes per step | input bytes per step |",
        "|---|---|---:|---:|---:|"]
volume = {}
for n, s in stages.items():
    ops = s["ranks"][0]["traffic"]["collectives"]
    volume[n] = ops
    for op, v in ops.items():
        rows.append(f"| {n} · {s['name']} | `{op}` | {v['calls']} | {plot.format_bytes(v['out_bytes'] / steps)} | "
                    f"{plot.format_bytes(v['in_bytes'] / steps)} |")
traffic_table = "\n".join(rows)
nbk.show_markdown(traffic_table)
if not ON_GPU:
    assert volume[0]["allreduce_"]["out_bytes"] == 4 * P * steps
    assert volume[3]["_allgather_base_"]["out_bytes"] == 2 * volume[2]["_allgather_base_"]["out_bytes"] == 8 * P * steps

# %% [markdown]
# ## The same training, whatever the stage
#
# Sharding moves bytes between ranks; it must not change a number. Losses are the mean over ranks;
# the parameters are compared whole after the last step (`DTensor.full_tensor()` for FSDP).

# %%
rows = ["| stage | losses (mean over ranks) | largest relative loss difference vs DDP | largest parameter difference vs DDP |",
        "|---|---|---:|---:|"]
for n, s in stages.items():
    d1, d2 = s["max_loss_rel_diff_vs_ddp"], s["max_param_abs_diff_vs_ddp"]
    rows.append(f"| {n} · {s['name']} | {', '.join(f'{v:.6f}' for v in s['losses'])} | "
                f"{'reference' if d1 is None else f'{d1:.1e}'} | {'reference' if d2 is None else f'{d2:.1e}'} |")
losses_table = "\n".join(rows)
nbk.show_markdown(losses_table)
for n in (1, 2, 3):
    assert stages[n]["max_loss_rel_diff_vs_ddp"] <= train["loss_rtol"]
    assert stages[n]["max_param_abs_diff_vs_ddp"] <= train["loss_rtol"]

# %% [markdown]
# ## Inference: sharded weights against Lab 08's single device
#
# Every rank generates from its own prompt. `sent` is what a rank put into the all-gathers (its own
# shards, once per unit run), `received` what it got from the others. With CPU offload the shards
# live in host memory, so on a GPU `sent` is also what crossed PCIe to the device; on a CPU nothing
# crosses a bus and that column is derived. Lab 08's engines run on rank 0's device with rank 0's
# prompt.

# %%
W = infer["weight_bytes"]
total_w = W["text_encoder"] + W["denoiser"] + W["decoder"]
runs = {}
for placement, per_rank in infer["placements"].items():
    r0 = per_rank[0]
    offload = placement == "sharded+offload"
    h2d = r0["h2d_bytes_measured"] if ON_GPU else (r0["sent_bytes"] if offload else 0)
    runs[f"FSDP {placement} ({infer['world_size']} ranks)"] = {
        "device": r0["peak_device"]["total"], "host": r0["peak_host"], "h2d": h2d,
        "received": r0["gathered_bytes"] - r0["sent_bytes"], "diff": max(r["max_abs_diff"] for r in per_rank),
        "h2d_kind": "measured" if ON_GPU or not offload else "derived"}
for mode, s in infer["lab08"].items():
    name = "Lab 08 all resident (1 device)" if mode == "none" else f"Lab 08 layerwise k={s['prefetch_depth']} (1 device)"
    runs[name] = {"device": s["peak_device_bytes"], "host": s["peak_host_copy_bytes"], "h2d": s["h2d_bytes"],
                  "received": 0, "diff": s["max_abs_diff"], "h2d_kind": "measured"}
rows = ["| placement | peak device bytes per GPU | host bytes per GPU | host to device per image per GPU | "
        "received from other GPUs per image | max abs diff |", "|---|---:|---:|---:|---:|---:|"]
for name, v in runs.items():
    rows.append(f"| {name} | {plot.format_bytes(v['device'])} | {plot.format_bytes(v['host'])} | "
                f"{plot.format_bytes(v['h2d'])} ({v['h2d_kind']}) | {plot.format_bytes(v['received'])} | {v['diff']:.1e} |")
inference_table = "\n".join(rows)
nbk.show_markdown(inference_table)
assert all(v["diff"] <= infer["output_atol"] for v in runs.values())

fig4, (ax_mem, ax_move) = plt.subplots(1, 2, figsize=(12, 3.8), dpi=110, layout="constrained")
names = list(runs)
labels = [n.replace(" (", "\n(") for n in names]
ax_mem.barh(labels, [runs[n]["device"] / 2**20 for n in names], color="#4C72B0", label="peak device bytes")
ax_mem.barh(labels, [runs[n]["host"] / 2**20 for n in names], left=[runs[n]["device"] / 2**20 for n in names],
            color="#937860", alpha=0.6, label="weights kept on the host")
ax_mem.set(xlabel="MiB per GPU (measured)", title="where the bytes live")
ax_move.barh(labels, [runs[n]["h2d"] / 2**20 for n in names], color="#55A868", label="host to device")
ax_move.barh(labels, [runs[n]["received"] / 2**20 for n in names], left=[runs[n]["h2d"] / 2**20 for n in names],
             color="#DA8BC3", label="received from other GPUs (all-gather)")
ax_move.set(xlabel="MiB per image per GPU", title="what moves" + ("" if ON_GPU else " (host to device of FSDP+offload: derived)"))
ax_move.tick_params(axis="y", labelleft=False)
for ax in (ax_mem, ax_move):
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
plot.save(fig4, OUT / "inference.svg")

# %% [markdown]
# ## Inference timelines: gathered unit by unit, or streamed block by block
#
# Rank 0's ledger for FSDP with CPU offload, and Lab 08's layerwise offload on one device, on one
# scale. In both, the weights on the device are one unit at a time; FSDP's communication band holds
# the gathered unit *and* the flat buffer the all-gather wrote into, which FSDP2 keeps until the
# next all-gather.

# %%
tl_fsdp = ranks.timeline_from_dict(infer["placements"]["sharded+offload"][0]["timeline"])
tl_layer = ranks.timeline_from_dict(infer["lab08"]["layerwise"]["timeline"])
top = max(max(tl_fsdp.device_total()), max(tl_layer.device_total()))
fig5, axes = plt.subplots(2, 1, figsize=(10, 6), dpi=110, layout="constrained")
plot.plot_timeline(tl_fsdp, ax=axes[0], ymax_bytes=top, unit="KiB" if not ON_GPU else "MiB", max_points=220,
                   title=f"FSDP sharded + CPU offload, rank 0 of {infer['world_size']} (measured)")
plot.plot_timeline(tl_layer, ax=axes[1], ymax_bytes=top, unit="KiB" if not ON_GPU else "MiB", max_points=220,
                   title="Lab 08 layerwise offload, one device (measured)")
plot.save(fig5, OUT / "inference_timelines.svg")
units = {"text encoder": W["text_encoder"], "one denoiser block": W["denoiser_block"], "decoder": W["decoder"]}
largest_name = max(units, key=units.get)
largest_unit = units[largest_name]
comm_peak = infer["placements"]["sharded+offload"][0]["peak_device"]["communication"]
units_table = "\n".join([
    "| largest unit U | its weight bytes | FSDP+offload: communication at the peak (rank 0) | ratio |",
    "|---|---:|---:|---:|",
    f"| {largest_name} | {plot.format_bytes(largest_unit)} | {plot.format_bytes(comm_peak)} | "
    f"{comm_peak / largest_unit:.2f} |"])
nbk.show_markdown(units_table)
if not ON_GPU:
    for r in infer["placements"]["sharded+offload"]:
        assert r["shard_bytes"] == r["peak_host"] == total_w // infer["world_size"]
        assert r["peak_device"]["parameters"] == 0

# %% [markdown]
# ## Recommendations, derived from these measurements
#
# Measured above, per GPU: the device bytes of each placement, and the bytes each one moves per
# image. Derived here: what those numbers say for a model of W weight bytes whose largest unit
# (block or component) is U, on N GPUs. Times are not derived from a CPU run: whether PCIe or the
# GPU-to-GPU link limits a placement is what the GPU run has to measure.

# %%
n = infer["world_size"]
fsdp_off = infer["placements"]["sharded+offload"][0]
layer = infer["lab08"]["layerwise"]
rec_rows = [
    "| situation | choose | device bytes per GPU | host to device per image per GPU | between GPUs per image per GPU |",
    "|---|---|---|---|---|",
    "| 1 GPU, W + activations fit | all resident (Lab 08 `none`) | W + activations | 0 | 0 |",
    f"| 1 GPU, W does not fit | layerwise offload, prefetch k (Lab 08) | (k+1) blocks + resident parts + activations "
    f"(measured here: {plot.format_bytes(layer['peak_device_bytes'])}) | every weight once per image "
    f"(measured: {plot.format_bytes(layer['h2d_bytes'])}) | 0 |",
    "| N GPUs, W + activations fit on one | replicate: one whole pipeline per GPU, one prompt each | W + activations | 0 | 0 |",
    f"| N GPUs, W/N + 2U + activations fit | FSDP, shards on the GPU | W/N + 2U + activations (measured: "
    f"{plot.format_bytes(infer['placements']['sharded'][0]['peak_device']['total'])}) | 0 | "
    f"(N-1)/N of the gathered bytes (measured: {plot.format_bytes(fsdp_off['gathered_bytes'] - fsdp_off['sent_bytes'])}) |",
    f"| N GPUs, only 2U + activations fit | FSDP + `CPUOffloadPolicy` | 2U + activations (measured: "
    f"{plot.format_bytes(fsdp_off['peak_device']['total'])}) | 1/N of the gathered bytes "
    f"({'measured' if ON_GPU else 'derived'}: {plot.format_bytes(fsdp_off['h2d_bytes_measured'] if ON_GPU else fsdp_off['sent_bytes'])}) | "
    f"(N-1)/N of the gathered bytes |",
]
recommendations_table = "\n".join(rec_rows)
nbk.show_markdown(recommendations_table)
pcie_ratio = layer["h2d_bytes"] / max(fsdp_off["sent_bytes"], 1)
print(f"host-to-device bytes per GPU: Lab 08 layerwise / FSDP+offload = {pcie_ratio:.2f} (N = {n}); "
      f"device peak: FSDP+offload / layerwise = {fsdp_off['peak_device']['total'] / layer['peak_device_bytes']:.2f}")

# %% [markdown]
# ## What runs where
#
# Probed here, in this process, on a one-rank gloo group: FSDP2's `CPUOffloadPolicy` with its
# default `pin_memory=True`. The other features ran in the torchrun launches above.

# %%
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard  # noqa: E402


def probe_pinned_offload() -> str:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        fully_shard(torch.nn.Linear(8, 8), mesh=init_device_mesh("cpu", (1,)), offload_policy=CPUOffloadPolicy())
        return "works"
    except Exception as err:  # the message is the result
        return f"fails: `{type(err).__name__}: {err}`"
    finally:
        dist.destroy_process_group()


pinned = probe_pinned_offload()
where = f"this machine ({DEVICE.type}, torch {torch.__version__})"
support_rows = ["| feature | " + where + " |", "|---|---|",
                f"| FSDP2 `fully_shard`, `reshard_after_forward=True` and `False`, {train['backend']} | works (stages 2 and 3 above) |",
                f"| `ZeroRedundancyOptimizer`, {train['backend']} | works (stage 1 above) |",
                f"| `CPUOffloadPolicy(pin_memory=False)`, {infer['backend']} | works (inference above) |",
                f"| `CPUOffloadPolicy()` (default `pin_memory=True`) | {pinned} |"]
support_table = "\n".join(support_rows)
nbk.show_markdown(support_table)

# %% [markdown]
# ## Results written for the page

# %%
from labkit.provenance import write_results  # noqa: E402

strip = {"timeline"}
summary = {"train": {**{k: v for k, v in train.items() if k not in ("stages", "provenance")},
                     "stages": [{k: v for k, v in s.items() if k not in strip} for s in train["stages"]]},
           "infer": {**{k: v for k, v in infer.items() if k not in ("placements", "lab08", "provenance")},
                     "placements": {p: [{k: v for k, v in r.items() if k not in strip} for r in rs]
                                    for p, rs in infer["placements"].items()},
                     "lab08": {m: {k: v for k, v in s.items() if k not in strip} for m, s in infer["lab08"].items()}},
           "pinned_offload_probe": pinned}
write_results(OUT / "summary.json", summary, record)
tables = {"model_state": model_state_table, "peak": peak_table, "traffic": traffic_table, "losses": losses_table,
          "inference": inference_table, "units": units_table, "recommendations": recommendations_table,
          "support": support_table}
for name, text in tables.items():
    (OUT / f"{name}.md").write_text(text + "\n")
(OUT / "provenance.md").write_text(nbk.provenance_markdown(record))
print(sorted(p.name for p in OUT.iterdir()))
