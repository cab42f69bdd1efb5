# %% [markdown]
# # Lab 05 · Memory-efficient attention, measured
#
# This notebook runs the Lab 05 starter, `code/lab-05-memory-efficient-attention/attention.py`:
# the same attention computed three ways (naive, query-chunked, `scaled_dot_product_attention`),
# with the memory ledger counting every byte each one allocates, at sequence lengths from 128 to
# 2048 on a CPU (GPU-sized when run on a GPU). It is executed by `scripts/run_notebooks.py`, never
# edited by hand; the provenance cell below says where and when.
#
# What to look for:
#
# 1. The three outputs agree with a float64 reference within the stated tolerance.
# 2. On log-log axes, naive attention's peak climbs with slope 2, chunked and SDPA with slope 1,
#    and the derived formulas lie on the measured points.
# 3. With backward, chunking alone keeps N x N probabilities again; recomputing each block (what
#    the fused kernels do) brings it back to slope 1.

# %%
import os
import sys
from pathlib import Path

ROOT = Path(os.environ.get("INFRALAB_ROOT") or next(
    p for p in [Path.cwd(), *Path.cwd().parents] if (p / "code" / "labkit").is_dir()))
sys.path.insert(0, str(ROOT / "code"))

import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from labkit import Ledger, UsageError  # noqa: E402
from labkit import notebook as nbk  # noqa: E402
from labkit import plot, provenance  # noqa: E402

lab = nbk.load_lab("lab-05-memory-efficient-attention/attention.py")
DEVICE = lab.pick_device(nbk.device_name())
OUT = nbk.results_dir(lab.LAB)
ON_GPU = DEVICE.type == "cuda"
# Small on a CPU; GPU-sized on a GPU (the same code either way). Full attention (not causal).
SIZE = (["--heads", "8", "--head-dim", "64", "--dtype", "float16", "--chunk", "1024",
         "--seq-lens", "1024,2048,4096,8192,16384"]
        if ON_GPU else ["--heads", "2", "--head-dim", "32", "--dtype", "float32", "--chunk", "128",
                        "--seq-lens", "128,256,512,1024,2048"])
BASE = ["--device", DEVICE.type, "--json", *SIZE]
SLOPE_BAND = {"quadratic": (1.85, 2.05), "linear": (0.9, 1.1)}  # asserted on CPU, as in tests/test_lab05.py
print("device:", DEVICE, "| results go to:", OUT.relative_to(OUT.parents[1]))

# %% tags=["provenance"]
record = provenance.collect(lab.LAB, DEVICE)
nbk.show_provenance(record)

# %% [markdown]
# ## Forward pass: peak bytes against sequence length
#
# `lab.sweep` is the function the command line calls. For each length N and implementation it
# makes fresh inputs, runs the attention under a fresh ledger (no grad: inference), and records
# the peak of live bytes the attention itself allocated (its inputs were made before the ledger
# started and are the same for every implementation). It also runs the same inputs in float64
# once per length as the yardstick for the error column.

# %%
fwd_args = lab.parse_args(BASE)
fwd = lab.sweep(fwd_args)
cfg = fwd["config"]
BH, D = cfg["batch"] * cfg["heads"], cfg["head_dim"]
E = torch.empty((), dtype=lab.DTYPES[cfg["dtype"]]).element_size()
NS = cfg["seq_lens"]
by = {(r["impl"], r["seq_len"]): r for r in fwd["rows"]}
fb = plot.format_bytes

rows = ["| N | naive | chunked | sdpa | max error of the three |", "|---:|---:|---:|---:|---:|"]
drows = ["| N | one N x N matrix | naive | chunked | sdpa | equal to the measurement |",
         "|---:|---:|---:|---:|---:|:---:|"]
