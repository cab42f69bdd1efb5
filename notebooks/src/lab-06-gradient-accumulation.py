# %% [markdown]
# # Lab 06 · Gradient accumulation, measured
#
# This notebook runs the Lab 06 starter, `code/lab-06-gradient-accumulation/grad_accumulation.py`,
# and measures three claims. It is executed by `scripts/run_notebooks.py`, never edited by hand;
# the provenance cell below says where and when. On a CPU the byte counts are exact; speed and
# allocator behaviour need a GPU run.
#
# 1. k micro-batches, each loss divided by k, give the gradients of one large batch: not bit for
#    bit, but within a few roundings of fp32.
# 2. At a fixed micro-batch the peak does not grow with the effective batch; a large batch's peak
#    grows with every sample.
# 3. Given a byte budget, the trainer probes real steps with the ledger, picks a micro-batch size
#    and checkpointing that fit, and its run stays under the budget.

# %%
import math
import os
import sys
from pathlib import Path

ROOT = Path(os.environ.get("INFRALAB_ROOT") or next(
    p for p in [Path.cwd(), *Path.cwd().parents] if (p / "code" / "labkit").is_dir()))
sys.path.insert(0, str(ROOT / "code"))

import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from labkit import GPTConfig, UsageError  # noqa: E402
from labkit import notebook as nbk  # noqa: E402
from labkit import plot, provenance  # noqa: E402

lab = nbk.load_lab("lab-06-gradient-accumulation/grad_accumulation.py")
DEVICE = lab.pick_device(nbk.device_name())
OUT = nbk.results_dir(lab.LAB)
ON_GPU = DEVICE.type == "cuda"
# Small on a CPU; GPU-sized on a GPU (the same code either way).
CFG = (GPTConfig(vocab=256, seq_len=512, width=1024, layers=8, heads=16) if ON_GPU
       else GPTConfig(vocab=256, seq_len=64, width=128, layers=2, heads=4))
SMALL_CFG = GPTConfig(vocab=256, seq_len=64, width=128, layers=2, heads=4)  # gradient checks run on CPU
MICRO = 4  # the fixed micro-batch of the memory sweep
KS = [1, 2, 4, 8]
if not ON_GPU:
    torch.set_num_threads(1)  # tiny tensors: one thread is as fast, and never fights a busy machine
print("device:", DEVICE, "| results go to:", OUT.relative_to(OUT.parents[1]))

# %% tags=["provenance"]
record = provenance.collect(lab.LAB, DEVICE)
nbk.show_provenance(record)

# %% [markdown]
# ## 1 · The same gradients, up to summation order
#
# `lab.gradient_gap` computes the gradients of one batch of 16 samples, then the gradients of the
# same 16 samples as k micro-batches through `lab.accumulate` (the function the trainer uses),
# and compares them parameter by parameter. It runs in fp32 on the CPU, dropout off. The row
# "without 1/k" repeats k micro-batches but forgets to divide each loss by k.

# %%
GAP_KS = [1, 2, 4, 8, 16]
gaps = [lab.gradient_gap(SMALL_CFG, 16, k) for k in GAP_KS]
unscaled = [lab.gradient_gap(SMALL_CFG, 16, k, scale=False) for k in GAP_KS[1:]]
EPS = 2.0 ** -23  # fp32 machine epsilon: the relative size of one rounding


