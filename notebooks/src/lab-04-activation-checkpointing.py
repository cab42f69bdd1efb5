# %% [markdown]
# # Lab 04 · Activation checkpointing, measured
#
# This notebook runs the Lab 04 starter, `code/lab-04-activation-checkpointing/checkpointing.py`,
# and measures four ways of keeping activations for backward: none, full (one checkpoint per
# block), every-k (one checkpoint per segment of k blocks) and save-matmuls (an op-level policy that
# keeps matmul outputs and recomputes the rest; on a CPU with dropout that includes the T×T attention
# scores, which Korthikanti et al.'s "selective recomputation" drops instead). It is executed by
# `scripts/run_notebooks.py`, never edited by hand; the provenance cell below says where and when.
#
# What to look for:
#
# 1. Checkpointing lowers the activation mountain; the recomputed tensors reappear in backward.
# 2. Every strategy gives the same gradients as no checkpointing, bit for bit, with dropout on.
# 3. The segment size k trades kept boundaries (n/k of them) against the recompute window (k
#    blocks): the derived curve sits on the measured points.
#
# **Activation memory** in this lab is the highest value, over forward and backward, of the
# ledger's `activations` + `temporaries` categories. Recomputed tensors are born in backward, so
# the ledger counts them as temporaries: they are part of the peak, as they are on a real GPU.
# We also report the bytes **kept after forward** (`activations` alive when forward ends).

# %%
import os
import sys
from pathlib import Path

ROOT = Path(os.environ.get("INFRALAB_ROOT") or next(
    p for p in [Path.cwd(), *Path.cwd().parents] if (p / "code" / "labkit").is_dir()))
sys.path.insert(0, str(ROOT / "code"))

import torch  # noqa: E402

from labkit import notebook as nbk  # noqa: E402
from labkit import plot, provenance  # noqa: E402

lab = nbk.load_lab("lab-04-activation-checkpointing/checkpointing.py")
DEVICE = lab.pick_device(nbk.device_name())
OUT = nbk.results_dir(lab.LAB)
ON_GPU = DEVICE.type == "cuda"
if not ON_GPU:
    torch.set_num_threads(1)  # CPU timings on a shared machine are steadier with one thread
# Small on a CPU; GPU-sized on a GPU (the same code either way).
SIZE = (["--width", "1024", "--layers", "16", "--heads", "16", "--seq-len", "1024", "--batch-size", "8",
         "--steps", "10"]
        if ON_GPU else ["--steps", "3"])  # on a CPU: the command line's defaults, so `run_cpu` prints these bytes
BASE = ["--device", DEVICE.type, "--json", "--dropout", "0.1", *SIZE]
print("device:", DEVICE, "| threads:", torch.get_num_threads(), "| results go to:", OUT.relative_to(OUT.parents[1]))

# %% tags=["provenance"]
record = provenance.collect(lab.LAB, DEVICE)
nbk.show_provenance(record)

# %% [markdown]
# ## Four strategies, one step each under the ledger
#
# `lab.run` is what the command line calls: a reference step without checkpointing, then for each
# strategy one step under the memory ledger, one plain step (gradients without the ledger), one
# step under `FlopCounterMode`, and finally `--steps` timed steps, strategies interleaved.

# %%
args = lab.parse_args([*BASE, "--strategy", "all"])
run = lab.run(args)
result = lab.summary(run)
R = result["results"]
n, k = args.layers, args.every
b = args.batch_size * args.seq_len * args.width * 4  # one fp32 block input, bytes
print(f"{n} blocks, every-k with k = {k}; one block input = {b:,} B; wall time {run.wall_time_s:.1f} s")

# %% [markdown]
# ## The timelines
#
# Same model, same batch, same dropout masks; only the checkpointing differs. The y-axes are shared.
# Temporaries are hatched, so the recomputed tensors stand out without relying on colour.

# %%
import matplotlib.pyplot as plt  # noqa: E402