for n in NS:
    r = [by[(i, n)] for i in lab.IMPLS]
    rows.append(f"| {n} | " + " | ".join(fb(x["peak_bytes"]) for x in r)
                + f" | {max(x['max_abs_error'] for x in r):.1e} |")
    same = all(x["peak_bytes"] == x["predicted_bytes"] for x in r)
    drows.append(f"| {n} | {fb(r[0]['scores_bytes'])} | " + " | ".join(fb(x["predicted_bytes"]) for x in r)
                 + f" | {'yes, to the byte' if same else 'no'} |")
forward_table, derived_table = "\n".join(rows), "\n".join(drows)
nbk.show_markdown(forward_table + "\n\nDerived by the formulas:\n\n" + derived_table)
if not ON_GPU:  # on CPU the ledger counts storage.nbytes(): formula and measurement agree to the byte
    assert all(r["peak_bytes"] == r["predicted_bytes"] for r in fwd["rows"])
assert fwd["outside_tolerance"] == [], fwd["outside_tolerance"]
print(f"tolerance: |error| <= {fwd['tolerance']:g} x max(1, max |float64 value|), every row within it")

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
pins = ["math"] + (["flash", "efficient", "cudnn"] if ON_GPU else [])  # CPU: auto already runs its flash kernel
pinned = {"auto": fwd}  # the sweep above: no pin
for pin in pins:
    try:
        pinned[pin] = lab.sweep(lab.parse_args([*BASE, "--impl", "sdpa", "--sdpa-backend", pin]))
    except UsageError as err:  # e.g. a GPU or torch without that backend
        print(f"--sdpa-backend {pin}: {err}")
rows = ["| --sdpa-backend | backend that ran (from the aten op) | peak at the largest N | fitted slope |",
        "|---|---|---:|---:|"]
for pin, res in pinned.items():
    top = res["rows"][-1]
    rows.append(f"| `{pin}` | {', '.join(res['sdpa_backend_ran'])} | {fb(top['peak_bytes'])} "
                f"| {res['slopes']['sdpa']:.2f} |")
backend_table = "\n".join(rows)
nbk.show_markdown(backend_table)
print("the sweep's SDPA ran:", fwd["sdpa_backend_ran"])
if not ON_GPU:
    assert fwd["sdpa_backend_ran"] == ["FLASH_ATTENTION"] and pinned["math"]["sdpa_backend_ran"] == ["MATH"]

# %% [markdown]
# ## Peak bytes on log-log axes, with the formulas drawn over them
#
# Points are measured; lines are derived (B = batch, H = heads, d = head dim, e = bytes per
# element, C = chunk):
#
# - naive: `2 B H N² e + B H N d e` (scores and probabilities alive together, plus the output)
# - chunked: `B H N d e + 2 B H C N e + B H C d e` (the output plus one block's scores and probabilities)
# - SDPA (fused): `B H N d e + 4 B H N` (the output plus one float32 log-sum-exp per row)
#
# A straight line of slope p on these axes means bytes grow like N^p.

# %%
def derived(impl, n):
    """The formula from lab.predicted_bytes, for the backend the sweep's SDPA ran."""
    return lab.predicted_bytes(impl, n, fwd_args, E, fwd["sdpa_backend_ran"][0] if impl == "sdpa" else None)


xs = [float(n) for n in NS]
fig, ax = plt.subplots(figsize=(8.5, 5.2), dpi=110, layout="constrained")
styles = {"naive": ("#C44E52", "o"), "chunked": ("#4C72B0", "s"), "sdpa": ("#55A868", "^")}
for impl, (color, marker) in styles.items():
    ys = [by[(impl, n)]["peak_bytes"] for n in NS]
    ax.loglog(xs, ys, marker, color=color, ms=7, label=f"{impl} measured (slope {fwd['slopes'][impl]:.2f})")
    ax.loglog(xs, [derived(impl, n) for n in NS], "-", color=color, lw=1.2,
              alpha=0.8, label=f"{impl} derived")
    if ON_GPU:
        ax.loglog(xs, [by[(impl, n)]["cuda_peak_bytes"] for n in NS], marker, mfc="none", color=color, ms=11,
                  label=f"{impl} max_memory_allocated")
