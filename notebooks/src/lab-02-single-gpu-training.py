# %% [markdown]
# # Lab 02 · Single-GPU training loop, measured
#
# This notebook runs the Lab 02 starter, `code/lab-02-single-gpu-training/train_single_gpu.py`,
# and draws what the memory ledger recorded during each phase of a training step. It is executed
# by `scripts/run_notebooks.py`, never edited by hand; the provenance cell below says where and
# when. On a CPU the byte counts are exact; speed and allocator behaviour need a GPU run.
#
# What to look for:
#
# 1. Parameters are there from the start; activations rise in forward and fall in backward.
# 2. Gradients are born in backward and die at the next `zero_grad(set_to_none=True)`.
# 3. AdamW's two moment tensors appear in the first `optimizer.step()` and never before.

# %%
import os
import sys
from pathlib import Path

ROOT = Path(os.environ.get("INFRALAB_ROOT") or next(
    p for p in [Path.cwd(), *Path.cwd().parents] if (p / "code" / "labkit").is_dir()))
sys.path.insert(0, str(ROOT / "code"))

from labkit import notebook as nbk  # noqa: E402
from labkit import plot, provenance  # noqa: E402

lab = nbk.load_lab("lab-02-single-gpu-training/train_single_gpu.py")
DEVICE = lab.pick_device(nbk.device_name())
OUT = nbk.results_dir(lab.LAB)
ON_GPU = DEVICE.type == "cuda"
# Small on a CPU; GPU-sized on a GPU (the same code either way).
SIZE = (["--width", "1024", "--layers", "8", "--heads", "16", "--seq-len", "512", "--batch-size", "8"]
        if ON_GPU else ["--width", "128", "--layers", "2", "--heads", "4", "--seq-len", "64", "--batch-size", "8"])
BASE = ["--device", DEVICE.type, "--json", *SIZE]
print("device:", DEVICE, "| results go to:", OUT.relative_to(OUT.parents[1]))

# %% tags=["provenance"]
record = provenance.collect(lab.LAB, DEVICE)
nbk.show_provenance(record)

# %% [markdown]
# ## Three steps under the ledger
#
# `lab.train` is the function the command line calls. The ledger sees every allocation and free,
# and each storage gets one category for its whole life (see `code/labkit/ledger.py`).

# %%
snapshot = OUT / "memory_snapshot.pickle" if ON_GPU else None
args = lab.parse_args([*BASE, "--steps", "3"] + (["--snapshot", str(snapshot)] if snapshot else []))
run = lab.train(args)
result = lab.summary(run)
tl = run.ledger.timeline()
P = result["params"]
n_tensors = len(list(run.model.parameters()))
print(f"{P:,} parameters in {n_tensors} tensors; {len(tl)} ledger events; losses {[round(v, 3) for v in run.losses]}")

# %% [markdown]
# ## The timeline, with the model-state prediction drawn over it
#
# The dashed line is **derived**, not measured: parameters are 4 bytes each (fp32), gradients add
# 4 bytes per parameter from the end of backward until the next `zero_grad`, and AdamW adds two
# fp32 moments (8 bytes per parameter) plus a 4-byte step counter per tensor, from the first
# optimizer step on. Everything above the line is activations and temporaries.

# %%
def model_state_prediction(tl, P, n_tensors):
    """Derived bytes per ledger row: 4P params + 4P grads (when alive) + (8P + 4T) AdamW state."""
    grads_alive = [False] * len(tl)
    adam_alive = [False] * len(tl)
    spans = sorted(tl.spans, key=lambda s: s.start)
    grads, adam, cursor = False, False, 0
    for span in spans:
        for i in range(cursor, span.start):
            grads_alive[i], adam_alive[i] = grads, adam
        if span.name == "zero_grad":
            grads = False
        for i in range(span.start, span.end):
            grads_alive[i], adam_alive[i] = grads, adam
        if span.name == "backward":
            grads = True
        if span.name == "optimizer":
            adam = True
        cursor = span.end
    for i in range(cursor, len(tl)):
        grads_alive[i], adam_alive[i] = grads, adam
    return [4 * P + (4 * P if g else 0) + ((8 * P + 4 * n_tensors) if a else 0)
            for g, a in zip(grads_alive, adam_alive)]


