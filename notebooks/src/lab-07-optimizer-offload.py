# %% [markdown]
# # Lab 07 · Optimizer offload, measured
#
# This notebook runs the Lab 07 starter, `code/lab-07-optimizer-offload/optimizer_offload.py`, and
# measures the same AdamW training of a small GPT three ways: device AdamW, optimizer offload
# (fp32 master parameters and AdamW state on the host) and gradient offload (the gradients too).
# It is executed by `scripts/run_notebooks.py`, never edited by hand; the table below says where
# and on which code.
#
# On a CPU-only machine the "device" and the host are the same RAM. The ledger still keeps them
# apart: the offload engine's host buffers are labelled `host_copies`, so every byte count below is
# exact. Times measured here are CPU times; nothing in this notebook says how fast PCIe is or how
# well copies overlap, unless it ran on a GPU.
#
# What to look for:
#
# 1. Offload moves 8 bytes per parameter (the two AdamW moments) off the device, 12 with the
#    gradients, and the host grows by the master copy, the gradients and the moments.
# 2. The parameters after N steps are those of device AdamW, bit for bit on CPU when both sides run
#    the same AdamW implementation; fused against the for-loop differs by rounding only.
# 3. Fused CPU AdamW against foreach and the for-loop, on the same parameters (drawn from the
#    benchmark's committed result).
# 4. At real scale (Llama-3-8B, bf16 weights, traced on fake tensors): whether the step fits one
#    80 GB GPU with AdamW on the device and with its state on the host, and what the host and the
#    bus pay for it.

# %%
import importlib.util
import json
import sys
from dataclasses import replace

import matplotlib.pyplot as plt
from IPython.display import display

from labkit import labs, notebook, plot
from labkit.provenance import REPO_ROOT
from labkit.table import Table, format_bytes

nb = notebook.setup(7)
lab = nb.lab
accounting = labs.load(7, "offload_accounting")  # derived against measured: the tables the page shows
spec = importlib.util.spec_from_file_location("cpu_adam_bench", REPO_ROOT / "bench" / "cpu_adam_bench.py")
bench = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
# small on a CPU, GPU-sized on a GPU: the same code either way
size = dict(width=1024, layers=8, heads=16, seq_len=512, batch_size=8) if nb.on_gpu else {}
config = lab.Config(device=nb.device.type, steps=3, **size)

# %% [markdown]
# ## Three modes, three steps each, under the ledger
#
# `lab.run` is what the command line runs: the same seed, model, batches and AdamW
# hyper-parameters in every mode, fused AdamW on both sides.

# %%
result = lab.run(config)
runs = {r.mode: r for r in result.runs}
modes = result.modes()
P, T = modes["none"]["params"], modes["none"]["tensors"]
display(Table(["mode", ("loss after the last step", "float:4"), ("max abs diff vs device AdamW", "sci:1")],
              [[m, s["losses"][-1], s["max_abs_diff_vs_device_adamw"]] for m, s in modes.items()]))
print(f"P = {P:,} parameters in T = {T} tensors")

# %% [markdown]
# ## Device and host timelines, on one scale
#
# Left: live bytes on the compute device, by category. Right: live bytes on the host, which the
# ledger calls `host_copies` (the run labels the engine's host buffers so from outside, and AdamW
# creates its moments inside `marks.category("host_copies")`). All six panels share one y axis.

# %%
def draw_timelines(timelines, modes, unit, evidence=""):
    """Device (left) and host (right) timelines of each mode, all on one y axis."""
    top = max(max(max(tl.device_total()), max(tl.host_total())) for tl in timelines.values())
    figure, axes = plt.subplots(3, 2, figsize=(13, 8.4), dpi=110, layout="constrained", sharey=True)
    for row, (mode, tl) in zip(axes, timelines.items()):
        s, title = modes[mode], accounting.TITLES[mode] + evidence
        plot.plot_timeline(tl, ax=row[0], legend=mode == "none", max_points=160, unit=unit, ymax_bytes=top,
                           title=f"{title} · device: peak {format_bytes(s['peak_device_bytes'])}")
        plot.plot_timeline(tl, ax=row[1], scope="host", legend=False, max_points=160, unit=unit, ymax_bytes=top,
                           title=f"{title} · host: {format_bytes(s['host_bytes'])} at the end")
        if mode == "optimizer":
            row[1].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
        for ax in row:
            ax.set_xlabel("ledger events")
    return figure, axes


