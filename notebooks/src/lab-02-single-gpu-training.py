# %% [markdown]
# # Lab 02 · Single-GPU training loop, measured
#
# This notebook runs the Lab 02 starter, `code/lab-02-single-gpu-training/train_single_gpu.py`,
# and draws what the memory ledger recorded during each phase of a training step. It is executed
# by `scripts/run_notebooks.py`, never edited by hand; the table below says where and on which
# code. On a CPU the byte counts are exact; speed and allocator behaviour need a GPU run.
#
# What to look for:
#
# 1. Parameters are there from the start; activations rise in forward and fall in backward.
# 2. Gradients are born in backward and die at the next `zero_grad(set_to_none=True)`.
# 3. AdamW's two moment tensors appear in the first `optimizer.step()` and never before.

# %%
import tempfile
from dataclasses import replace
from pathlib import Path

import matplotlib.pyplot as plt
from IPython.display import display

from labkit import labs, notebook, plot
from labkit.table import Table, by_category

nb = notebook.setup(2)
lab = nb.lab
harness = labs.load(2, "scale_harness")  # the real-scale harness: peaks by step and phase
# small on a CPU, GPU-sized on a GPU: the same code either way
size = dict(width=1024, layers=8, heads=16, seq_len=512, batch_size=8) if nb.on_gpu else {}
config = lab.Config(device=nb.device.type, steps=3, **size)

# %% [markdown]
# ## Three steps under the ledger
#
# `lab.run` is the function the command line calls. The ledger sees every allocation and free,
# and each storage gets one category for its whole life (see `code/labkit/ledger.py`).

# %%
result = lab.run(replace(config, snapshot=nb.results / "memory_snapshot.pickle" if nb.on_gpu else None))
tl = result.ledger.timeline()
print(f"{result.params:,} parameters in {result.tensors} tensors; {len(tl)} ledger events; "
      f"losses {[round(v, 3) for v in result.losses]}")

# %% [markdown]
# ## The timeline, with the model-state prediction drawn over it
#
# The dashed line is **derived**, not measured (`lab.predicted_model_state`): 4 bytes per parameter,
# 4 more for the gradients from the end of backward to the next `zero_grad`, and from the first
# optimizer step on 8 bytes per parameter plus a 4-byte step counter per tensor for AdamW.
# Everything above the line is activations and temporaries.

# %%
fig = plot.plot_timeline(
    tl, title=f"Lab 02 · 3 training steps on {nb.device.type} (measured by the ledger)",
    overlay={"derived: params + grads + AdamW state": lab.predicted_model_state(tl, result.params, result.tensors)})
notebook.show(fig, alt="Stacked memory timeline of three training steps by category, with phase bands and a "
                       "dashed line for the derived model state")

# %% [markdown]
# ## Peaks: per phase, per step, and the formulas against the ledger (measured)
#
# Step 0 runs its forward and backward before AdamW has any state; every later step carries the
# state through its own peak. On a CPU the formulas equal the ledger to the byte.

# %%
peaks = by_category(tl.peaks_by_phase())
steps = tl.step_peaks()
step_peaks = Table(["step", ("peak total", "bytes"), ("AdamW state at the peak", "bytes"),
                    ("activations at the peak", "bytes")],
                   [[s, p["total"], p["optimizer_state"], p["activations"]] for s, p in steps.items()])
checks = lab.checks(result)
display(peaks, step_peaks, checks)

# %% [markdown]
# ## What zero_grad clears, and what skipping it does
#
# Three runs of 12 steps that differ only in `--zero-grad`: `none` frees the gradients
# (`set_to_none=True`), `zeros` keeps them allocated and writes zeros, `skip` never clears them,
# so every `backward()` adds into the previous gradients: accumulation.