names = list(R)
fig, axes = plt.subplots(len(names), 1, figsize=(10, 2.6 * len(names)), dpi=110, layout="constrained")
top = max(r["peak_bytes"] for r in R.values())
unit, size = plot.pick_unit(top)
for ax, s in zip(axes, names):
    plot.plot_timeline(run.ledgers[s].timeline(), ax=ax,
                       title=f"{s}: activation peak {plot.format_bytes(R[s]['activation_peak_bytes'])} "
                             f"(measured, {DEVICE.type})")
    ax.set_ylim(0, top / size * 1.12)
    ax.set_ylabel(f"live bytes ({unit})")
    legend = ax.get_legend()
    marked = [a for a in ax.collections if a.get_label() == "temporaries"]
    if ax is axes[0]:
        marked += [h for h, t in zip(legend.legend_handles, legend.get_texts()) if t.get_text() == "temporaries"]
    for area in marked:  # white hatching (matplotlib >= 3.10 colours hatches on their own)
        area.set_hatch("///")
        if hasattr(area, "set_hatchcolor"):
            area.set_hatchcolor("white")
        else:
            area.set_edgecolor("white")
    if ax is not axes[0]:
        legend.remove()
plot.save(fig, OUT / "timelines.svg")

# %% [markdown]
# ## Memory and recompute per strategy (measured)
#
# Step times are wall clock on this device. On a CPU they show the direction of the cost, not
# what a GPU would pay: the GPU targets (`GPU_TARGETS` in the starter) are checked only by a GPU run.

# %%
fmt = plot.format_bytes
rows = ["| strategy | kept after forward | activation peak | reduction | recompute FLOPs "
        f"| step ({DEVICE.type}) | overhead | gradients |",
        "|---|---:|---:|---:|---:|---:|---:|---|"]
for s, r in R.items():
    same = "reference" if s == "none" else ("identical" if r["grads_equal"] else
                                            f"max diff {r['max_abs_grad_diff']:.1e}")
    label = f"every-k (k = {k})" if s == "every-k" else s
    rows.append(f"| {label} | {fmt(r['kept_bytes'])} | {fmt(r['activation_peak_bytes'])} | "
                f"{r['activation_reduction']:.0%} | {r['recompute_flops'] / 1e6:,.1f} M "
                f"({r['recompute_flops_of_forward']:.0%}) | {r['step_time_s'] * 1e3:.1f} ms | "
                f"{r['time_overhead']:+.0%} | {same} |")
strategies_table = "\n".join(rows)
nbk.show_markdown(strategies_table)
for s, r in R.items():
    assert r["grads_equal"] and r["grads_equal_without_ledger"], s
assert R["full"]["activation_peak_bytes"] < R["save-matmuls"]["activation_peak_bytes"] < R["none"]["activation_peak_bytes"]
targets = "; ".join(f"{name}: at least {t['min_activation_reduction']:.0%} activation reduction at no more than "
                    f"{t['max_time_overhead']:.0%} step-time overhead" for name, t in lab.GPU_TARGETS.items())
gpu_targets_text = (f"**Targets for the GPU run, not results** (`GPU_TARGETS` in the starter, checked by "
                    f"`pytest -m cuda` with the GPU command in the Run it box): {targets}.")
nbk.show_markdown(gpu_targets_text)
full_text = (f"In my CPU run, one checkpoint per block cut the toy GPT's activation peak by "
             f"{R['full']['activation_reduction']:.0%} (the strategies table's reduction column),")
slowest = max(R, key=lambda s: R[s]["step_time_s"])
sm = R["save-matmuls"]
save_matmuls_text = (f"save-matmuls recomputes {sm['recompute_flops']:,} counted FLOPs, yet on this {'GPU' if ON_GPU else 'CPU'} "
                     f"its step time is {sm['time_overhead']:+.0%} against none"
                     + (", the slowest of the four" if slowest == "save-matmuls" else "")
                     + " (strategies table): the policy is a Python call for every op of every checkpointed block.")
nbk.show_markdown(full_text + "\n\n" + save_matmuls_text)

# %%
fig2, (ax_mem, ax_flop, ax_time) = plt.subplots(3, 1, figsize=(6.5, 8.5), dpi=110, layout="constrained")
colors = ["#8C8C8C", "#4C72B0", "#DD8452", "#55A868"]
ax_mem.bar(names, [R[s]["activation_peak_bytes"] / 2**20 for s in names], color=colors)
ax_mem.bar(names, [R[s]["kept_bytes"] / 2**20 for s in names], color="white", alpha=0.45, hatch="//",
           label="kept after forward")
