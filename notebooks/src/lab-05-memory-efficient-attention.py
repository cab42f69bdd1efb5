# %% [markdown]
# # Lab 05 · Memory-efficient attention, measured
#
# This notebook runs the Lab 05 starter, `code/lab-05-memory-efficient-attention/attention.py`:
# the same attention computed three ways (naive, query-chunked, `scaled_dot_product_attention`),
# with the memory ledger counting every byte each one allocates, at sequence lengths from 128 to
# 2048 on a CPU (GPU-sized when run on a GPU). It is executed by `scripts/run_notebooks.py`, never
# edited by hand; the table below says where and on which code.
#
# What to look for:
#
# 1. The three outputs agree with a float64 reference within the stated tolerance.
# 2. On log-log axes, naive attention's peak climbs with slope 2, chunked and SDPA with slope 1,
#    and the derived formulas lie on the measured points.
# 3. With backward, chunking alone keeps s x s probabilities again; recomputing each block (what
#    the fused kernels do) brings it back to slope 1.

# %%
from dataclasses import replace

import matplotlib.pyplot as plt
from IPython.display import display

from labkit import labs, notebook, plot
from labkit.table import Table

nb = notebook.setup(5)
lab = nb.lab
measures = labs.load(5, "attention_measures")
# small on a CPU, GPU-sized on a GPU: the same code either way; full attention (not causal)
size = dict(heads=8, head_dim=64, dtype="float16", chunk=1024, seq_lens=(1024, 2048, 4096, 8192, 16384)) \
    if nb.on_gpu else {}
config = lab.Config(device=nb.device.type, **size)

# %% [markdown]
# ## Forward pass: peak bytes against sequence length
#
# `lab.run` is the function the command line calls. For each sequence length s and implementation it
# makes fresh inputs, runs the attention under a fresh ledger (no grad: inference), and records
# the peak of live bytes the attention itself allocated (its inputs were made before the ledger
# started and are the same for every implementation). It also runs the same inputs in float64
# once per length as the yardstick for the error column. The second table is the formulas of
# `lab.predicted_bytes`; on a CPU the ledger counts `storage.nbytes()`, so they agree to the byte.

# %%
fwd = lab.run(config)
SEQ = config.seq_lens
by = {(r["impl"], r["seq_len"]): r for r in fwd.rows}
forward = Table(["s", *((impl, "B") for impl in lab.IMPLS), ("max error of the three", "sci:1")],
                [[s, *(by[i, s]["peak_bytes"] for i in lab.IMPLS), max(by[i, s]["max_abs_error"] for i in lab.IMPLS)]
                 for s in SEQ])
forward_derived = Table(["s", ("one s x s matrix", "B"), *((impl, "B") for impl in lab.IMPLS),
                         ("equal to the measurement", "yes")],
                        [[s, by["naive", s]["scores_bytes"], *(by[i, s]["predicted_bytes"] for i in lab.IMPLS),
                          all(by[i, s]["peak_bytes"] == by[i, s]["predicted_bytes"] for i in lab.IMPLS)] for s in SEQ])
display(forward, forward_derived)

# %% [markdown]
# ## Which SDPA backend ran
#
# `scaled_dot_product_attention` picks a backend at run time. The ledger records the aten op
# that allocated each tensor, and each fused backend has its own op
# (`_scaled_dot_product_flash_attention_for_cpu` on a CPU, `..._efficient_attention`,
# `..._flash_attention` or `..._cudnn_attention` on a GPU); the math backend has none and shows up
# as plain `bmm` and `softmax`. Pinning a backend with `torch.nn.attention.sdpa_kernel` and
# running the sweep again shows what each one costs.

# %%
pins = ["math"] + (["flash", "efficient", "cudnn"] if nb.on_gpu else [])  # CPU: auto already runs its flash kernel
pinned = {"auto": fwd}  # the sweep above: no pin
for pin in pins:
    try:
        pinned[pin] = lab.run(replace(config, impl="sdpa", sdpa_backend=pin))
    except lab.UsageError as err:  # e.g. a GPU or torch without that backend
        print(err)