timelines = {m: r.ledger.timeline() for m, r in runs.items()}
fig, _ = draw_timelines(timelines, modes, "MiB")
notebook.show(fig, alt="Six memory timelines on one scale: device and host bytes for device AdamW, optimizer "
                       "offload and gradient offload")

# %% [markdown]
# ## Bytes per parameter: derived against measured
#
# Derived: fp32 parameters, gradients and the two AdamW moments are 4 bytes each per parameter.
# Measured: the ledger's device bytes between steps (the end of the last optimizer phase), and its
# `host_copies` bytes at the end, divided by P. The small excess over the derived figures is
# AdamW's step counter (4 bytes per tensor) and, on the host, the 64-byte alignment of each
# parameter inside Lab 08's flat buffers.

# %%
bytes_per_param = accounting.bytes_per_param(modes)
fig2, ax = plt.subplots(figsize=(9, 2.8), dpi=110, layout="constrained")
parts = [(cat, plot.CATEGORY_COLORS[cat]) for cat in ("parameters", "gradients", "optimizer_state")]
for y, s in enumerate(modes.values()):
    left, host = 0.0, s["host_bytes"] / P
    for cat, color in parts:
        width = s["device_after_step"][cat] / P
        ax.barh(y, width, left=left, color=color, label=cat.replace("_", " ") if y == 0 else None)
        left += width
    ax.barh(y, host, left=-host, color=plot.CATEGORY_COLORS["host_copies"], label="host copies: master,\ngradients, AdamW state" if y == 1 else None)
    ax.text(left + 0.3, y, f"device {left:.2f}", va="center", fontsize=8)
    if host:
        ax.text(-host - 0.3, y, f"host {host:.2f}", va="center", ha="right", fontsize=8)
ax.axvline(0, color=plot.INK, lw=0.8)
ax.set_yticks(range(3), [accounting.TITLES[m] for m in modes])
ax.invert_yaxis()
ax.set_xlim(-30, 30)  # room for each bar's total beside it, at the page's text size
ax.set_xticks(range(-16, 20, 4), [str(abs(v)) for v in range(-16, 20, 4)])
ax.set_xlabel("bytes per parameter between steps (measured by the ledger): host to the left, device to the right")
ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
display(bytes_per_param)
notebook.show(fig2, alt="Horizontal bars of bytes per parameter between steps for the three modes: device bytes "
                        "by category to the right, host copies to the left")

# %% [markdown]
# ## The same figures as exact bytes
#
# On CPU the ledger counts `storage.nbytes()`, and a copy counter (`offload_accounting.BusCopies`, a
# dispatch mode) sees every copy between the device and the host buffers, so formula and measurement agree
# to the byte (`tests/test_lab07.py` asserts each row). With gradient offload, at most one module's
# gradients are on the device at a time.

# %%
engine = runs["optimizer"].optimizer
checks = accounting.checks(modes, engine)
largest_module = max(sum(p.nbytes for p in m.parameters(recurse=False)) for m in runs["gradients"].model.modules())
gradients = Table(["gradient offload", ("bytes", "B")], [
    ["most gradient bytes on the device at once (measured)", max(timelines["gradients"].device["gradients"])],
    ["the largest module's parameters", largest_module], ["all gradients, 4 B x P", 4 * P]])
display(checks, gradients)

# %% [markdown]
# ## Equal to device AdamW
#
# Offload must not change the training. Each row trains the same model for three steps with the
# host AdamW of the first column and device AdamW of the second (plain runs, no ledger), and
# compares every parameter at the end. The same implementation on both sides runs the same kernel
# on the same numbers: the same bits. The fused kernel and the for-loop evaluate AdamW's formula in
# a different order, so their results differ by rounding; the largest difference sits where a
# gradient is itself rounding noise.