# %%
modes = {m: lab.run(replace(config, steps=12, zero_grad=m)) for m in ("none", "zeros", "skip")}
fig2, (ax_mem, ax_loss) = plt.subplots(1, 2, figsize=(11, 3.6), dpi=110, layout="constrained")
for mode, r in modes.items():
    g = r.ledger.timeline().device["gradients"]
    ax_mem.plot([i / max(len(g) - 1, 1) for i in range(len(g))], [v / 2**20 for v in g], label=mode, lw=1.2)
    ax_loss.plot(range(len(r.losses)), r.losses, marker="o", ms=3, label=mode)
ax_mem.set(title="gradient bytes over the run (measured)", xlabel="fraction of the run", ylabel="MiB")
ax_loss.set(title="training loss (measured)", xlabel="step", ylabel="loss")
for ax in (ax_mem, ax_loss):
    ax.legend(title="--zero-grad", fontsize=8)
    ax.grid(alpha=0.3)


def lowest_after_step0(timeline):
    start = next(s.start for s in timeline.spans if s.step == 1)
    return min(timeline.device["gradients"][start:])


zero_grad = Table(["--zero-grad", ("loss after 12 steps", "float:4"), ("lowest gradient bytes after step 0", "bytes")],
                  [[m, r.losses[-1], lowest_after_step0(r.ledger.timeline())] for m, r in modes.items()])
display(zero_grad)
notebook.show(fig2, alt="Two panels for the three zero_grad modes: gradient bytes over the run, and the training"
                        " loss per step")

# %% [markdown]
# ## Exact resume
#
# Four steps in one run must give the same losses as two steps, a checkpoint, and two more steps
# after `--resume`.

# %%
with tempfile.TemporaryDirectory() as tmp:
    ckpt = Path(tmp) / "ckpt.pt"
    full = lab.run(replace(config, steps=4)).losses
    resumed = (lab.run(replace(config, steps=2, checkpoint=ckpt)).losses
               + lab.run(replace(config, steps=2, checkpoint=ckpt, resume=True)).losses)
resume = Table(["step", ("one run", "float:6"), ("2 + resume 2", "float:6"), ("equal", "yes")],
               [[i, a, b, a == b] for i, (a, b) in enumerate(zip(full, resumed))])
display(resume)

# %% [markdown]
# ## Allocated against reserved (CUDA only)
#
# On a GPU the ledger also samples `torch.cuda.memory_allocated` and `memory_reserved` at every
# event (the solid and dotted black lines in the timeline above) and the run exports a
# `_record_memory_history` snapshot for <https://pytorch.org/memory_viz>. On a CPU there is no
# caching allocator to compare with, and the table says so.

# %%
c = result.cuda or {}
display(Table(["allocator", ("bytes", "bytes")],
      [["max_memory_allocated", c.get("max_memory_allocated")], ["max_memory_reserved", c.get("max_memory_reserved")],
       ["held beyond the ledger when the run began", c.get("unseen_before_window")],
       ["ledger peak", result.ledger.peak()["total"]]]))

# %% [markdown]
# ## At real scale: Llama-3-8B and Llama-3.2-1B, traced on fake tensors
#
# The same `lab.run`, with `--model` and `--fake`: the step above, unchanged, runs the zoo's
# Llama (`labkit.zoo`) in fp32 with AdamW, one sequence of 4,096 tokens per step, two steps, on
# **fake tensors** (`labkit.fake`): every op computes its outputs' shapes and storages, nothing is
# allocated, and the ledger counts each storage as the CUDA caching allocator would (512-byte
# blocks). These figures are **traced**, not measured on a GPU: they leave out the CUDA context,
# cuBLAS workspaces and allocator fragmentation, and the ops take their CPU path (attention: the
# CPU flash kernel, which saves what CUDA's does, less two 8-byte RNG tensors per layer). AdamW
# runs `foreach`, CUDA's default. A fake tensor has no value, so there are no losses here.

