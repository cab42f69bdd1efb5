# %% [markdown]
# # Lab 09 · Activation offload, measured
#
# This notebook runs the Lab 09 starter, `code/lab-09-activation-offload/activation_offload.py`,
# and measures five ways of keeping the tensors that backward needs: on the device (`none`), on
# the host through PyTorch's `save_on_cpu`, on the host through the lab's streamed hooks, inside
# checkpointed blocks (`checkpoint`, Lab 04's full checkpointing), and checkpointing with the block
# inputs streamed to the host (`checkpoint+streamed`). It is executed by
# `scripts/run_notebooks.py`, never edited by hand; the provenance cell below says where and when.
#
# **How to read a CPU run.** On a CPU-only machine the "device" and the host are the same RAM.
# The ledger keeps them apart by label: every buffer the offload hooks allocate on the host is
# labelled `host_copies` and counted on the host side; everything else is device memory. The byte
# counts are exact. The times are not shown: a CPU has no copy engine beside its cores, so a CPU
# run says nothing about whether a transfer hides under compute.
#
# **Activation peak** is the highest value, over forward and backward, of the ledger's device
# `activations` + `temporaries` (tensors fetched back or recomputed in backward are born there, so
# they are temporaries). **Kept after forward** is the device `activations` when forward ends.

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
from labkit import pick_device, plot, provenance  # noqa: E402

lab = nbk.load_lab("lab-09-activation-offload/activation_offload.py")
DEVICE = pick_device(nbk.device_name())
OUT = nbk.results_dir(lab.LAB)
ON_GPU = DEVICE.type == "cuda"
if not ON_GPU:
    torch.set_num_threads(1)
# On a CPU the command line's defaults (so `run_cpu` prints these bytes), one timed step (CPU times are
# not shown); GPU-sized on a GPU.
SIZE = (["--width", "1024", "--layers", "32", "--heads", "16", "--seq-len", "1024", "--batch-size", "8",
         "--steps", "10"] if ON_GPU else ["--steps", "1"])
BASE = ["--device", DEVICE.type, "--json", *SIZE]
fmt = plot.format_bytes
print("device:", DEVICE, "| results go to:", OUT.relative_to(OUT.parents[1]))

# %% tags=["provenance"]
record = provenance.collect(lab.LAB, DEVICE)
nbk.show_provenance(record)

# %% [markdown]
# ## Five modes, one step each under the ledger
#
# `lab.run` is what the command line calls: a reference step with no hooks and no checkpointing,
# then for each mode one step under the memory ledger, one plain step (gradients without the
# ledger), and finally `--steps` timed steps, modes interleaved.

# %%
args = lab.parse_args([*BASE, "--mode", "all"])
out = lab.run(args)
R = out["results"]
n, K, P = args.layers, args.keep_last, args.prefetch
b = args.batch_size * args.seq_len * args.width * 4  # one fp32 block input, bytes
print(f"{n} blocks; keep-last {K}, prefetch {P}, min-bytes {args.min_bytes}; one block input b = {b:,} B; "
      f"wall time {out['wall_time_s']:.1f} s")