# %%
device_runs = {impl: lab.run_mode("none", replace(config, impl=impl), nb.device, measured=False) for impl in lab.IMPLS}
tolerance = accounting.tolerance(config.lr, config.steps)
equality, rows = [], []
for host_impl, device_impl in [("fused", "fused"), ("foreach", "foreach"), ("forloop", "forloop"), ("fused", "forloop")]:
    offload, device = lab.run_mode("optimizer", replace(config, impl=host_impl), nb.device, measured=False), \
        device_runs[device_impl]
    diff, where = accounting.largest_difference(offload.model, device.model)
    equality.append({"host": host_impl, "device": device_impl, "max_abs_diff": diff, "where": where})
    verdict = ("bit for bit" if diff == 0 else f"{'rounding: within' if diff <= tolerance else 'beyond'} 1% of "
               f"lr x steps ({tolerance:.0e})")
    rows.append([host_impl, device_impl, diff, "-" if diff == 0 else where, offload.losses == device.losses, verdict])
equality_table = Table(["host AdamW (offload)", "device AdamW", (f"max abs diff after {config.steps} steps", "sci:1"),
                        "where", ("losses equal", "yes"), "verdict"], rows)
display(equality_table)

# %% [markdown]
# ## Fused CPU AdamW against foreach and the for-loop
#
# `bench/cpu_adam_bench.py` is a script of its own with its own provenance: it steps three copies
# of the same parameters with the same gradients, one per implementation, each with one optimizer
# over all the tensors (as the trainer's host step), in turn, for 30 rounds, at three sizes
# (TinyGPT's tensor shapes). On one torch thread it times each step by the thread's CPU time, so
# the time slices other processes take on a shared machine are left out. This cell draws its
# committed result (the GPU machine's run when there is one) rather than measuring again, so that
# the page shows one measurement.

# %%
gpu_file = REPO_ROOT / "results" / "cpu_adam_bench.gpu.json"
bench_file = gpu_file if nb.on_gpu and gpu_file.is_file() else REPO_ROOT / "results" / "cpu_adam_bench.json"
adam_run = json.loads(bench_file.read_text())
cpu_adamw = bench.table(adam_run)
display(cpu_adamw)
fig3, ax = plt.subplots(figsize=(9, 3.2), dpi=110, layout="constrained")
impls = list(lab.IMPLS)
for k, s in enumerate(adam_run["sets"]):
    goal = s["impls"]["forloop"]["ns_per_param"] / bench.TARGET
    ax.hlines(goal, k * (len(impls) + 1) - 0.45, k * (len(impls) + 1) + 0.45, colors=plot.INK, linestyles="--",
              label=f"target: {bench.TARGET:.0f}x faster than the for-loop" if k == 0 else None, zorder=3)
    for j, name in enumerate(impls):
        r = s["impls"][name]
        x = k * (len(impls) + 1) + j
        ax.bar(x, r["ns_per_param"], color=(plot.SERIES[2], plot.SERIES[1], plot.SERIES[3])[j], label=name if k == 0 else None)
        top = max(r["ns_per_param"], goal if j == 0 else 0)  # above the target mark, not on it
        ax.text(x, top * 1.03, f"{r['speedup_vs_forloop']:.1f}x", ha="center", va="bottom", fontsize=8)
ax.set_xticks([k * (len(impls) + 1) + 1 for k in range(len(adam_run["sets"]))],
              [f"{s['params'] / 1e6:.1f} M parameters\n{s['tensors']} tensors" for s in adam_run["sets"]])
ax.set_ylabel("ns per parameter per step")
ax.set_ylim(0, 1.15 * max(r["ns_per_param"] for s in adam_run["sets"] for r in s["impls"].values()))
ax.set_title(f"CPU AdamW on {adam_run['provenance']['cpu']}, {adam_run['threads']} thread(s), "
             f"{str(adam_run['provenance']['date_utc'])[:10]} (measured; labels: speed-up over the for-loop)",
             loc="left", fontsize=9)
ax.legend(fontsize=8, frameon=False)
ax.grid(axis="y", alpha=0.3)
notebook.show(fig3, alt="Bars of nanoseconds per parameter per AdamW step for fused, foreach and for-loop CPU "
                        "AdamW at three model sizes, with the target marked")