def ulp(x: float) -> float:
    """Spacing of fp32 numbers at |x|: one unit in the last place."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 23)


rows = ["| k | max abs diff | ÷ max abs grad | fp32 ulps | bit-exact | norm ratio |", "|---|---:|---:|---:|:---:|---:|"]
for g in gaps:
    rel = g["max_abs_diff"] / g["max_abs_grad"]
    rows.append(f"| {g['k']} | {g['max_abs_diff']:.2e} | {rel:.2e} | {g['max_abs_diff'] / ulp(g['max_abs_grad']):.2f} | "
                f"{'yes' if g['bit_exact'] else 'no'} | {g['norm_ratio']:.7f} |")
    assert g["max_abs_diff"] <= lab.TOLERANCE * g["max_abs_grad"], g
for g in unscaled:
    rel = g["max_abs_diff"] / g["max_abs_grad"]
    rows.append(f"| {g['k']}, **no 1/k** | {g['max_abs_diff']:.2e} | {rel:.2e} | "
                f"{g['max_abs_diff'] / ulp(g['max_abs_grad']):.1e} | no | {g['norm_ratio']:.4f} |")
    assert abs(g["norm_ratio"] - g["k"]) <= g["k"] * lab.TOLERANCE
assert gaps[0]["bit_exact"]
equivalence_table = "\n".join(rows)
nbk.show_markdown(equivalence_table)

# %%
fig, ax = plt.subplots(figsize=(7.5, 3.8), dpi=110, layout="constrained")
ks = [g["k"] for g in gaps[1:]]
ax.semilogy(ks, [g["max_abs_diff"] / g["max_abs_grad"] for g in gaps[1:]], "o-", color="#4C72B0",
            label="loss / k (measured)")
ax.semilogy(ks, [g["max_abs_diff"] / g["max_abs_grad"] for g in unscaled], "s--", color="#C44E52",
            label="without 1/k (measured)")
ax.axhline(lab.TOLERANCE, color="#333333", lw=1, ls=":", label=f"tolerance {lab.TOLERANCE:g} (asserted)")
ax.axhline(EPS, color="#55A868", lw=1, ls="-.", label="fp32 machine epsilon, 2^-23")
ax.set_xscale("log", base=2)
ax.set_xticks(ks, [str(k) for k in ks])
ax.set(xlabel="micro-batches k (16 samples in all)", ylabel="max |g_acc - g_large| / max |g_large|",
       title="Accumulated against large-batch gradients (k = 1 is bit-exact: not drawn on a log axis)")
ax.title.set_fontsize(9)
ax.legend(fontsize=8, loc="center right")
ax.grid(alpha=0.3, which="both")
svg = plot.save(fig, OUT / "gradient_gap.svg")


# %% [markdown]
# ## 2 · Peak memory against the effective batch
#
# Two sweeps over the same effective batches B = 4 · k, k = 1, 2, 4, 8. **Accumulation** keeps the micro-batch at
# 4 samples and runs k of them per step; the **large batch** runs all B samples in one pass. Each
# point is the ledger's peak over two AdamW steps (step 1 carries the optimizer state).
#
# Derived lines: the model state is 4 B (parameters) + 4 B (gradients) + 8 B (AdamW moments) per
# parameter + 4 B per parameter tensor (AdamW's step counters): a floor no batch size can go
# under. The large batch's line is linear in B, with its slope taken from the two smallest
# measured batches; the accumulation line is flat at the k = 2 measurement.

# %%
acc = {k: lab.run_steps(CFG, DEVICE, MICRO, k, False, steps=2) for k in KS}
large = {k: (acc[1] if k == 1 else lab.run_steps(CFG, DEVICE, MICRO * k, 1, False, steps=2)) for k in KS}
acc_peak = {k: r.ledger.peak() for k, r in acc.items()}
large_peak = {k: r.ledger.peak() for k, r in large.items()}
params = list(acc[1].model.parameters())
P, T = sum(p.numel() for p in params), len(params)
floor = 16 * P + 4 * T
B = [MICRO * k for k in KS]
slope = (large_peak[2]["total"] - large_peak[1]["total"]) / (B[1] - B[0])
large_line = [large_peak[1]["total"] + (b - B[0]) * slope for b in B]
acc_line = acc_peak[2]["total"]

rows = ["| effective batch | accumulation | its peak | large-batch peak | derived line | large ÷ accumulation |",
        "|---:|---:|---:|---:|---:|---:|"]
for k, b, line in zip(KS, B, large_line):
    a, g = acc_peak[k]["total"], large_peak[k]["total"]
    rows.append(f"| {b} | {k} x {MICRO} | {plot.format_bytes(a)} | {plot.format_bytes(g)} | {plot.format_bytes(line)} | "
                f"{g / a:.2f}x |")
flat_table = "\n".join(rows)
nbk.show_markdown(flat_table)
print(f"P = {P:,} parameters in {T} tensors; model-state floor 16 B x P + 4 B x T = {floor:,} B; "
      f"large-batch slope {slope:,.0f} B per sample (derived from B = {B[0]} and {B[1]})")
if not ON_GPU:  # exact on CPU: the ledger counts storage bytes, and the op sequence is fixed
    assert all(acc_peak[k] == acc_peak[2] for k in KS[1:]), "accumulation peak is not flat"
    assert acc_peak[1]["total"] < acc_peak[2]["total"]  # k = 1 has no full gradients under its activations
    assert all(large_peak[k]["total"] == line for k, line in zip(KS, large_line)), "large batch is not linear"
    assert acc_peak[8]["gradients"] == 4 * P and acc_peak[8]["optimizer_state"] == 8 * P + 4 * T

# %%
fig, ax = plt.subplots(figsize=(8, 4.2), dpi=110, layout="constrained")
unit, size = plot.pick_unit(max(large_peak[k]["total"] for k in KS))
ax.plot(B, [large_peak[k]["total"] / size for k in KS], "s", color="#C44E52", ms=7,
        label="one large batch (measured)")
ax.plot(B, [v / size for v in large_line], "--", color="#C44E52", lw=1,
        label="derived: linear in B (slope from the first two points)")
ax.plot(B, [acc_peak[k]["total"] / size for k in KS], "o", color="#4C72B0", ms=7,
        label=f"accumulation, micro-batch {MICRO} (measured)")
ax.axhline(acc_line / size, color="#4C72B0", lw=1.2, ls="-.", label="derived: flat at the k = 2 peak")
ax.axhline(floor / size, color="#8172B3", lw=1, ls=":", label="derived: model state, 16 B/param + 4 B/tensor")
ax.set_xticks(B, [str(b) for b in B])
ax.set_xlim(0, B[-1] * 1.05)
ax.set_ylim(0, None)
ax.set(xlabel="effective batch (samples per optimizer step)", ylabel=f"peak live bytes ({unit})",
       title=f"Peak against effective batch on {DEVICE.type} (ledger, 2 AdamW steps each)")
ax.title.set_fontsize(10)
ax.legend(fontsize=8, loc="upper left")
ax.grid(alpha=0.3)
svg = plot.save(fig, OUT / "peak_vs_batch.svg")


# %% [markdown]
# What sits under the accumulation peak, against the large batch's peak at the same effective
# batch (B = 32): the activations of one micro-batch of 4 samples, against those of 32 samples.

# %%
compare_table = plot.peak_table({f"accumulation 8 x {MICRO}": acc_peak[8], f"large batch {MICRO * 8}": large_peak[8]})
compare_table = compare_table.replace("| phase |", "| run (peak moment) |")
nbk.show_markdown(compare_table)

# %% [markdown]
# ## 3 · The budget trainer's decisions
#
# For each budget, `lab.plan` measures probe runs (two steps each, with at most two
# micro-batches: the peak does not depend on k beyond that, section 2) in this order: the
# smallest configuration first (micro-batch 1, checkpointing on), to fail fast; then micro-batch
# sizes upward without checkpointing until one does not fit; then, only if not even micro-batch
# 1 fits without it, the same with checkpointing. The chosen configuration then trains for two
# steps under a fresh ledger, and its peak is checked against the budget. The effective batch is
# 8 samples throughout.

# %%
BATCH = 8
MIB = 1 << 20
budgets = ([int(f * floor) for f in (3.0, 2.0, 1.5, 1.2, 1.05)] if ON_GPU
           else [16 * MIB, int(12.5 * MIB), 10 * MIB, int(8.5 * MIB), 8 * MIB])
decisions = []
for budget in budgets:
    args = lab.parse_args(["--device", DEVICE.type, "--json", "--batch", str(BATCH), "--steps", "2",
                           "--budget", str(budget), "--seq-len", str(CFG.seq_len), "--width", str(CFG.width),
                           "--layers", str(CFG.layers), "--heads", str(CFG.heads), "--vocab", str(CFG.vocab)])
    try:
        run = lab.train(args)
    except UsageError as err:
        decisions.append({"budget": budget, "error": str(err), "probes": None, "run": None})
        continue
    decisions.append({"budget": budget, "error": None, "probes": run.probes, "run": run})
    peak = run.ledger.peak()["total"]
    chosen = next(p for p in run.probes if (p["micro_batch"], p["checkpoint"]) == (run.micro_batch, run.checkpoint))
    assert peak <= budget, (budget, peak)  # the run stays under the budget, on the ledger
    if not ON_GPU:
        assert peak == chosen["peak_bytes"]  # the probe measured exactly this run's peak

rows = ["| budget | probes, in order (micro-batch · checkpointing: measured peak) | choice | run peak |",
        "|---:|---|---|---:|"]

for d in decisions:
    if d["error"]:
        rows.append(f"| {plot.format_bytes(d['budget'])} | {d['error'].split(': ', 1)[1]} | **cannot be met** "
                    "(exit code 2) | |")
        continue
    r = d["run"]
    probes = ", ".join(f"{p['micro_batch']}·{'on' if p['checkpoint'] else 'off'}: "
                       f"{plot.format_bytes(p['peak_bytes'])} {'✓' if p['fits'] else '✗'}" for p in d["probes"])
    rows.append(f"| {plot.format_bytes(d['budget'])} | {probes} | micro-batch {r.micro_batch}, k = {r.accum_steps}, "
                f"checkpointing {'on' if r.checkpoint else 'off'} | {plot.format_bytes(r.ledger.peak()['total'])} |")
decisions_table = "\n".join(rows)
nbk.show_markdown(decisions_table)
assert decisions[-1]["error"] and "cannot be met" in decisions[-1]["error"]
assert any(d["run"] and d["run"].checkpoint for d in decisions), "no budget needed checkpointing"

# %% [markdown]
# ## 4 · The chosen run against its budget
#
# The ledger timeline of one budgeted run from the table (the 10 MiB budget on CPU), both its
# steps, with the budget drawn as a horizontal line. Each forward/backward pair is one micro-batch.

# %%
pick = decisions[2]
r = pick["run"]
tl = r.ledger.timeline()
fig = plot.plot_timeline(
    tl, title=(f"Lab 06 · budget {plot.format_bytes(pick['budget'])}: {r.accum_steps} micro-batches of "
               f"{r.micro_batch}, checkpointing {'on' if r.checkpoint else 'off'} ({DEVICE.type}, ledger)"),
    overlay={f"budget {plot.format_bytes(pick['budget'])}": [pick["budget"]] * len(tl)})
svg = plot.save(fig, OUT / "budget_timeline.svg")

assert max(tl.device_total()) <= pick["budget"]
micro_peaks = [max(tl.device_total()[s.start:s.end]) for s in tl.spans if s.name == "backward" and s.step == 1]
print("peak of each backward in step 1:", [f"{v:,}" for v in micro_peaks])
if not ON_GPU:
    assert len(set(micro_peaks[1:])) == 1  # every micro-batch after the first peaks the same

# %% [markdown]
# ## Allocated against reserved (CUDA only)
#
# On a GPU the ledger also samples `torch.cuda.memory_allocated` and `memory_reserved`, so the
# budgeted run's ledger peak can be compared with `max_memory_allocated`. On a CPU there is no
# caching allocator to compare with, and this cell says so.

# %%
if ON_GPU:
    c = pick["run"].cuda
    print(f"max allocated {plot.format_bytes(c['max_memory_allocated'])}, max reserved "
          f"{plot.format_bytes(c['max_memory_reserved'])}, budget {plot.format_bytes(pick['budget'])}, "
          f"ledger peak / max allocated {pick['run'].ledger.peak()['total'] / c['max_memory_allocated']:.4f}")
else:
    print("CPU run: no CUDA allocator here, so no allocated/reserved comparison.")

# %% [markdown]
# ## Results written for the page

# %%
from labkit.provenance import write_results  # noqa: E402

summary = {
    "config": CFG.to_dict(), "gradient_check_config": SMALL_CFG.to_dict(), "tolerance": lab.TOLERANCE,
    "gradient_gap": gaps, "gradient_gap_without_1_over_k": unscaled,
    "params": P, "param_tensors": T, "model_state_floor_bytes": floor, "micro_batch": MICRO,
    "effective_batch": B, "accumulation_peak_bytes": [acc_peak[k]["total"] for k in KS],
    "large_batch_peak_bytes": [large_peak[k]["total"] for k in KS], "large_batch_slope_bytes": slope,
    "decisions": [{"budget_bytes": d["budget"], "error": d["error"], "probes": d["probes"],
                   "micro_batch": d["run"] and d["run"].micro_batch, "checkpoint": d["run"] and d["run"].checkpoint,
                   "run_peak_bytes": d["run"] and d["run"].ledger.peak()["total"]} for d in decisions],
}
wall = sum(r.wall_time_s for r in [*acc.values(), *large.values()])
write_results(OUT / "summary.json", summary, provenance.collect(lab.LAB, DEVICE, wall))
tables = {"equivalence": equivalence_table, "flat": flat_table, "compare": compare_table,
          "decisions": decisions_table}
for name, text in tables.items():
    (OUT / f"{name}.md").write_text(text + "\n")
(OUT / "provenance.md").write_text(nbk.provenance_markdown(record))
print(sorted(p.name for p in OUT.iterdir()))