ax_mem.set(title="activation peak (measured)", ylabel="MiB")
ax_mem.legend(fontsize=8)
ax_flop.bar(names, [100 * R[s]["recompute_flops_of_forward"] for s in names], color=colors)
ax_flop.set(title="recompute FLOPs (counted)", ylabel="% of forward FLOPs")
ax_time.bar(names, [R[s]["step_time_s"] * 1e3 for s in names], color=colors)
ax_time.set(title=f"step time ({DEVICE.type} wall clock)", ylabel="ms, median")
for ax in (ax_mem, ax_flop, ax_time):
    ax.grid(axis="y", alpha=0.3)
    ax.tick_params(axis="x", labelsize=8)
plot.save(fig2, OUT / "cost.svg")

# %% [markdown]
# ## Formula against measurement
#
# Each row is **derived** (formula shown) next to the **measured** figure. With
# B = batch, T = sequence, w = width, h = heads, N = B·T tokens and b = 4·N·w bytes (one fp32
# block input):
#
# - a checkpointed segment keeps exactly its input, so full and every-k differ by
#   (n − ⌈n/k⌉)·b kept bytes;
# - the save-matmuls policy keeps every matmul output in each block: the four linear layers
#   (3w + w + 4w + w per token) and, on the CPU math attention path that dropout selects, the two
#   attention matmuls (scores B·h·T², and B·T·w); all fp32;
# - a checkpointed block recomputes its forward matmuls in backward: 2·N·12w² for the linear
#   layers plus 4·B·T²·w for attention, per block;
# - a block without checkpointing keeps 72·N·w + 12·B·h·T² + 16·N bytes: the per-layer count of
#   Korthikanti et al. (2022), 34·s·b·h + 5·a·s²·b bytes for 2-byte tensors and 1-byte dropout
#   masks, rewritten for fp32 tensors and the 4-byte masks that CPU dropout uses, plus the two
#   layer norms' fp32 mean and 1/std per token (16·N).

# %%
import math  # noqa: E402