if "math" in pinned:
    ax.loglog(xs, [r["peak_bytes"] for r in pinned["math"]["rows"]], "x", color="#8172B3", ms=9,
              label=f"sdpa pinned to MATH (slope {pinned['math']['slopes']['sdpa']:.2f})")
ax.loglog(xs, [BH * n * n * E for n in NS], ":", color="#555555", label="one N x N matrix, B H N² e")
ax.set(xlabel="sequence length N (log)", ylabel="peak bytes the attention allocated (log)",
       title=f"Forward peak against N on {DEVICE.type}: {cfg['dtype']}, B={cfg['batch']}, H={cfg['heads']}, "
             f"d={D}, C={cfg['chunk']}, not causal")
ax.grid(which="both", alpha=0.25)
ax.legend(fontsize=7.5, loc="upper left")
plot.save(fig, OUT / "peak_vs_seq.svg")

# %%
slope_rows = ["| implementation | fitted slope of log(peak) on log(N) | expected | SDPA backend |", "|---|---:|---:|---|"]
expected = {"naive": "2 (quadratic)", "chunked": "1 (linear)", "sdpa": "1 (linear)"}
for impl, s in fwd["slopes"].items():
    slope_rows.append(f"| {impl} | {s:.3f} | {expected[impl]} | {', '.join(fwd['sdpa_backend_ran']) if impl == 'sdpa' else '-'} |")
slope_table = "\n".join(slope_rows)
nbk.show_markdown(slope_table)
print("fitted slopes:", {k: round(v, 3) for k, v in fwd["slopes"].items()})
if not ON_GPU:
    lo, hi = SLOPE_BAND["quadratic"]
    assert lo <= fwd["slopes"]["naive"] <= hi
    lo, hi = SLOPE_BAND["linear"]
    assert lo <= fwd["slopes"]["chunked"] <= hi and lo <= fwd["slopes"]["sdpa"] <= hi
(q_lo, q_hi), (l_lo, l_hi) = SLOPE_BAND["quadratic"], SLOPE_BAND["linear"]
slope_band_text = (f"The notebook and `tests/test_lab05.py` assert a fitted slope of {q_lo:g} to {q_hi:g} for naive "
                   f"and {l_lo:g} to {l_hi:g} for chunked and SDPA on a CPU.")
nbk.show_markdown(slope_band_text)

# %% [markdown]
# ## What the ledger cannot see: the fused kernel's own scratch
#
# The ledger sees every tensor an op *returns*. A fused kernel may also allocate working buffers
# inside itself and free them before it returns. On a CPU, `torch.profiler` with
# `profile_memory=True` sees those allocations too (the `aten::empty` calls made inside the
# kernel), so we can check that the SDPA line above is not hiding a quadratic buffer. The second
# table repeats the largest N with 1, 2 and 4 threads: the kernel's scratch is per thread.

# %%
import contextlib  # noqa: E402

from torch.profiler import ProfilerActivity, profile  # noqa: E402