backends = Table([("--sdpa-backend", "code"), "backend that ran (from the aten op)", ("peak at the largest s", "B"),
                  ("fitted slope", "float:2")],
                 [[pin, ", ".join(r.backends_ran), r.rows[-1]["peak_bytes"], r.slopes()["sdpa"]]
                  for pin, r in pinned.items()])
display(backends)

# %% [markdown]
# ## Peak bytes on log-log axes, with the formulas drawn over them
#
# Points are measured; lines are derived by `lab.predicted_bytes`, in the handbook's notation
# (b = micro-batch, a = heads, s = sequence length, d_head = head dimension, e = bytes per element)
# and c = query rows per chunk:
#
# - naive: `2 b a s² e + b a s d_head e` (scores and probabilities alive together, plus the output)
# - chunked: `b a s d_head e + 2 b a c s e + b a c d_head e` (the output plus one block's scores and probabilities)
# - SDPA (fused): `b a s d_head e + 4 b a s` (the output plus one float32 log-sum-exp per row)
#
# A straight line of slope p on these axes means bytes grow like s^p.

# %%
xs, slopes = [float(s) for s in SEQ], fwd.slopes()
fig, ax = plt.subplots(figsize=(8.5, 5.2), dpi=110, layout="constrained")
styles = {"naive": (plot.SERIES[3], "o"), "chunked": (plot.SERIES[0], "s"), "sdpa": (plot.SERIES[2], "^")}
for impl, (color, marker) in styles.items():
    ax.loglog(xs, [by[impl, s]["peak_bytes"] for s in SEQ], marker, color=color, ms=7,
              label=f"{impl} measured (slope {slopes[impl]:.2f})")
    ax.loglog(xs, [by[impl, s]["predicted_bytes"] for s in SEQ], "-", color=color, lw=1.2, alpha=0.8,
              label=f"{impl} derived")
    if nb.on_gpu:
        ax.loglog(xs, [by[impl, s]["cuda_peak_bytes"] for s in SEQ], marker, mfc="none", color=color, ms=11,
                  label=f"{impl} max_memory_allocated")
if "math" in pinned:
    ax.loglog(xs, [r["peak_bytes"] for r in pinned["math"].rows], "x", color=plot.SERIES[4], ms=9,
              label=f"sdpa pinned to MATH (slope {pinned['math'].slopes()['sdpa']:.2f})")
ax.loglog(xs, [by["naive", s]["scores_bytes"] for s in SEQ], ":", color=plot.INK_MUTED, label="one s x s matrix, b a s² e")
ax.set(xlabel="sequence length s (log)", ylabel="peak bytes the attention allocated (log)",
       title=f"Forward peak against s on {nb.device.type}: {config.dtype}, b={config.batch}, a={config.heads}, "
             f"d_head={config.head_dim}, c={config.chunk}, not causal")
ax.legend(fontsize=7.5, loc="upper left")
ax.grid(which="both", alpha=0.25)
notebook.show(fig, alt="Forward peak bytes against sequence length on log-log axes for naive, chunked and SDPA "
                       "attention, measured points with the derived formulas as lines")

# %%
expected = {"naive": "2 (quadratic)", "chunked": "1 (linear)", "sdpa": "1 (linear)"}
slope_table = Table(["implementation", ("fitted slope of log(peak) on log(s)", "float:3"), "expected", "SDPA backend"],
                    [[impl, p, expected[impl], ", ".join(fwd.backends_ran) if impl == "sdpa" else "-"]
                     for impl, p in slopes.items()])
display(slope_table)

# %% [markdown]
# ## What the ledger cannot see: the fused kernel's own scratch
#
# The ledger sees every tensor an op *returns*. A fused kernel may also allocate working buffers
# inside itself and free them before it returns. On a CPU, `torch.profiler` with
# `profile_memory=True` sees those allocations too (the `aten::empty` calls made inside the
# kernel: `kernel_scratch_bytes` in `attention_measures.py`), so we can check that the SDPA line
# above is not hiding a quadratic buffer. The second table repeats the largest s with 1, 2 and 4
# threads: the kernel's scratch is per thread. This is a CPU measurement at the CPU sizes on any
# machine; on a GPU, `max_memory_allocated` (in the figure) includes the kernels' workspaces.