N, w, h, T, B = args.batch_size * args.seq_len, args.width, args.heads, args.seq_len, args.batch_size
block_flops = 2 * N * 12 * w * w + 4 * B * T * T * w
checks = [
    ("kept: full − every-k", "(n − ⌈n/k⌉)·b", (n - math.ceil(n / k)) * b,
     R["full"]["kept_bytes"] - R["every-k"]["kept_bytes"], "B"),
    ("recompute FLOPs, full", "n·(24·N·w² + 4·B·T²·w)", n * block_flops, R["full"]["recompute_flops"], "FLOP"),
    ("recompute FLOPs, every-k", "the same: every block once", n * block_flops, R["every-k"]["recompute_flops"], "FLOP"),
]
if not ON_GPU:  # CPU: dropout sends attention down the math path (two bmm), and both bmm outputs are saved
    checks += [
        ("kept: save-matmuls − full", "n·4·(10·N·w + B·h·T²)", n * 4 * (10 * N * w + B * h * T * T),
         R["save-matmuls"]["kept_bytes"] - R["full"]["kept_bytes"], "B"),
        ("recompute FLOPs, save-matmuls", "0: every matmul is kept", 0, R["save-matmuls"]["recompute_flops"], "FLOP"),
        ("kept per block, none", "72·N·w + 12·B·h·T² + 16·N", 72 * N * w + 12 * B * h * T * T + 16 * N,
         (R["none"]["kept_bytes"] - R["full"]["kept_bytes"]) // n + b, "B"),
    ]
rows = ["| quantity | formula | derived | measured |", "|---|---|---:|---:|"]
for name, formula, derived, measured, u in checks:
    rows.append(f"| {name} | {formula} | {derived:,} {u} | {measured:,} {u} |")
    assert derived == measured, (name, derived, measured)
checks_table = "\n".join(rows)
nbk.show_markdown(checks_table)
a_default = (R["none"]["kept_bytes"] - R["full"]["kept_bytes"]) // n + b  # what one block keeps, measured

# %% [markdown]
# ## The segment rule: how big should a segment be?
#
# Checkpoint n blocks in segments of k. After forward, each segment has kept only its input:
# ⌈n/k⌉·b. In backward, a segment is recomputed as a whole, so for a while its k blocks hold
# everything a block saves, a bytes each. With C for what lives outside the blocks (embedding,
# head, loss), the derivation gives
#
# kept(k) = C + ⌈n/k⌉·b and peak(k) ≈ C + ⌈n/k⌉·b + k·a,
#
# and peak(k) (with n/k for ⌈n/k⌉) is smallest where its derivative −n·b/k² + a is zero:
# **k\* = √(n·b/a)**. When a block keeps about as much as its input (a ≈ b, a chain of simple
# layers), that is the textbook **k\* = √n**. A transformer block keeps far more than its input,
# so here k\* is much smaller. C, a and b come from the `none` and `full` runs and the shape,
# not from the sweep: the curves below are predictions, and the points are measured.

# %%
sweep_n = 16
SWEEP = (["--width", "1024", "--heads", "16", "--seq-len", "1024", "--batch-size", "4"] if ON_GPU
         else ["--width", "32", "--heads", "2", "--seq-len", "32", "--batch-size", "4", "--vocab", "64"])
sargs = lab.parse_args(["--device", DEVICE.type, "--dropout", "0.1", "--layers", str(sweep_n), *SWEEP])
_, _, smodel, sx, sy = lab.build(sargs)
sb = sargs.batch_size * sargs.seq_len * sargs.width * 4
ks = [1, 2, 4, 8, 16]
mem = {"none": lab.activation_memory(lab.measure_memory(smodel, sx, sy, "none", 1, 0)[0])}
for kk in ks:
    mem[kk] = lab.activation_memory(lab.measure_memory(smodel, sx, sy, "every-k", kk, 0)[0])
C = mem[1]["kept_bytes"] - sweep_n * sb  # kept by full = C + n·b
a = (mem["none"]["kept_bytes"] - C) / sweep_n  # kept by none = C + n·a
k_star = math.sqrt(sweep_n * sb / a)


def kept_pred(kk):
    return C + math.ceil(sweep_n / kk) * sb


def peak_pred(kk):
    return C + math.ceil(sweep_n / kk) * sb + kk * a


print(f"n = {sweep_n}, b = {sb:,} B, a = {a:,.0f} B per block (a/b = {a / sb:.1f}), C = {C:,} B; "
      f"k* = sqrt(n b / a) = {k_star:.2f}; sqrt(n) = {math.sqrt(sweep_n):.0f}")
for kk in ks:
    assert mem[kk]["kept_bytes"] == kept_pred(kk) or ON_GPU, kk  # exact on CPU

# %%
fig3, (ax, ax2) = plt.subplots(2, 1, figsize=(7.5, 9), dpi=110, layout="constrained")  # stacked: phones
grid = [x / 10 for x in range(10, 10 * sweep_n + 1)]
ax.plot(grid, [(C + sweep_n / x * sb + x * a) / 2**20 for x in grid], color="#d62728", lw=1.4, ls="--",
        label="derived peak: C + (n/k)·b + k·a")
ax.plot(ks, [mem[kk]["activation_peak_bytes"] / 2**20 for kk in ks], "o", color="#d62728", ms=7,
        label="measured activation peak")
ax.plot(grid, [kept_pred(x) / 2**20 for x in grid], color="#4C72B0", lw=1.2, ls=":",
        label="derived kept after forward: C + ⌈n/k⌉·b")
ax.plot(ks, [mem[kk]["kept_bytes"] / 2**20 for kk in ks], "s", color="#4C72B0", ms=6,
        label="measured kept after forward")
ax.axhline(mem["none"]["activation_peak_bytes"] / 2**20, color="#8C8C8C", lw=1, label="none: activation peak")
ax.set(xscale="log", xlabel="k: blocks per checkpointed segment", ylabel="MiB",
       title=f"{sweep_n}-block TinyGPT ({DEVICE.type}): points measured, lines derived")
ax.set_xticks(ks, [str(kk) for kk in ks])
ax.legend(fontsize=8, loc="upper left")
ax.grid(alpha=0.3)
# The rule itself, in units of one block input b: (n/k) + (a/b)·k, for three exchange rates a/b.
for ratio, color, label in ((1.0, "#8172B3", "a = b: a chain of simple layers"), (4.0, "#17becf", "a = 4b"),
                            (a / sb, "#d62728", f"a = {a / sb:.1f}b: this TinyGPT block (measured)")):
    ax2.plot(grid, [sweep_n / x + ratio * x for x in grid], color=color, lw=1.4, label=label)
    kk_star = math.sqrt(sweep_n / ratio)
    if kk_star >= 1:
        ax2.plot([kk_star], [2 * math.sqrt(sweep_n * ratio)], "v", color=color, ms=8)
ax2.plot(ks, [(mem[kk]["activation_peak_bytes"] - C) / sb for kk in ks], "o", color="#d62728", ms=6,
         label="measured (peak − C) / b")
ax2.set(xscale="log", yscale="log", xlabel="k", ylabel="block inputs (b)",
        title=f"the rule: smallest at k* = √(n·b/a) (▼); √n = {math.sqrt(sweep_n):.0f} needs a = b")
ax2.set_xticks(ks, [str(kk) for kk in ks])
ax2.legend(fontsize=8, loc="upper left")
ax2.grid(alpha=0.3, which="both")
plot.save(fig3, OUT / "segments.svg")

# %%
rows = ["| k | segments ⌈n/k⌉ | kept, measured | kept, derived | peak, measured | peak, derived | error |",
        "|---:|---:|---:|---:|---:|---:|---:|"]
for kk in ks:
    m, p = mem[kk], peak_pred(kk)
    rows.append(f"| {kk} | {math.ceil(sweep_n / kk)} | {fmt(m['kept_bytes'])} | {fmt(kept_pred(kk))} | "
                f"{fmt(m['activation_peak_bytes'])} | {fmt(p)} | {(p - m['activation_peak_bytes']) / m['activation_peak_bytes']:+.1%} |")
segments_table = "\n".join(rows)
nbk.show_markdown(segments_table)
best = min(ks, key=lambda kk: mem[kk]["activation_peak_bytes"])
worst_error = max(abs(peak_pred(kk) / mem[kk]["activation_peak_bytes"] - 1) for kk in ks)
print(f"measured best k = {best}; derived k* = {k_star:.2f}; worst peak prediction error {worst_error:.1%}")
if not ON_GPU:
    assert best == min(ks, key=peak_pred) and worst_error < 0.05, worst_error
ratio_text = (f"In this lab's default run a block keeps a = {a_default:,} B for backward, a/b = {a_default / b:.1f} "
              f"times its own input b = {b:,} B, and a block of the segment sweep's shape {a / sb:.1f} times "
              f"(measured); so two blocks per segment beat one only beyond 2·a/b ≈ {2 * a_default / b:.0f} blocks "
              f"(derived).")
nbk.show_markdown(ratio_text)

# %% [markdown]
# ## Allocated against reserved (CUDA only)
#
# On a GPU, `lab.run` also records `max_memory_allocated` for each strategy's ledger step; the
# ledger's peak should be within a few percent of it. On a CPU there is no caching allocator to
# compare with, and this cell says so.

# %%
if ON_GPU:
    for s, r in R.items():
        c = r["cuda"]
        print(f"{s}: ledger peak {fmt(r['peak_bytes'])}, max allocated {fmt(c['max_memory_allocated'])}, "
              f"ratio {c['ledger_peak_over_max_allocated']:.3f}")
else:
    print("CPU run: no CUDA allocator here, so no allocated/reserved figures and no snapshot.")

# %% [markdown]
# ## Results written for the page

# %%
from labkit.provenance import write_results  # noqa: E402

summary = {k2: v for k2, v in result.items() if k2 != "provenance"}
summary["per_block_bytes_default"] = a_default
summary["segments"] = {"n": sweep_n, "block_input_bytes": sb, "per_block_bytes": a, "outside_bytes": C,
                       "k_star": k_star, "measured": {str(kk): mem[kk] for kk in ks}, "none": mem["none"]}
write_results(OUT / "summary.json", summary, provenance.collect(lab.LAB, DEVICE, run.wall_time_s))
tables = {"strategies": strategies_table, "checks": checks_table, "segments": segments_table,
          "ratio": ratio_text, "gpu_targets": gpu_targets_text, "full_reduction": full_text,
          "save_matmuls_time": save_matmuls_text}
# sentences a page includes mid-paragraph: a final newline would end its paragraph there
PROSE = {"ratio", "gpu_targets", "full_reduction", "save_matmuls_time"}
for name, text in tables.items():
    (OUT / f"{name}.md").write_text(text if name in PROSE else text + "\n")
(OUT / "provenance.md").write_text(nbk.provenance_markdown(record))
print(sorted(p.name for p in OUT.iterdir()))