predicted = model_state_prediction(tl, P, n_tensors)
fig = plot.plot_timeline(
    tl, title=f"Lab 02 · 3 training steps on {DEVICE.type} (measured by the ledger)",
    overlay={"derived: params + grads + AdamW state": predicted})
plot.save(fig, OUT / "timeline.svg")

# %% [markdown]
# ## Peak bytes in each phase (measured)

# %%
table = plot.peak_table(result["peak_bytes_by_phase"])
nbk.show_markdown(table)

# %% [markdown]
# ## Peak of each step (measured)
#
# Step 0 runs its forward and backward before AdamW has any state; every later step carries the
# state through its own peak.

# %%
total = tl.device_total()
step_peaks = {}
for i, s in enumerate(tl.step):
    if s is not None and (s not in step_peaks or total[i] > total[step_peaks[s]]):
        step_peaks[s] = i
step_table = "\n".join(
    ["| step | peak total | AdamW state at the peak | activations at the peak |", "|---:|---:|---:|---:|"]
    + [f"| {s} | {plot.format_bytes(total[i])} | {plot.format_bytes(tl.device['optimizer_state'][i])} | "
       f"{plot.format_bytes(tl.device['activations'][i])} |" for s, i in step_peaks.items()])
nbk.show_markdown(step_table)
growth = total[step_peaks[1]] - total[step_peaks[0]]
print(f"step 1 peak - step 0 peak = {growth:,} B; AdamW state = {run.ledger.current()['optimizer_state']:,} B")
if DEVICE.type == "cpu":
    assert growth == run.ledger.current()["optimizer_state"]

# %% [markdown]
# ## Formula against measurement
#
# Each row below is a derived figure (formula shown) next to the ledger's measurement. On CPU they
# must be equal to the byte: the ledger counts `storage.nbytes()` of every tensor.

# %%
current = run.ledger.current()
opt_phase_peak = result["peak_bytes_by_phase"]["optimizer"]
checks = [
    ("parameters", "4 B x P", 4 * P, current["parameters"]),
    ("gradients (in the optimizer phase)", "4 B x P", 4 * P, opt_phase_peak["gradients"]),
    ("AdamW state (end of run)", "2 x 4 B x P + 4 B x tensors", 8 * P + 4 * n_tensors, current["optimizer_state"]),
]
rows = ["| quantity | formula | derived | measured |", "|---|---|---:|---:|"]
for name, formula, derived, measured in checks:
    rows.append(f"| {name} | {formula} | {derived:,} B | {measured:,} B |")
    if DEVICE.type == "cpu":
        assert derived == measured, (name, derived, measured)
checks_table = "\n".join(rows)
nbk.show_markdown(checks_table)
seen = result["optimizer_state_first_seen"]
print(f"AdamW state first held bytes in phase '{seen['phase']}' of step {seen['step']} (event {seen['event']});"
      f" gradients first in '{result['gradients_first_seen']['phase']}'.")
assert seen["phase"] == "optimizer" and seen["step"] == 0

# %% [markdown]
# ## What zero_grad clears, and what skipping it does
#
# Three runs of 12 steps that differ only in `--zero-grad`: `none` frees the gradients
# (`set_to_none=True`), `zeros` keeps them allocated and writes zeros, `skip` never clears them,
# so every `backward()` adds into the previous gradients: accumulation.

# %%
import matplotlib.pyplot as plt  # noqa: E402

modes = {}
for mode in ("none", "zeros", "skip"):
    r = lab.train(lab.parse_args([*BASE, "--steps", "12", "--zero-grad", mode]))
    modes[mode] = (r.losses, r.ledger.timeline())

fig2, (ax_mem, ax_loss) = plt.subplots(1, 2, figsize=(11, 3.6), dpi=110, layout="constrained")
for mode, (losses, t) in modes.items():
    g = t.device["gradients"]
    ax_mem.plot([i / max(len(g) - 1, 1) for i in range(len(g))], [v / 2**20 for v in g], label=mode, lw=1.2)
    ax_loss.plot(range(len(losses)), losses, marker="o", ms=3, label=mode)
ax_mem.set(title="gradient bytes over the run (measured)", xlabel="fraction of the run", ylabel="MiB")
ax_loss.set(title="training loss (measured)", xlabel="step", ylabel="loss")
for ax in (ax_mem, ax_loss):
    ax.legend(title="--zero-grad", fontsize=8)
    ax.grid(alpha=0.3)