# %%
cpu = lab.run(lab.Config(device="cpu", impl="sdpa")) if nb.on_gpu else fwd
cpu_seq = cpu.config.seq_lens
scratch = {s: measures.kernel_scratch_bytes(*lab.make_qkv(s, cpu.config, "cpu"), threads=1) for s in cpu_seq}
largest = lab.make_qkv(cpu_seq[-1], cpu.config, "cpu")
by_threads = {t: measures.kernel_scratch_bytes(*largest, threads=t) for t in (1, 2, 4)}
scratch_table = Table(["s", ("SDPA output + log-sum-exp (ledger)", "bytes"), ("scratch inside the kernel (profiler)", "bytes")],
                      [[r["seq_len"], r["peak_bytes"], scratch[r["seq_len"]]] for r in cpu.rows if r["impl"] == "sdpa"],
                      unit="KiB")
scratch_threads = Table(["threads", (f"scratch at s = {cpu_seq[-1]} (profiler)", "B"), ("÷ one thread's", "x:2")],
                        [[t, b, b / by_threads[1]] for t, b in by_threads.items()])
display(scratch_table, scratch_threads)

# %% [markdown]
# ## Forward and backward, as timelines
#
# A training step also runs backward, and backward needs what forward kept. The same sweep with
# `backward=True` runs `lab.train_step` (one forward and one backward) under the ledger; on a CPU
# it stops at s = 1024, to keep this notebook under 20 seconds. Each measurement keeps its ledger
# timeline: here is each implementation at the second largest s. The dotted line marks the size
# of one s x s matrix.

# %%
bwd_config = replace(config, backward=True, seq_lens=SEQ if nb.on_gpu else SEQ[:-1])
bwd = lab.run(bwd_config)
rec = lab.run(replace(bwd_config, recompute=True, impl="chunked"))
series = {"naive": bwd, "chunked": bwd, "chunked + recompute": rec, "sdpa": bwd}
get = {name: {r["seq_len"]: r for r in res.rows if r["impl"] == name.split(" ")[0]} for name, res in series.items()}
S_TL, BSEQ = SEQ[-2], bwd_config.seq_lens
fig_tl, axes = plt.subplots(len(series), 1, figsize=(10, 2.7 * len(series)), dpi=110, layout="constrained")
for ax, (name, res) in zip(axes, series.items()):
    tl = res.timelines[name.split(" ")[0], S_TL]
    plot.plot_timeline(tl, ax=ax, title=f"{name}: forward + backward at s={S_TL} (measured by the ledger)",
                       overlay={"one s x s matrix (derived)": [get[name][S_TL]["scores_bytes"]] * len(tl)})
notebook.show(fig_tl, alt="Ledger timelines of one forward and backward pass for naive, chunked, chunked with "
                          "recompute, and SDPA attention, each with a dashed line for one s by s matrix")

# %% [markdown]
# ## Forward + backward: what forward keeps for backward
#
# "Kept" is what is still alive when forward ends: the tensors autograd saved for backward, plus
# the output. Naive attention keeps its s x s probabilities. Chunked attention keeps every block's
# probabilities, which together are the same s x s. Only recomputing each block in backward
# (`recompute=True`, `torch.utils.checkpoint` per block) or a fused kernel, which keeps one
# log-sum-exp per row and recomputes the rest, makes it linear.

# %%
kept_slopes = {name: res.slopes("kept_bytes")[name.split(" ")[0]] for name, res in series.items()}
peak_slopes = {name: res.slopes()[name.split(" ")[0]] for name, res in series.items()}
backward = Table(["s", *((name, "B") for name in series), ("max error (output and gradients)", "sci:1")],
                 [[s, *(get[name][s]["kept_bytes"] for name in series),
                   max(max(get[name][s]["max_abs_error"], get[name][s]["grad_max_abs_error"]) for name in series)]
                  for s in BSEQ])
backward_peak = Table(["s", *((name, "B") for name in series)],
                      [[s, *(get[name][s]["peak_bytes"] for name in series)] for s in BSEQ])
backward_slopes = Table(["forward + backward", ("slope of bytes kept for backward", "float:3"),
                         ("slope of the step's peak", "float:3")],
                        [[name, kept_slopes[name], peak_slopes[name]] for name in series])
