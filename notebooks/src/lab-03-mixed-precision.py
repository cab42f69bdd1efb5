# %% [markdown]
# # Lab 03 · Mixed precision, measured
#
# This notebook runs the Lab 03 starter, `code/lab-03-mixed-precision/mixed_precision.py`: the same
# toy GPT trained in three recipes (fp32, fp16 autocast with `torch.amp.GradScaler`, bf16 autocast),
# with the memory ledger watching every tensor. It is executed by `scripts/run_notebooks.py`, never
# edited by hand; the provenance cell below says where and when. On a CPU the byte counts and the
# scaler's behaviour are exact; speed needs a GPU run.
#
# What to look for:
#
# 1. The three loss curves lie on top of each other (within the lab's stated tolerance).
# 2. Parameters, gradients and AdamW state are the same bytes in every recipe: fp32 master weights.
# 3. Activations shrink, but not to half: what autocast runs in 16 bits halves exactly, the rest stays
#    fp32, and autocast adds 16-bit copies of the weights.
# 4. An inf in a gradient makes GradScaler skip the step and halve its scale; the weights do not move.

# %%
import os
import sys
from pathlib import Path

ROOT = Path(os.environ.get("INFRALAB_ROOT") or next(
    p for p in [Path.cwd(), *Path.cwd().parents] if (p / "code" / "labkit").is_dir()))
sys.path.insert(0, str(ROOT / "code"))

import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from labkit import notebook as nbk  # noqa: E402
from labkit import plot, provenance  # noqa: E402

lab = nbk.load_lab("lab-03-mixed-precision/mixed_precision.py")
DEVICE = lab.pick_device(nbk.device_name())
OUT = nbk.results_dir(lab.LAB)
ON_GPU = DEVICE.type == "cuda"
ON_CPU = not ON_GPU
if ON_CPU:
    torch.set_num_threads(1)  # a tiny model: one thread is as fast, and steadier on a shared machine
# The lab's default model on a CPU; GPU-sized on a GPU (the same code either way).
SIZE = (["--width", "1024", "--layers", "8", "--heads", "16", "--seq-len", "512", "--batch-size", "16"]
        if ON_GPU else [])
STEPS = 50 if ON_GPU else 20
BASE = ["--device", DEVICE.type, "--json", *SIZE]
COLORS = {"fp32": "#4C72B0", "fp16": "#DD8452", "bf16": "#55A868"}


def forward_span(run, step=0):
    """A run's ledger timeline and the span of its forward phase in ``step``."""
    tl = run.ledger.timeline()
    return tl, next(sp for sp in tl.spans if sp.name == "forward" and sp.step == step)


print("device:", DEVICE, "| results go to:", OUT.relative_to(OUT.parents[1]))

# %% tags=["provenance"]
record = provenance.collect(lab.LAB, DEVICE)
nbk.show_provenance(record)

# %% [markdown]
# ## Three recipes, one model, the same batches
#
# `lab.run_recipes` is what the command line calls with `--recipe all`. Each recipe starts from the
# same seed, so the three models begin identical and see the same batches. The ledger records the
# first two steps; the later steps run without it and are timed.

# %%
snapshot = OUT / "memory_snapshot.pickle" if ON_GPU else None
args = lab.parse_args([*BASE, "--steps", str(STEPS)] + (["--snapshot", str(snapshot)] if snapshot else []))
runs = lab.run_recipes(args)
result = lab.summary(runs)
R = result["recipes"]
P = result["params"]
print(f"{P:,} parameters; {STEPS} steps per recipe; final losses",
      {n: round(r["losses"][-1], 4) for n, r in R.items()})

# %% [markdown]
# ## Loss curves
#
# The lab's tolerance (`LOSS_RTOL` in the starter) is that every step's loss stays within 2 % of the
# fp32 loss at the same step. The lower panel shows how far each 16-bit recipe actually is.

# %%
FLOOR = 1e-4  # percent
fig, (ax_loss, ax_diff) = plt.subplots(2, 1, figsize=(7, 7), dpi=110, layout="constrained")  # stacked: phones
for name, r in R.items():
    ax_loss.plot(range(len(r["losses"])), r["losses"], label=name, color=COLORS[name], lw=1.6,
                 ls={"fp32": "-", "fp16": "--", "bf16": ":"}[name])
    if name != "fp32":  # drawn on a log axis; a step where the losses are equal sits on the floor
        rel = [max(100 * abs(a - b) / b, FLOOR) for a, b in zip(r["losses"], R["fp32"]["losses"])]
        ax_diff.plot(range(len(rel)), rel, label=name, color=COLORS[name], marker="o", ms=3)