plot.save(fig2, OUT / "zero_grad_modes.svg")

# %% [markdown]
# With `none` the gradient bytes drop to zero between steps; with `zeros` they never do (the
# memory stays allocated, which some fused kernels and CUDA graphs want); with `skip` the
# memory looks like `zeros` but the loss curve shows the damage: each update follows the running
# sum of all gradients so far.

# %%
final = {m: round(v[0][-1], 4) for m, v in modes.items()}
def lowest_after_step0(t):
    start = next(s.start for s in t.spans if s.step == 1)
    return min(t.device["gradients"][start:])


grad_floor = {m: lowest_after_step0(v[1]) for m, v in modes.items()}
zero_grad_table = "\n".join(
    ["| --zero-grad | loss after 12 steps | lowest gradient bytes after step 0 |", "|---|---:|---:|"]
    + [f"| `{m}` | {final[m]:.4f} | {plot.format_bytes(grad_floor[m])} |" for m in modes])
nbk.show_markdown(zero_grad_table)

# %% [markdown]
# ## Exact resume
#
# Four steps in one run must give the same losses as two steps, a checkpoint, and two more steps
# after `--resume`. The checkpoint holds model, optimizer, step and RNG states; it is written to a
# temporary file and renamed, and read back with `torch.load(weights_only=True)`.

# %%
import tempfile  # noqa: E402

with tempfile.TemporaryDirectory() as tmp:
    ckpt = str(Path(tmp) / "ckpt.pt")
    full = lab.train(lab.parse_args([*BASE, "--steps", "4"])).losses
    first = lab.train(lab.parse_args([*BASE, "--steps", "2", "--checkpoint", ckpt])).losses
    second = lab.train(lab.parse_args([*BASE, "--steps", "2", "--checkpoint", ckpt, "--resume"])).losses
rows = ["| step | one run | 2 + resume 2 | equal |", "|---:|---:|---:|:---:|"]
for i, (a, b) in enumerate(zip(full, first + second)):
    rows.append(f"| {i} | {a:.6f} | {b:.6f} | {'yes' if a == b else 'NO'} |")
resume_table = "\n".join(rows)
nbk.show_markdown(resume_table)
if DEVICE.type == "cpu":
    assert full == first + second, "resume is not exact"

# %% [markdown]
# ## Allocated against reserved (CUDA only)
#
# On a GPU the ledger also samples `torch.cuda.memory_allocated` and `memory_reserved` at every
# event (the solid and dotted black lines in the timeline above) and the run exports a
# `_record_memory_history` snapshot for <https://pytorch.org/memory_viz>. On a CPU run there is no
# caching allocator to compare with, and this cell says so.

# %%
if run.cuda:
    c = result["cuda"]
    print(f"max allocated {plot.format_bytes(c['max_memory_allocated'])}, max reserved "
          f"{plot.format_bytes(c['max_memory_reserved'])}, ledger peak {plot.format_bytes(result['peak_bytes']['total'])}")
    print(f"held by the allocator beyond the ledger when the run began (cuBLAS workspaces): "
          f"{plot.format_bytes(c['unseen_before_window'])}")
    print(f"ledger peak / (max_memory_allocated - that) = {c['ledger_over_allocator']:.4f}")
    print("snapshot:", snapshot, f"({snapshot.stat().st_size / 2**20:.1f} MiB)")
else:
    print("CPU run: no CUDA allocator here, so no allocated/reserved lines and no snapshot.")

# %% [markdown]
# ## Results written for the page

# %%
from labkit.provenance import write_results  # noqa: E402

summary = {k: v for k, v in result.items() if k != "provenance"}
summary["zero_grad_final_loss"] = final
summary["resume_exact"] = full == first + second
write_results(OUT / "summary.json", summary, provenance.collect(lab.LAB, DEVICE, run.wall_time_s))
tables = {"peaks": table, "step_peaks": step_table, "checks": checks_table,
          "zero_grad": zero_grad_table, "resume": resume_table}
for name, text in tables.items():
    (OUT / f"{name}.md").write_text(text + "\n")
(OUT / "provenance.md").write_text(nbk.provenance_markdown(record))
print(sorted(p.name for p in OUT.iterdir()))