# %%
rows = ["| mode | kept after fwd | activation peak | vs baseline | step's peak | host copies "
        "| moved | tensors |" + (" step | overhead |" if ON_GPU else ""),
        "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if ON_GPU else "")]
for m, r in R.items():
    versus = "reference" if m == "none" else f"{-r['reduction_vs_baseline']:+.0%} ({r['baseline']})"
    rows.append(f"| {m} | {fmt(r['kept_bytes'])} | {fmt(r['activation_peak_bytes'])} | {versus} | "
                f"{fmt(r['peak_bytes'])} | {fmt(r['host_peak_bytes'])} | {fmt(r['d2h_bytes'])} | {r['tensors_moved']} |"
                + (f" {r['step_time_s'] * 1e3:.1f} ms | {r['overhead_vs_baseline']:+.0%} |" if ON_GPU else ""))
modes_table = "\n".join(rows)
nbk.show_markdown(modes_table)
for m, r in R.items():
    assert r["d2h_bytes"] == r["host_bytes_after_forward"], m  # every copy out is made in forward
for m in ("save_on_cpu", "streamed", "checkpoint+streamed"):
    assert R[m]["activation_peak_bytes"] < R["none"]["activation_peak_bytes"], m
assert R["checkpoint+streamed"]["activation_peak_bytes"] < R["checkpoint"]["activation_peak_bytes"]
if not ON_GPU:  # on a GPU a tensor whose copy out has not landed is read from the device: fewer bytes back
    assert all(r["d2h_bytes"] == r["h2d_bytes"] for r in R.values())
    assert R["checkpoint+streamed"]["fetched_on_demand"] == R["streamed"]["fetched_on_demand"] == 0

# %% [markdown]
# ## Gradients: with and without the hooks, with and without the ledger
#
# The ledger is a `TorchDispatchMode`; the hooks run inside it; checkpointing adds its own
# saved-tensor hooks inside ours. None of them may change a number. Dropout is on, so equal
# gradients also mean equal random masks.

# %%
rows = ["| mode | under the ledger | without the ledger | max abs difference |", "|---|---|---|---:|"]
for m, r in R.items():
    if m == "none":
        continue
    rows.append(f"| {m} | {'identical' if r['grads_equal'] else 'differ'} | "
                f"{'identical' if r['grads_equal_without_ledger'] else 'differ'} | {r['max_abs_grad_diff']:.1e} |")
gradients_table = "\n".join(rows)
nbk.show_markdown(gradients_table)
if not ON_GPU:
    assert all(r["grads_equal"] and r["grads_equal_without_ledger"] for r in R.values())

# %% [markdown]
# ## The timelines, on one scale
#
# Device bytes by category (stacked), and the bytes labelled `host_copies` as a dashed line, one
# panel per mode, forward and backward only.

# %%
tls = {m: r["ledger"].timeline().window("forward", "backward") for m, r in R.items()}
top = max(max(max(tl.device_total()), max(tl.host["host_copies"])) for tl in tls.values())
unit, _ = plot.pick_unit(top)
fig, axes = plt.subplots(len(tls), 1, figsize=(10, 2.3 * len(tls)), dpi=110, layout="constrained")
for ax, (m, tl) in zip(axes, tls.items()):
    plot.plot_timeline(tl, ax=ax, overlay={"host copies": tl.host["host_copies"]}, ymax_bytes=top,
                       legend=(m == "none"), max_points=260, unit=unit,
                       title=f"{m}: activation peak {fmt(R[m]['activation_peak_bytes'])}, host copies up to "
                             f"{fmt(R[m]['host_peak_bytes'])} (measured, {DEVICE.type})")
    ax.set_ylabel(f"live bytes ({unit})")
    if ax is not axes[-1]:
        ax.set_xlabel("")
plot.save(fig, OUT / "timelines.svg")

# %% [markdown]
# ## Formula against measurement
#
# With checkpointing, the hooks see only what `checkpoint` keeps: each block's input, b bytes.
# The last K stay on the device; the other n − K go to the host in forward. In backward the first
# recompute (of the last block) is where the activation peak sits. At that moment checkpointing
# alone holds all n inputs; with the streamed hooks the device holds the kept one(s) and the P
# inputs fetched ahead, max(K, 1) + P in all. So:
#
# - host copies after forward = (n − K)·b,
# - kept after forward = checkpoint's kept − (n − K)·b,
# - activation peak = checkpoint's peak − (n − max(K, 1) − P)·b.
#
# The other checks compare the ledger with the hooks' own count of the bytes they copied, and the
# bytes `save_on_cpu` moves with what the streamed hooks move when they filter nothing.

# %%
C, S = R["checkpoint"], R["checkpoint+streamed"]
ahead = min(n, max(K, 1) + P)
checks = [
    ("checkpoint+streamed: host copies after forward", "(n − K)·b", (n - K) * b, S["host_bytes_after_forward"]),
    ("checkpoint+streamed: kept after forward", "checkpoint's − (n − K)·b", C["kept_bytes"] - (n - K) * b,
     S["kept_bytes"]),
    ("checkpoint+streamed: activation peak", "checkpoint's − (n − max(K,1) − P)·b",
     C["activation_peak_bytes"] - (n - ahead) * b, S["activation_peak_bytes"]),
    ("streamed: host copies after forward (ledger)", "bytes the hooks copied", R["streamed"]["d2h_bytes"],
     R["streamed"]["host_bytes_after_forward"]),
    ("save_on_cpu: host copies after forward (ledger)", "bytes its pack hook copied", R["save_on_cpu"]["d2h_bytes"],
     R["save_on_cpu"]["host_bytes_after_forward"]),
]
# save_on_cpu copies every saved tensor, parameters and the batch included; the streamed hooks with
# no filter (min-bytes 0, keep-last 0) and nothing resident copy the same bytes.
every = lab.parse_args([*BASE, "--min-bytes", "0", "--keep-last", "0"])
_, _, model, x, y = lab.build(every)
unfiltered = lab.StreamedOffload(DEVICE, 0, 0, every.prefetch)  # nothing resident
lab.forward(model, x, y, "streamed", unfiltered).backward()
checks.append(("save_on_cpu: bytes moved", "every saved tensor, parameters included", unfiltered.d2h_bytes,
               R["save_on_cpu"]["d2h_bytes"]))
rows = ["| quantity | formula | derived | measured |", "|---|---|---:|---:|"]
for name, formula, derived, measured in checks:
    rows.append(f"| {name} | {formula} | {derived:,} B | {measured:,} B |")
    assert derived == measured or ON_GPU, (name, derived, measured)
checks_table = "\n".join(rows)
nbk.show_markdown(checks_table)

# %% [markdown]
# ## Depth: checkpointing grows by b per block, checkpointing + streamed does not
#
# From the formula above, checkpointing's activation peak grows by one block input b per block,
# while with the inputs streamed the device holds max(K, 1) + P of them whatever the depth. So the
# reduction against checkpointing alone, 1 − (C′ + (K + P)·b) / (C′ + n·b), grows with depth, with
# C′ what the peak holds besides the block inputs (the head and loss, one block's recompute). The
# derived lines use C′ from the shallowest run only; the points are measured.

# %%
DEPTH = (["--width", "1024", "--heads", "16", "--seq-len", "1024", "--batch-size", "4"] if ON_GPU
         else ["--width", "32", "--heads", "2", "--seq-len", "32", "--batch-size", "4", "--vocab", "64"])
depths = [4, 8, 16, 32, 64]
sweep = {}
for d in depths:
    dargs = lab.parse_args(["--device", DEVICE.type, "--layers", str(d), *DEPTH])
    _, _, dmodel, dx, dy = lab.build(dargs)
    sweep[d] = {m: lab.measure(dmodel, dx, dy, m, dargs, 0)[0]["activation_peak_bytes"]
                for m in ("checkpoint", "checkpoint+streamed")}
db = dargs.batch_size * dargs.seq_len * dargs.width * 4
c0 = sweep[depths[0]]["checkpoint"] - depths[0] * db  # C': the peak besides the block inputs


def ckpt_pred(d):
    return c0 + d * db


def streamed_pred(d):
    return c0 + min(d, max(K, 1) + P) * db


rows = ["| blocks n | checkpoint: measured | derived | checkpoint+streamed: measured | derived "
        "| reduction vs checkpoint |", "|---:|---:|---:|---:|---:|---:|"]
for d in depths:
    s = sweep[d]
    rows.append(f"| {d} | {fmt(s['checkpoint'])} | {fmt(ckpt_pred(d))} | {fmt(s['checkpoint+streamed'])} | "
                f"{fmt(streamed_pred(d))} | {1 - s['checkpoint+streamed'] / s['checkpoint']:.0%} |")
    if not ON_GPU:
        assert s["checkpoint"] == ckpt_pred(d) and s["checkpoint+streamed"] == streamed_pred(d), d
n_half = c0 / db + 2 * (max(K, 1) + P)  # derived: where the reduction reaches one half
rows.append("")
rows.append(f"b = {db:,} B; C′ = {c0:,} B = {c0 / db:.1f}·b (from n = {depths[0]}); the reduction reaches one "
            f"half at n = C′/b + 2·(K + P) = {n_half:.1f} blocks (derived).")
depth_table = "\n".join(rows)
nbk.show_markdown(depth_table)

# %%
fig2, (ax, ax2) = plt.subplots(1, 2, figsize=(11.5, 3.8), dpi=110, layout="constrained")
grid = list(range(depths[0], depths[-1] + 1))
ax.plot(grid, [ckpt_pred(d) / 2**20 for d in grid], color="#4C72B0", lw=1.2, ls="--",
        label="derived: C′ + n·b")
ax.plot(depths, [sweep[d]["checkpoint"] / 2**20 for d in depths], "o", color="#4C72B0", label="checkpoint")
ax.plot(grid, [streamed_pred(d) / 2**20 for d in grid], color="#55A868", lw=1.2, ls="--",
        label="derived: C′ + (K + P)·b")
ax.plot(depths, [sweep[d]["checkpoint+streamed"] / 2**20 for d in depths], "s", color="#55A868",
        label="checkpoint+streamed")
ax.set(xlabel="blocks n", ylabel="activation peak (MiB)", title=f"points measured ({DEVICE.type}), lines derived",
       ylim=(0, None))
ax.legend(fontsize=8)
ax2.plot(grid, [100 * (1 - streamed_pred(d) / ckpt_pred(d)) for d in grid], color="#55A868", lw=1.4,
         label="derived reduction")
ax2.plot(depths, [100 * (1 - sweep[d]["checkpoint+streamed"] / sweep[d]["checkpoint"]) for d in depths], "s",
         color="#55A868", label="measured")
ax2.axhline(50, color="#8C8C8C", lw=1, ls=":", label="50 %: the GPU run's target")
ax2.set(xlabel="blocks n", ylabel="% lower than checkpoint alone", title="activation peak: reduction vs depth",
        ylim=(0, 100))
ax2.legend(fontsize=8, loc="lower right")
for a in (ax, ax2):
    a.grid(alpha=0.3)
plot.save(fig2, OUT / "depth.svg")

# %% [markdown]
# ## The two knobs: keep-last and min-bytes
#
# **Keep-last K**: the last K saved tensors that would be offloaded stay on the device. They are
# the first that backward reads, so moving them out and straight back is traffic for nothing. In
# `streamed`, the last two saved tensors are the same one: `cross_entropy` saves the log-softmax
# output twice (for its own backward and for the loss's), so offloading only one of them frees no
# device byte. **min-bytes**: saved tensors smaller than this stay (layer-norm statistics, position
# indices): each would cost a transfer for almost no memory.

# %%
_, _, model0, x0, y0 = lab.build(args)
rows = ["| mode | keep-last K | kept after forward | activation peak | moved each way | tensors moved |",
        "|---|---:|---:|---:|---:|---:|"]
knobs = {}
for m in ("streamed", "checkpoint+streamed"):
    for k in (0, 1, 2, 3):
        kargs = lab.parse_args([*BASE, "--keep-last", str(k)])
        r = lab.measure(model0, x0, y0, m, kargs, 0)[0]
        knobs[(m, k)] = r
        rows.append(f"| {m} | {k} | {fmt(r['kept_bytes'])} | {fmt(r['activation_peak_bytes'])} | "
                    f"{fmt(r['d2h_bytes'])} | {r['tensors_moved']} |")
keep_table = "\n".join(rows)
nbk.show_markdown(keep_table)
s1, s2 = knobs[("streamed", 1)], knobs[("streamed", 2)]
if not ON_GPU:  # keeping the second copy of the log-softmax output costs no device byte, saves a round trip
    assert s1["kept_bytes"] == s2["kept_bytes"] and s1["d2h_bytes"] > s2["d2h_bytes"]

# %%
rows = ["| min-bytes | tensors moved | moved each way | kept after forward | activation peak |",
        "|---:|---:|---:|---:|---:|"]
for mb in (0, 1024, 4096, b + 1):
    margs = lab.parse_args([*BASE, "--min-bytes", str(mb)])
    r = lab.measure(model0, x0, y0, "streamed", margs, 0)[0]
    rows.append(f"| {mb:,} B | {r['tensors_moved']} | {fmt(r['d2h_bytes'])} | {fmt(r['kept_bytes'])} | "
                f"{fmt(r['activation_peak_bytes'])} |")
min_table = "\n".join(rows)
nbk.show_markdown(min_table)

# %% [markdown]
# ## Allocated against the ledger (CUDA only)
#
# On a GPU, `lab.run` records `max_memory_allocated` for each mode's ledger step; the ledger's peak
# should be within a few percent of it, and the step times become meaningful. On a CPU there is no
# caching allocator and no copy engine, and this cell says so.

# %%
if ON_GPU:
    for m, r in R.items():
        c = r["cuda"]
        print(f"{m}: ledger peak {fmt(r['peak_bytes'])}, max allocated {fmt(c['max_memory_allocated'])}; "
              f"step {r['step_time_s'] * 1e3:.1f} ms, {r['overhead_vs_baseline']:+.1%} against {r['baseline']}")
else:
    print("CPU run: no CUDA allocator and no copy engine here, so no allocated figures and no step times.")

# %% [markdown]
# ## Results written for the page

# %%
from labkit.provenance import write_results  # noqa: E402

summary = {k: v for k, v in lab.summary(out, args).items() if k != "provenance"}
summary["depth"] = {"block_input_bytes": db, "outside_bytes": c0, "measured": {str(d): sweep[d] for d in depths},
                    "n_half": n_half}
write_results(OUT / "summary.json", summary, provenance.collect(lab.LAB, DEVICE, out["wall_time_s"]))
tables = {"modes": modes_table, "gradients": gradients_table, "checks": checks_table, "depth": depth_table,
          "keep_last": keep_table, "min_bytes": min_table}
for name, text in tables.items():
    (OUT / f"{name}.md").write_text(text + "\n")
(OUT / "provenance.md").write_text(nbk.provenance_markdown(record))
print(sorted(p.name for p in OUT.iterdir()))