ax_diff.axhline(100 * lab.LOSS_RTOL, color="#d62728", ls="--", lw=1, label="tolerance (2 %)")
ax_loss.set(title="training loss (measured)", xlabel="step", ylabel="loss")
ax_diff.set(title="|loss - fp32 loss| / fp32 loss (measured)", xlabel="step", ylabel="% (log scale)",
            yscale="log", ylim=(FLOOR, 10))
for ax in (ax_loss, ax_diff):
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
plot.save(fig, OUT / "loss_curves.svg")
for name, c in result["vs_fp32"].items():
    print(f"{name}: largest relative difference from fp32 {c['max_rel_loss_diff']:.3%}")
    assert c["losses_within_tolerance"], name
assert R["fp32"]["losses"][-1] < R["fp32"]["losses"][0] - 1.0, "the model learns"

# %% [markdown]
# ## What each recipe keeps in memory
#
# Bytes from the ledger. Parameters, gradients and AdamW state are read in the optimizer phase;
# activations are the most the ledger held at once (the end of forward). The step time is the median
# of the steps run without the ledger; on a CPU it is **CPU timing** (one thread), not a statement about
# GPUs: a CPU has no tensor cores, and fp16 matmuls on most CPUs go through conversions.

# %%
fmt = plot.format_bytes
rows = ["| recipe | parameters | gradients | AdamW state | activations | vs fp32 | largest loss difference "
        "| step time |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
for name, r in R.items():
    opt = r["peak_bytes_by_phase"]["optimizer"]
    c = result["vs_fp32"].get(name)
    ratio = f"{c['activation_ratio']:.3f}×" if c else "1×"
    diff = f"{c['max_rel_loss_diff']:.3%}" if c else "-"
    t = f"{r['step_time_s'] * 1e3:.1f} ms" + (" CPU" if ON_CPU else "")
    rows.append(f"| **{name}** | {fmt(opt['parameters'])} {'/'.join(r['parameter_dtypes'])} "
                f"| {fmt(opt['gradients'])} | {fmt(opt['optimizer_state'])} | {fmt(r['activation_bytes'])} "
                f"| {ratio} | {diff} | {t} |")
recipes_table = "\n".join(rows)
nbk.show_markdown(recipes_table)
lo, hi = lab.ACTIVATION_BAND
for name, r in R.items():
    opt = r["peak_bytes_by_phase"]["optimizer"]
    assert r["parameter_dtypes"] == ["float32"] and opt["parameters"] == 4 * P and opt["gradients"] == 4 * P
    assert opt["optimizer_state"] == R["fp32"]["peak_bytes_by_phase"]["optimizer"]["optimizer_state"]
    if name != "fp32" and ON_CPU:
        assert lo <= result["vs_fp32"][name]["activation_ratio"] <= hi, name
ratios = " and ".join(f"{result['vs_fp32'][n]['activation_ratio']:.3f} ({n})" for n in R if n != "fp32")
band_text = (f"The activation ratio (16-bit over fp32) has a stated band on the default CPU model, "
             f"`ACTIVATION_BAND` = {lo:.2f} to {hi:.2f}, which the notebook asserts on a CPU; this run measured "
             f"{ratios}.")
nbk.show_markdown(band_text)

# %% [markdown]
# ## The ledger timelines, side by side
#
# Two steps of each recipe on the same scale. The blue band (parameters) and the purple band (AdamW
# state, from step 0's optimizer phase on) are identical in all three: autocast never touches the
# fp32 master weights. The green mountain (activations) is lower in fp16 and bf16.

# %%
fig, axes = plt.subplots(3, 1, figsize=(10, 10.5), dpi=110, sharex=False, layout="constrained")
top = max(max(t) for t in (runs[n].ledger.timeline().device_total() for n in runs))
for ax, (name, run) in zip(axes, runs.items()):
    plot.plot_timeline(run.ledger.timeline(), ax=ax, max_points=300,
                       title=f"{name}: 2 training steps on {DEVICE.type} (ledger, measured)")
    unit, size = plot.pick_unit(top)
    ax.set_ylim(0, top / size * 1.12)
plot.save(fig, OUT / "timelines.svg")

# %% [markdown]
# ## Where the bytes go, by category and by saved tensor
#
# Top: each recipe's bytes by ledger category at its highest moment. Bottom: what autograd saved
# for backward in one forward pass, by kind, found with `torch.autograd.graph.saved_tensors_hooks`
# (`saved_for_backward` in the starter). A tensor whose autograd history is a dtype cast of a
# parameter is a **16-bit weight copy**: autocast makes one per matmul weight in every forward, and
# the matmul keeps it for backward.

# %%
cats = ["parameters", "optimizer_state", "activations", "temporaries"]  # no gradient is alive at the peak
kinds = ["float32", "float16", "bfloat16", "16-bit weight copies", "int64"]
kind_colors = {"float32": "#4C72B0", "float16": "#DD8452", "bfloat16": "#55A868",
               "16-bit weight copies": "#C44E52", "int64": "#8C8C8C"}
peaks = {n: r["peak_bytes"] for n, r in R.items()}
unit, size = plot.pick_unit(max(max(p[c] for c in cats) for p in peaks.values()))
fig, (ax_cat, ax_saved) = plt.subplots(2, 1, figsize=(7, 7.5), dpi=110, layout="constrained")  # stacked: phones
width = 0.26
for i, name in enumerate(R):
    xs = [j + (i - 1) * width for j in range(len(cats))]
    ax_cat.bar(xs, [peaks[name][c] / size for c in cats], width, label=name, color=COLORS[name])
ax_cat.set_xticks(range(len(cats)), [c.replace("_", " ") for c in cats], fontsize=8)
ax_cat.set(title="bytes by category at each recipe's peak (measured)", ylabel=unit)
ax_cat.legend(fontsize=8)
s_unit, s_size = plot.pick_unit(max(sum(r["saved_for_backward"].values()) for r in R.values()))
for i, r in enumerate(R.values()):
    bottom = 0.0
    for kind in kinds:
        v = r["saved_for_backward"].get(kind, 0) / s_size
        if v:
            ax_saved.bar(i, v, 0.6, bottom=bottom, color=kind_colors[kind], label=kind if kind not in
                         ax_saved.get_legend_handles_labels()[1] else None)
            bottom += v
ax_saved.set_xticks(range(len(R)), list(R))
ax_saved.set(title="saved for backward in one forward, by kind (measured)", ylabel=s_unit)
ax_saved.legend(fontsize=8, loc="upper right")
for ax in (ax_cat, ax_saved):
    ax.grid(axis="y", alpha=0.3)
plot.save(fig, OUT / "bytes.svg")

# %%
saved_rows = ["| saved for backward (bytes) | " + " | ".join(R) + " |", "|---|" + "---:|" * len(R)]
for kind in kinds:
    if any(kind in r["saved_for_backward"] for r in R.values()):
        saved_rows.append(f"| {kind} | " + " | ".join(f"{r['saved_for_backward'].get(kind, 0):,}" for r in R.values()) + " |")
saved_rows.append("| **total** | " + " | ".join(f"**{sum(r['saved_for_backward'].values()):,}**" for r in R.values()) + " |")
ends = {n: forward_span(run) for n, run in runs.items()}
saved_rows.append("| ledger: activations at the end of step 0's forward | " + " | ".join(
    f"{tl.device['activations'][span.end - 1]:,}" for tl, span in ends.values()) + " |")
saved_table = "\n".join(saved_rows)
nbk.show_markdown(saved_table)

# %% [markdown]
# ## Formula against measurement
#
# Each row is an identity the ledger and the saved-tensor census must satisfy. On a CPU they hold to
# the byte and the notebook asserts them; on a GPU the ledger rounds to the allocator's 512-byte
# blocks, so only the first three are exact there.

# %%
b32 = R["fp32"]["saved_for_backward"]
checks = [("parameters, every recipe", "4 B × P", 4 * P, R["bf16"]["peak_bytes_by_phase"]["optimizer"]["parameters"])]
for name, dtype in (("fp16", "float16"), ("bf16", "bfloat16")):
    if name not in R:
        continue
    s16 = R[name]["saved_for_backward"]
    checks.append((f"{name}: 16-bit weight copies", "2 B × (elements of every Linear weight)",
                   R[name]["weight_copy_bytes_derived"], s16.get("16-bit weight copies", 0)))
    checks.append((f"{name}: what autocast moved to 16 bits", "(fp32 run's float32 − this run's float32) / 2",
                   (b32["float32"] - s16["float32"]) // 2, s16[dtype]))
for name, (tl, span) in ends.items():
    checks.append((f"{name}: ledger activations at the end of forward", "saved for backward + the 4-byte loss",
                   sum(R[name]["saved_for_backward"].values()) + 4, tl.device["activations"][span.end - 1]))
rows = ["| quantity | formula | derived (bytes) | measured (bytes) |", "|---|---|---:|---:|"]
for quantity, formula, derived, measured in checks:
    rows.append(f"| {quantity} | {formula} | {derived:,} | {measured:,} |")
    if ON_CPU:
        assert derived == measured, (quantity, derived, measured)
checks_table = "\n".join(rows)
nbk.show_markdown(checks_table)

# %% [markdown]
# ## Where the 16-bit weight casts live in the ledger
#
# The ledger files every storage under one category. A weight copy is born in forward (by the
# `_to_copy` op that autocast inserts) and is still alive when forward ends, because the matmul saved
# it, so the ledger calls it an **activation**. Below: the activations of step 0 by the op that made
# them. In the 16-bit recipes `_to_copy` holds the weight copies and the 16-bit copies of the
# layer-norm outputs that feed the matmuls; in fp32 there is no `_to_copy` at all.

# %%
by_op = {}
for name, run in runs.items():
    _, fwd = forward_span(run)
    counts = {}
    for rec in run.ledger.records:
        if fwd.start <= rec.born < fwd.end and run.ledger.category_of(rec) == "activations":
            counts[rec.op] = counts.get(rec.op, 0) + rec.nbytes
    by_op[name] = counts
ops = sorted({op for c in by_op.values() for op in c}, key=lambda op: -by_op["fp32"].get(op, 0))
op_rows = ["| op that made the activation | " + " | ".join(R) + " |", "|---|" + "---:|" * len(R)]
op_rows += [f"| `{op}` | " + " | ".join(fmt(by_op[n].get(op, 0)) for n in R) + " |" for op in ops]
ops_table = "\n".join(op_rows)
nbk.show_markdown(ops_table)
assert "_to_copy" not in by_op["fp32"] and by_op["bf16"]["_to_copy"] > R["bf16"]["weight_copy_bytes_derived"]

# %% [markdown]
# ## The scaler's state
#
# `GradScaler.state_dict()` is what a checkpoint must save next to the optimizer. Inside, the state is
# two one-element tensors on the training device: the scale (float32) and the growth tracker (int32),
# the count of clean steps since the scale last changed. Only the fp16 recipe has an enabled scaler.

# %%
sc = R["fp16"]
scaler_rows = ["| what | value |", "|---|---|"]
scaler_rows += [f"| `state_dict()['{k}']` | {v:g} |" for k, v in sc["scaler_state"].items()]
scaler_rows += [f"| `scaler.{k}` | one {t['dtype']} element on `{t['device']}`, value {t['value']:g} |"
                for k, t in sc["scaler_tensors"].items()]
scaler_table = "\n".join(scaler_rows)
nbk.show_markdown(scaler_table)
assert sc["scaler_state"]["backoff_factor"] == 0.5 and not sc["skipped_steps"]

# %% [markdown]
# ## An injected inf: a skipped step and the scale backing off
#
# `--inject-inf-at 4` writes an inf into one gradient of the fp16 run after backward, the way an fp16
# overflow would. `scaler.step` finds it while unscaling, does not call `optimizer.step()`, and
# `scaler.update()` multiplies the scale by `backoff_factor` (0.5) and resets the growth tracker.
# The lab compares every parameter before and after that step. The last column is the fp16 run of the
# first section at the same step: the same seed and batches, without the inf.

# %%
inj_run = lab.run_recipes(lab.parse_args([*BASE, "--recipe", "fp16", "--steps", "8", "--inject-inf-at", "4"]))["fp16"]
inj = inj_run.inject
inj_rows = ["| step | loss | scale before | scale after | step skipped? | growth tracker after | loss without the inf |",
            "|---:|---:|---:|---:|:---:|---:|---:|"]
clean = R["fp16"]["losses"]  # the fp16 run above: same seed, same batches, no injection
for s in inj_run.steps:
    mark = " ← inf injected" if s["step"] == inj["step"] else ""
    inj_rows.append(f"| {s['step']}{mark} | {s['loss']:.4f} | {s['scale_before']:g} | {s['scale_after']:g} "
                    f"| {'**yes**' if s['skipped'] else 'no'} | {s['growth_tracker']} | {clean[s['step']]:.4f} |")
inject_table = "\n".join(inj_rows)
nbk.show_markdown(inject_table)
print(f"parameters unchanged by the skipped step: {inj['params_unchanged']}")
assert inj["skipped"] and inj["params_unchanged"] and inj["scale_after"] == inj["scale_before"] * 0.5
assert [s["step"] for s in inj_run.steps if s["skipped"]] == [4]
if ON_CPU:  # up to the injected step the two runs are the same run; after it, the skipped step shows
    assert all(s["loss"] == clean[s["step"]] for s in inj_run.steps if s["step"] <= inj["step"])
    assert all(s["loss"] > clean[s["step"]] for s in inj_run.steps if s["step"] > inj["step"])

# %% [markdown]
# ## Real overflows: how the scale finds its level
#
# No injection here. The run starts from a scale of 2^24, far too large: the scaled fp16 gradients
# overflow for real, so the first steps are skipped and the scale halves each time until it fits.
# With `--growth-interval 4` the scaler then tries a doubling after every 4 clean steps, overflows
# again, and backs off: the sawtooth is the scaler probing for the largest scale that fits.

# %%
dyn = lab.run_recipes(lab.parse_args([*BASE, "--recipe", "fp16", "--steps", "24", "--init-scale", str(2.0**24),
                                      "--growth-interval", "4"]))["fp16"]
import math  # noqa: E402

fig, ax = plt.subplots(figsize=(10, 3.4), dpi=110, layout="constrained")
xs = [s["step"] for s in dyn.steps]
ax.step(xs, [math.log2(s["scale_before"]) for s in dyn.steps], where="post", color=COLORS["fp16"],
        label="log2(scale) used at the step")
skips = [s for s in dyn.steps if s["skipped"]]
ax.scatter([s["step"] for s in skips], [math.log2(s["scale_before"]) for s in skips], color="#d62728", zorder=3,
           label="overflow: step skipped, scale × 0.5")
ax.set(title="GradScaler's scale under real fp16 overflows (measured)", xlabel="step", ylabel="log2(scale)")
ax.legend(fontsize=8)
ax.grid(alpha=0.3)
plot.save(fig, OUT / "scale.svg")
n_skips = len(skips)
print(f"{n_skips} of {len(dyn.steps)} steps skipped; scale settled between 2^{min(math.log2(s['scale_after']) for s in dyn.steps[8:]):g}"
      f" and 2^{max(math.log2(s['scale_after']) for s in dyn.steps[8:]):g}")
assert dyn.steps[0]["skipped"] and not all(s["skipped"] for s in dyn.steps)
for s in skips:
    assert s["scale_after"] == s["scale_before"] * 0.5 and s["growth_tracker"] == 0

# %% [markdown]
# ## Allocated against reserved, and speed (CUDA only)
#
# On a GPU the ledger also samples `torch.cuda.memory_allocated` and `memory_reserved`, and the run
# exports a `_record_memory_history` snapshot for <https://pytorch.org/memory_viz>. The step-time
# ratio is the GPU run's figure: the handbook's target is a bf16 step at least 1.8× faster than fp32
# on an H100-class GPU. On a CPU this cell says so and claims nothing.

# %%
if ON_GPU:
    for name, r in R.items():
        c = r["cuda"]
        print(f"{name}: max allocated {fmt(c['max_memory_allocated'])}, ledger peak / (max allocated - before the run) "
              f"{c['ledger_over_allocator']:.4f}, step {r['step_time_s'] * 1e3:.1f} ms")
    print(f"bf16 speed-up over fp32: {result['vs_fp32']['bf16']['speedup_vs_fp32']:.2f}× (target: ≥ 1.8× on H100 class)")
else:
    print("CPU run: no CUDA allocator and no GPU speed figure. Step times above are CPU timing only.")

# %% [markdown]
# ## Results written for the page

# %%
from labkit.provenance import write_results  # noqa: E402

summary = {k: v for k, v in result.items() if k != "provenance"}
summary["inject"] = inj
summary["scale_dynamics"] = dyn.steps
write_results(OUT / "summary.json", summary,
              provenance.collect(lab.LAB, DEVICE, sum(r.wall_time_s for r in runs.values())))
tables = {"recipes": recipes_table, "saved": saved_table, "checks": checks_table, "ops": ops_table,
          "scaler": scaler_table, "inject": inject_table, "band": band_text}
# sentences a page includes mid-paragraph: a final newline would end its paragraph there
PROSE = {"band"}
for name, text in tables.items():
    (OUT / f"{name}.md").write_text(text if name in PROSE else text + "\n")
(OUT / "provenance.md").write_text(nbk.provenance_markdown(record))
print(sorted(p.name for p in OUT.iterdir()))