display(backward, backward_peak, backward_slopes)

# %%
fig_bwd, (ax_k, ax_p) = plt.subplots(2, 1, figsize=(7, 8.5), dpi=110, layout="constrained")  # stacked: phones
# wide pale lines under thin dashed ones, so that series which coincide stay visible
looks = {"naive": dict(color=plot.SERIES[3], marker="o", lw=5, ms=10, alpha=0.55),
         "chunked": dict(color=plot.SERIES[0], marker="s", ls="--", lw=1.5, ms=5),
         "chunked + recompute": dict(color=plot.SERIES[4], marker="D", lw=5, ms=10, alpha=0.55),
         "sdpa": dict(color=plot.SERIES[2], marker="^", ls="--", lw=1.5, ms=6)}
bxs = [float(s) for s in BSEQ]
for name in series:
    ax_k.loglog(bxs, [get[name][s]["kept_bytes"] for s in BSEQ], label=f"{name} (slope {kept_slopes[name]:.2f})",
                **looks[name])
    ax_p.loglog(bxs, [get[name][s]["peak_bytes"] for s in BSEQ], label=f"{name} (slope {peak_slopes[name]:.2f})",
                **looks[name])
for ax, title in ((ax_k, "kept after forward, for backward (measured)"), (ax_p, "peak of forward + backward (measured)")):
    ax.loglog(bxs, [get["naive"][s]["scores_bytes"] for s in BSEQ], ":", color=plot.INK_MUTED,
              label="one s x s matrix (derived)")
    ax.set(title=title, xlabel="sequence length s (log)", ylabel="bytes (log)")
    ax.legend(fontsize=7.5)
    ax.grid(which="both", alpha=0.25)
notebook.show(fig_bwd, alt="Bytes kept for backward and peak bytes of forward plus backward against sequence "
                           "length, log-log, for the four attention implementations")

# %% [markdown]
# ## Causal masking
#
# The sweeps above are full (not causal) attention. With `causal=True` each query sees only the
# keys up to its own position. The naive and chunked versions build a boolean mask (1 byte per
# pair) and fill the masked scores with minus infinity in place, so the mask is freed before the
# softmax allocates its output.

# %%
causal = lab.run(replace(config, causal=True, seq_lens=(S_TL,)))
causal_table = Table([f"s = {S_TL}", ("peak, full", "B"), ("peak, causal", "B"), ("max error, causal", "sci:1")],
                     [[r["impl"], by[r["impl"], S_TL]["peak_bytes"], r["peak_bytes"], r["max_abs_error"]]
                      for r in causal.rows])
display(causal_table)

# %% [markdown]
# ## Allocated against the ledger (CUDA only)
#
# On a GPU every row also carries `torch.cuda.max_memory_allocated()` minus what was allocated
# before the run (the inputs), which includes kernel workspaces the ledger cannot see. On a CPU
# there is no caching allocator to compare with, and the table says so.

# %%
cuda = Table(["impl", "s", ("ledger peak", "bytes"), ("max_memory_allocated - inputs", "bytes"), ("ratio", "float:3")],
             [[r["impl"], r["seq_len"], r["peak_bytes"], r.get("cuda_peak_bytes"),
               r["peak_bytes"] / r["cuda_peak_bytes"] if r.get("cuda_peak_bytes") else None] for r in fwd.rows])
display(cuda)

# %% [markdown]
# ## At real scale: Llama-3-8B's attention at 8k, 32k and 128k tokens, traced on fake tensors
#
# The same `lab.run`, with `model="llama-3-8b"` (its attention's shape: 32 query heads, 8 key/value
# heads, head dimension 128) and `fake=True`, in bf16, batch 1, at 8,192, 32,768 and 131,072 tokens;
# chunks of 1,024 query rows (this lab's GPU setting). One attention layer, the attention itself:
# q, k, v and the output gradient are inputs, made before the ledger starts; the peak is what the
# attention allocates on top of them (with backward, the gradients of q, k and v included). Naive
# and chunked attention repeat k and v to every query head (grouped-query attention, as Hugging
# Face's eager path does); SDPA takes them as they are (`enable_gqa`). Full (not causal) attention,
# as in the sweeps above. Every figure here is **traced on fake tensors** (`labkit.fake`): the
# ledger counts each storage the attention would allocate, rounded to the CUDA caching allocator's
# 512-byte blocks; nothing is allocated (the naive 131,072-token run would need terabytes), no
# value is computed (so no error column), no time is measured. The trace takes PyTorch's CPU
# dispatch: SDPA runs the CPU flash kernel, which keeps what CUDA's flash kernel keeps (the output
# and a float32 log-sum-exp per row) less CUDA's two 8-byte RNG tensors; kernel workspaces, the CUDA
# context and fragmentation are not in it.