@contextlib.contextmanager
def quiet_fd2():
    """The CPU profiler logs two lines per run straight to file descriptor 2; drop just those."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def kernel_scratch(n, threads):
    """Bytes the SDPA kernel allocated inside itself (aten::empty calls), seen by the profiler."""
    q, k, v = lab.make_qkv(n, fwd_args, DEVICE)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with quiet_fd2(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(q, k, v)
    finally:
        torch.set_num_threads(before)
    return sum(e.self_cpu_memory_usage for e in prof.key_averages() if e.key == "aten::empty")


scratch_rows = ["| N | SDPA output + log-sum-exp (ledger) | scratch inside the kernel (profiler) |", "|---:|---:|---:|"]
scratch, by_threads = {}, {}
if not ON_GPU:
    THREADS = torch.get_num_threads()
    for n in NS:
        scratch[n] = kernel_scratch(n, THREADS)
        scratch_rows.append(f"| {n} | {fb(by[('sdpa', n)]['peak_bytes'])} | {fb(scratch[n])} |")
    by_threads = {t: kernel_scratch(NS[-1], t) for t in (1, 2, 4)}
    thread_rows = [f"| threads | scratch at N = {NS[-1]} (profiler) | ÷ one thread's |", "|---:|---:|---:|"] + [
        f"| {t} | {fb(b)} | {b / by_threads[1]:.2f}× |" for t, b in by_threads.items()]
    scratch_table = "\n".join(scratch_rows) + "\n\n" + "\n".join(thread_rows)
    nbk.show_markdown(scratch_table)
    assert by_threads[1] < by_threads[2] < by_threads[4], by_threads  # the page says it grows with threads
    print(f"scratch at N={NS[-1]} over N={NS[-2]}: x{scratch[NS[-1]] / scratch[NS[-2]]:.2f}, while one N x N matrix "
          f"grows x{(NS[-1] / NS[-2]) ** 2:.0f}; at N={NS[-1]} it is {scratch[NS[-1]] / (BH * NS[-1] ** 2 * E):.1%} "
          f"of one N x N matrix, with {THREADS} threads")
else:
    scratch_table = "GPU run: the allocator's max_memory_allocated (in the figure) already includes kernel workspaces."
    print(scratch_table)

# %% [markdown]
# ## Forward and backward, as timelines
#
# A training step also runs backward, and backward needs what forward kept. `lab.train_step`
# runs one forward and one backward of each implementation under the ledger at one length. The
# dotted line marks the size of one N x N matrix.

# %%
N_TL = NS[-2]
variants = [("naive", []), ("chunked", []), ("chunked", ["--recompute"]), ("sdpa", [])]
fig, axes = plt.subplots(len(variants), 1, figsize=(10, 2.7 * len(variants)), dpi=110, layout="constrained")
for ax, (impl, extra) in zip(axes, variants):
    a = lab.parse_args([*BASE, "--backward", *extra])
    q, k, v = lab.make_qkv(N_TL, a, DEVICE, requires_grad=True)
    grad_out = lab.make_qkv(N_TL, a, DEVICE, seed_offset=7)[0]
    ledger = Ledger(DEVICE)
    with ledger:
        lab.train_step(lab.attention_fn(impl, a), q, k, v, grad_out, ledger)
    tl = ledger.timeline()
    name = impl + (" + recompute" if extra else "")
    plot.plot_timeline(tl, ax=ax, title=f"{name}: forward + backward at N={N_TL} (measured by the ledger)",
                       overlay={"one N x N matrix (derived)": [BH * N_TL * N_TL * E] * len(tl)})
plot.save(fig, OUT / "timelines.svg")

# %% [markdown]
# ## Forward + backward: what forward keeps for backward
#
# The same sweep with `--backward` (on a CPU up to N = 1024, to keep this notebook under 20 s).
# "Kept" is what is still alive when forward ends: the tensors
# autograd saved for backward, plus the output. Naive attention keeps its N x N probabilities.
# Chunked attention keeps every block's probabilities, which together are the same N x N. Only
# recomputing each block in backward (`--recompute`, `torch.utils.checkpoint` per block) or a
# fused kernel, which keeps one log-sum-exp per row and recomputes the rest, makes it linear.

# %%
BWD = BASE if ON_GPU else [*BASE, "--seq-lens", ",".join(str(n) for n in NS[:-1])]
BNS = NS if ON_GPU else NS[:-1]
bwd = lab.sweep(lab.parse_args([*BWD, "--backward"]))
rec = lab.sweep(lab.parse_args([*BWD, "--backward", "--recompute", "--impl", "chunked"]))
series = {"naive": bwd, "chunked": bwd, "chunked + recompute": rec, "sdpa": bwd}
get = {name: {r["seq_len"]: r for r in res["rows"] if r["impl"] == name.split(" ")[0]} for name, res in series.items()}
names = " | ".join(series)
kept_rows = [f"| N | {names} | max error (output and gradients) |", "|---:|" + "---:|" * (len(series) + 1)]
peak_rows = [f"| N | {names} |", "|---:|" + "---:|" * len(series)]
for n in BNS:
    err = max(max(get[name][n]["max_abs_error"], get[name][n]["grad_max_abs_error"]) for name in series)
    kept_rows.append(f"| {n} | " + " | ".join(fb(get[name][n]["kept_bytes"]) for name in series) + f" | {err:.1e} |")
    peak_rows.append(f"| {n} | " + " | ".join(fb(get[name][n]["peak_bytes"]) for name in series) + " |")
backward_table, backward_peak_table = "\n".join(kept_rows), "\n".join(peak_rows)
nbk.show_markdown("Kept after forward:\n\n" + backward_table + "\n\nPeak of forward + backward:\n\n"
                  + backward_peak_table)

kept_slopes = {"naive": bwd["kept_slopes"]["naive"], "chunked": bwd["kept_slopes"]["chunked"],
               "chunked + recompute": rec["kept_slopes"]["chunked"], "sdpa": bwd["kept_slopes"]["sdpa"]}
peak_slopes = {"naive": bwd["slopes"]["naive"], "chunked": bwd["slopes"]["chunked"],
               "chunked + recompute": rec["slopes"]["chunked"], "sdpa": bwd["slopes"]["sdpa"]}
backward_slope_table = "\n".join(
    ["| forward + backward | slope of bytes kept for backward | slope of the step's peak |", "|---|---:|---:|"]
    + [f"| {name} | {kept_slopes[name]:.3f} | {peak_slopes[name]:.3f} |" for name in series])
nbk.show_markdown(backward_slope_table)
assert bwd["outside_tolerance"] == [] and rec["outside_tolerance"] == []
if not ON_GPU:
    for res in (bwd, rec):  # kept bytes = the derived formula, to the byte
        assert all(r["kept_bytes"] == r["predicted_bytes"] for r in res["rows"])
    assert all(get["naive"][n]["kept_bytes"] == get["chunked"][n]["kept_bytes"] for n in BNS)
    lo, hi = SLOPE_BAND["linear"]
    assert kept_slopes["naive"] > 1.8 and kept_slopes["chunked"] > 1.8
    assert lo <= kept_slopes["chunked + recompute"] <= hi and lo <= kept_slopes["sdpa"] <= hi
    assert lo <= peak_slopes["chunked + recompute"] <= hi and lo <= peak_slopes["sdpa"] <= hi

# %%
fig, (ax_k, ax_p) = plt.subplots(2, 1, figsize=(7, 8.5), dpi=110, layout="constrained")  # stacked: phones
# wide pale lines under thin dashed ones, so that series which coincide stay visible
looks = {"naive": dict(color="#C44E52", marker="o", lw=5, ms=10, alpha=0.55),
         "chunked": dict(color="#4C72B0", marker="s", ls="--", lw=1.5, ms=5),
         "chunked + recompute": dict(color="#8172B3", marker="D", lw=5, ms=10, alpha=0.55),
         "sdpa": dict(color="#55A868", marker="^", ls="--", lw=1.5, ms=6)}
bxs = [float(n) for n in BNS]
for name in series:
    ax_k.loglog(bxs, [get[name][n]["kept_bytes"] for n in BNS], label=f"{name} (slope {kept_slopes[name]:.2f})",
                **looks[name])
    ax_p.loglog(bxs, [get[name][n]["peak_bytes"] for n in BNS], label=f"{name} (slope {peak_slopes[name]:.2f})",
                **looks[name])
for ax in (ax_k, ax_p):
    ax.loglog(bxs, [BH * n * n * E for n in BNS], ":", color="#555555", label="one N x N matrix (derived)")
    ax.grid(which="both", alpha=0.25)
    ax.legend(fontsize=7.5)
    ax.set_xlabel("sequence length N (log)")
    ax.set_ylabel("bytes (log)")
ax_k.set(title="kept after forward, for backward (measured)")
ax_p.set(title="peak of forward + backward (measured)")
plot.save(fig, OUT / "backward_vs_seq.svg")

# %% [markdown]
# ## Causal masking
#
# The sweeps above are full (not causal) attention. With `--causal` each query sees only the keys
# up to its own position. The naive and chunked versions build a boolean mask (1 byte per pair)
# and fill the masked scores with minus infinity in place, so the mask is freed before the
# softmax allocates its output.

# %%
causal = lab.sweep(lab.parse_args([*BASE, "--causal", "--seq-lens", str(N_TL)]))
full = {r["impl"]: r for r in fwd["rows"] if r["seq_len"] == N_TL}
causal_table = "\n".join(
    [f"| N = {N_TL} | peak, full | peak, causal | max error, causal |", "|---|---:|---:|---:|"]
    + [f"| {r['impl']} | {fb(full[r['impl']]['peak_bytes'])} | {fb(r['peak_bytes'])} | {r['max_abs_error']:.1e} |"
       for r in causal["rows"]])
nbk.show_markdown(causal_table)
assert causal["outside_tolerance"] == []

# %% [markdown]
# ## Allocated against the ledger (CUDA only)
#
# On a GPU every row also carries `torch.cuda.max_memory_allocated()` minus what was allocated
# before the run (the inputs), which includes kernel workspaces the ledger cannot see. On a CPU
# there is no caching allocator to compare with, and this cell says so.

# %%
if ON_GPU:
    rows = ["| impl | N | ledger peak | max_memory_allocated - inputs | ratio |", "|---|---:|---:|---:|---:|"]
    for r in fwd["rows"]:
        rows.append(f"| {r['impl']} | {r['seq_len']} | {fb(r['peak_bytes'])} | {fb(r['cuda_peak_bytes'])} | "
                    f"{r['peak_bytes'] / max(r['cuda_peak_bytes'], 1):.3f} |")
    cuda_table = "\n".join(rows)
    nbk.show_markdown(cuda_table)
else:
    cuda_table = None
    print("CPU run: no CUDA allocator here; the ledger's bytes are exact (storage.nbytes()).")

# %% [markdown]
# ## Results written for the page

# %%
from labkit.provenance import write_results  # noqa: E402

summary = {
    "lab": lab.LAB, "config": cfg, "tolerance": fwd["tolerance"],
    "forward": {"rows": fwd["rows"], "slopes": fwd["slopes"], "sdpa_backend_ran": fwd["sdpa_backend_ran"]},
    "pinned": {pin: {"ran": r["sdpa_backend_ran"], "slope": r["slopes"]["sdpa"]} for pin, r in pinned.items()},
    "kernel_scratch_bytes": scratch, "kernel_scratch_bytes_by_threads": by_threads,
    "backward": {"rows": bwd["rows"] + rec["rows"], "kept_slopes": kept_slopes, "peak_slopes": peak_slopes},
    "causal": causal["rows"], "slope_bands": SLOPE_BAND,
}
wall = sum(r["provenance"]["wall_time_s"] for r in (fwd, bwd, rec, causal, *pinned.values()))
write_results(OUT / "summary.json", summary, provenance.collect(lab.LAB, DEVICE, wall))
tables = {"forward": forward_table, "forward_derived": derived_table, "slopes": slope_table, "backends": backend_table,
          "scratch": scratch_table, "slope_bands": slope_band_text,
          "backward": backward_table, "backward_peak": backward_peak_table, "backward_slopes": backward_slope_table, "causal": causal_table}
if cuda_table:
    tables["cuda"] = cuda_table
# sentences a page includes mid-paragraph: a final newline would end its paragraph there
PROSE = {"slope_bands"}
for name, text in tables.items():
    (OUT / f"{name}.md").write_text(text if name in PROSE else text + "\n")
(OUT / "provenance.md").write_text(nbk.provenance_markdown(record))
print(sorted(p.name for p in OUT.iterdir()))