# %% [markdown]
# ## Step time with and without overlap (GPU only)
#
# On a GPU the benchmark's second part times one training step of each mode at the GPU size, with
# the copy stream and events (overlap on) and with blocking copies (overlap off), against device
# AdamW. On a CPU the "device" and the host are the same memory and there is no copy engine beside
# the cores, so there is nothing to overlap: the table says so instead of measuring.

# %%
overhead = bench.offload_overhead(nb.device, steps=6, seed=0) if nb.on_gpu else None
overhead_table = Table(["mode", "overlap", ("ms per step (median)", "float:1"), ("against device AdamW", "x:2")],
                       [[r["mode"], {None: "-", True: "copy stream and events", False: "blocking copies"}[r["overlap"]],
                         r["step_ms"], r["step_time_vs_device_adamw"]] for r in overhead or []]
                       or [["not measured: this notebook ran on a CPU", "-", None, None]])
display(overhead_table)

# %% [markdown]
# ## At real scale: Llama-3-8B on one 80 GB GPU
#
# The same `run`, the same three modes, on Llama-3-8B (the zoo's `llama-3-8b`, 8.0 B parameters)
# with bf16 weights and gradients on the device, 4096 tokens, batch 1, two steps (AdamW's state
# exists from the first one). Device AdamW keeps an fp32 master copy of the weights and both
# moments on the device, mixed-precision training's 16 bytes per parameter; the offload engine
# keeps them on the host and sends bf16 across the bus both ways. The lab has no checkpointing
# switch: every activation of the step is kept (Lab 04 and Lab 09 take those on).
#
# Every figure in this section is **traced on fake tensors** (`--fake`): each op computes shapes
# and storages and allocates nothing; the ledger counts the storages, rounded to the CUDA
# allocator's 512-byte blocks. The trace follows the CPU dispatch (`labkit/fake.py`): no CUDA
# context, cuBLAS workspaces or allocator fragmentation, and the engine's host buffers are not
# pinned in it (it pins on CUDA only; the bytes are the same). No values, no time.

# %%
real = lab.run(lab.Config(model="llama-3-8b", fake=True, precision="bf16", seq_len=4096, batch_size=1, steps=2))
real_modes = real.modes()
real_numbers = accounting.real_scale(real_modes)
real_scale = accounting.real_scale_table(real_numbers)
display(real_scale)
fig4, real_axes = draw_timelines({r.mode: r.ledger.timeline() for r in real.runs}, real_modes, "GiB", " (traced)")
for ax in real_axes[:, 0]:
    ax.axhline(80, color=plot.SERIES[3], lw=1.0, ls="--", zorder=5)
    ax.text(0, 80, " 80 GiB: one H100", color=plot.SERIES[3], fontsize=8, va="bottom")
notebook.show(fig4, alt="Device and host timelines of device AdamW, optimizer offload and gradient offload for "
                        "Llama-3-8B, traced, against one H100's 80 GiB")

# %%
notebook.publish(
    nb, tables={"bytes_per_param": bytes_per_param, "checks": checks, "gradient_offload": gradients,
                "equality": equality_table, "cpu_adamw": cpu_adamw, "overhead": overhead_table,
                "real_scale": real_scale},
    figures={"timelines": fig, "bytes_per_param": fig2, "cpu_adamw": fig3, "real_scale": fig4},
    summary=result.summary(), equality=equality, tolerance=tolerance,
    cpu_adamw_from=bench_file.relative_to(REPO_ROOT).as_posix(), cpu_adamw_target=bench.TARGET,
    cpu_adamw={"cpu": adam_run["provenance"]["cpu"], "threads": adam_run["threads"],
               "speedup": [s["impls"]["fused"]["speedup_vs_forloop"] for s in adam_run["sets"]],
               "params": [s["params"] for s in adam_run["sets"]]},
    offload_overhead=overhead, flat_host_buffer_bytes=engine.master.nbytes,
    real_scale={"model": real.config.model, "params": real_modes["none"]["params"], "seq_len": real.config.seq_len,
                "traced": real.summary()["traced"], "modes": real_numbers})