# %%
scale = lab.Config(fake=True, seq_len=4096, batch_size=1, steps=2)
traced = {name: lab.run(replace(scale, model=name)) for name in ("llama-3-8b", "llama-3.2-1b")}
CARD = 80 * 2**30  # an 80 GB H100 holds at most 80 GiB (PyTorch sees a little less)
by_phase = {f"{name} · {key}": row for name, r in traced.items()
            for key, row in harness.peaks_by_step_and_phase(r.ledger.timeline()).items()}
real_scale = by_category(by_phase, label="model · step · phase (traced)")
fit = Table(["model", ("peak of the two steps", "bytes"), ("fits 80 GiB", "yes"), ("parameters", "int"),
             ("model state, 16 B x P", "bytes"), ("step 0 forward/backward peak (no AdamW state yet)", "bytes")],
            [[name, r.ledger.peak()["total"], r.ledger.peak()["total"] <= CARD, r.params, 16 * r.params,
              max(sum(by_phase[f"{name} · step 0 {p}"].values()) for p in ("forward", "backward"))]
             for name, r in traced.items()])
big = traced["llama-3-8b"].ledger.timeline()
fig3 = plot.plot_timeline(big, title="Llama-3-8B, fp32 AdamW, 4,096 tokens (traced)", show_allocator=False,
                          overlay={"80 GiB: an H100's memory": [CARD] * len(big)})
display(real_scale, fit)
notebook.show(fig3, alt="Stacked memory timeline of two fp32 AdamW steps of Llama-3-8B at 4,096 tokens, traced "
                        "on fake tensors, under a dashed 80 GiB line")

# %% [markdown]
# ## Which AdamW, at 8B
#
# `foreach` (CUDA's default) updates every tensor in a few batched kernels and keeps an fp32
# temporary the size of all the weights while it does; `fused` does the whole update in one kernel
# with no such temporary; the for-loop holds one tensor's temporaries at a time. Same model, same
# two steps, traced.

# %%
impls = {"foreach": traced["llama-3-8b"]} | {impl: lab.run(replace(scale, model="llama-3-8b", adamw=impl))
                                            for impl in ("fused", "for-loop")}
adamw_impls = Table(["AdamW", ("step peak", "bytes"), ("peak phase", "text"), ("optimizer-phase temporaries", "bytes")],
                    [[impl, r.ledger.peak()["total"], harness.peak_phase(r.ledger.timeline()),
                      r.ledger.timeline().peaks_by_phase()["optimizer"]["temporaries"]] for impl, r in impls.items()])
display(adamw_impls)

# %%
def real_scale_numbers(r):
    tl, now = r.ledger.timeline(), r.ledger.current()
    phases = {key.replace(" ", "_").replace("step_", "step"): sum(row.values())
              for key, row in harness.peaks_by_step_and_phase(tl).items()}
    return phases | {"params": r.params, "peak": tl.peak()["total"], "fits_80gib": tl.peak()["total"] <= CARD,
                     "adamw_state": now["optimizer_state"], "model_state": sum(
                         now[c] for c in ("parameters", "gradients", "optimizer_state"))}


phase_8b = harness.peaks_by_step_and_phase(big)
notebook.publish(
    nb, tables={"peaks": peaks, "step_peaks": step_peaks, "checks": checks, "zero_grad": zero_grad, "resume": resume,
                "real_scale": real_scale, "real_scale_fit": fit, "real_scale_adamw": adamw_impls},
    figures={"timeline": fig, "zero_grad_modes": fig2, "real_scale_timeline": fig3},
    summary=result.summary(), step_growth=steps[1]["total"] - steps[0]["total"],
    resume_exact=full == resumed, zero_grad_final_loss={m: r.losses[-1] for m, r in modes.items()},
    real_scale={"8b": real_scale_numbers(traced["llama-3-8b"]) | {
                    "activations": phase_8b["step 0 backward"]["activations"],
                    "foreach_temporaries": phase_8b["step 1 optimizer"]["temporaries"],
                    "fused_peak": impls["fused"].ledger.peak()["total"]},
                "1b": real_scale_numbers(traced["llama-3.2-1b"])})