# %%
llama = dict(model="llama-3-8b", fake=True, dtype="bfloat16", chunk=1024, seq_lens=(8192, 32768, 131072))
real_fwd = lab.run(lab.Config(device="cpu", **llama))
real_bwd = lab.run(lab.Config(device="cpu", backward=True, **llama))
real_rec = lab.run(lab.Config(device="cpu", backward=True, recompute=True, impl="chunked", **llama))
real_scale = measures.real_scale_table(real_fwd, real_bwd, real_rec)
real_scale_derived = all(r["peak_bytes" if not res.config.backward else "kept_bytes"] == r["predicted_bytes"]
                         for res in (real_fwd, real_bwd, real_rec) for r in res.rows)
display(real_scale)

# %%
fig_real, ax = plt.subplots(figsize=(8, 5), dpi=110, layout="constrained")
RSEQ = [float(s) for s in llama["seq_lens"]]
real_series = {"naive": (real_bwd, "naive"), "chunked": (real_bwd, "chunked"),
               "chunked + recompute": (real_rec, "chunked"), "sdpa": (real_bwd, "sdpa")}
for name, (res, impl) in real_series.items():
    ax.loglog(RSEQ, [r["peak_bytes"] for r in res.rows if r["impl"] == impl], marker=looks[name]["marker"],
              color=looks[name]["color"], label=f"{name}: forward + backward peak (traced)")
ax.loglog(RSEQ, [r["scores_bytes"] for r in real_fwd.rows if r["impl"] == "naive"], ":", color=plot.INK_MUTED,
          label="one s x s score matrix, 32 heads, bf16")
ax.axhline(80e9, color=plot.INK, lw=1, ls="-.", label="80 GB: one H100's memory")
ax.set(xlabel="sequence length s (log)", ylabel="bytes (log)",
       title="Llama-3-8B attention, one layer, bf16 (traced on fake tensors)")
ax.set_xticks(RSEQ, [f"{int(s):,}" for s in RSEQ])
ax.legend(fontsize=7.5)
ax.grid(which="both", alpha=0.25)
notebook.show(fig_real, alt="Peak bytes of forward plus backward against sequence length for Llama-3-8B's "
                            "attention, log-log, against one H100's 80 GB")

# %%
notebook.publish(
    nb, tables={"forward": forward, "forward_derived": forward_derived, "backends": backends, "slopes": slope_table,
                "scratch": scratch_table, "scratch_threads": scratch_threads, "backward": backward,
                "backward_peak": backward_peak, "backward_slopes": backward_slopes, "causal": causal_table,
                "cuda": cuda, "real_scale": real_scale},
    figures={"peak_vs_seq": fig, "timelines": fig_tl, "backward_vs_seq": fig_bwd, "real_scale": fig_real},
    real_scale=measures.real_scale_numbers(real_fwd, real_bwd, real_rec) | {
        "chunk": llama["chunk"], "equal_to_the_formulas": real_scale_derived},
    summary=fwd.summary(), slope_bands=measures.SLOPE_BANDS, timeline_seq_len=S_TL, backward_max_seq_len=BSEQ[-1],
    pinned={pin: {"ran": r.backends_ran, "slope": r.slopes()["sdpa"]} for pin, r in pinned.items()},
    kernel_scratch_bytes=scratch, kernel_scratch_bytes_by_threads=by_threads,
    backward={"rows": bwd.rows + rec.rows, "kept_slopes": kept_slopes, "peak_slopes": peak_slopes},
    causal=causal.rows)
