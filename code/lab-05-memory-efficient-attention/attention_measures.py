"""Lab 05 - the yardsticks the attention sweep is held to, beside the memory ledger.

* :func:`errors`: every output (and gradient) against the same maths in float64;
* :func:`fit_slope`: the exponent p in bytes ~ s^p (s the sequence length), from a least-squares line on log-log axes;
* :func:`report` and :func:`rows_table`: the sweep for a terminal;
* :func:`real_scale_table` and :func:`real_scale_numbers`: three traced sweeps (forward, forward +
  backward, and chunked with recompute) as one table of peaks and as the numbers a page quotes;
* :func:`kernel_scratch_bytes`: what the ledger cannot see. The ledger records every tensor an op
  returns; a fused kernel may also allocate working buffers inside itself and free them before it
  returns. On a CPU, ``torch.profiler`` with ``profile_memory=True`` sees those allocations (the
  ``aten::empty`` calls made inside the kernel), so the notebook can check that SDPA's linear line
  does not hide a quadratic buffer.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from labkit.table import Table, format_bytes

TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2, "float16": 4e-3}  # |error| vs float64 per unit of max |value|
TRACED = ("traced on fake tensors (labkit.fake): every byte the attention would allocate, rounded as the CUDA "
          "caching allocator rounds it; no values (no error against float64) and no time")
SLOPE_BANDS = {"quadratic": (1.85, 2.05), "linear": (0.9, 1.1)}  # fitted exponents the sweep is held to


def errors(out, grads, ref, tol: float) -> dict:
    """Max |error| against the float64 reference; within tolerance if <= tol x max(1, max |reference|)."""
    pairs = [(out, ref[0])] + (list(zip(grads, ref[1])) if grads is not None else [])
    errs = [(x.double() - r).abs().max().item() for x, r in pairs]
    ok = all(err <= tol * max(1.0, r.abs().max().item()) for err, (_, r) in zip(errs, pairs))
    return {"max_abs_error": errs[0], "within_tolerance": ok} | (
        {"grad_max_abs_error": max(errs[1:])} if grads is not None else {})


def fit_slope(xs, ys) -> float | None:
    """Least-squares slope of log(y) against log(x): the exponent p in y ~ x^p."""
    logs = [(math.log(x), math.log(y)) for x, y in zip(xs, ys)]
    return statistics.linear_regression(*zip(*logs)).slope if len(logs) >= 2 else None


def kernel_scratch_bytes(q, k, v, threads: int) -> int:
    """Bytes the CPU SDPA kernel allocates and frees inside itself (its ``aten::empty`` calls) on
    ``q``, ``k``, ``v`` with ``threads`` intra-op threads: ``torch.profiler`` sees them, the ledger
    does not."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, \
                torch.no_grad():
            F.scaled_dot_product_attention(q, k, v)
    finally:
        torch.set_num_threads(before)
    return sum(ev.self_cpu_memory_usage for ev in prof.key_averages() if ev.key == "aten::empty")


@contextlib.contextmanager
def quiet_stderr():
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


def rows_table(result) -> Table:
    """Every measurement of a sweep: one row per implementation and length."""
    derived = "derived kept" if result.config.backward else "derived peak"
    return Table(["impl", "s", ("peak", "B"), ("kept after forward", "B"), (derived, "B"),
                  ("one s x s matrix", "B"), ("max abs error", "sci:1"), ("grad max abs error", "sci:1"),
                  "backend"],
                 [[r["impl"], r["seq_len"], r.get("peak_bytes"), r.get("kept_bytes"), r.get("predicted_bytes"),
                   r["scores_bytes"], r.get("max_abs_error"), r.get("grad_max_abs_error"),
                   "out of memory" if r.get("oom") else r["backend"]] for r in result.rows])


def real_scale_table(forward, backward, recompute) -> Table:
    """Peak bytes per implementation and pass (rows) at each length (columns), from three sweeps of
    the same lengths: forward only, forward + backward, and forward + backward with chunked recompute."""
    lengths = forward.config.seq_lens
    rows = [["one s x s score matrix", "-", *(_at(forward, "naive", "scores_bytes")[s] for s in lengths)]]
    for title, result, impls in (("forward", forward, forward.impls), ("forward + backward", backward, backward.impls)):
        for impl in impls:
            rows.append([impl, title, *(_at(result, impl)[s] for s in lengths)])
            if impl == "chunked" and result is backward:
                rows.append(["chunked + recompute", title, *(_at(recompute, impl)[s] for s in lengths)])
    return Table(["implementation", "pass", *((f"s = {s:,}", "size") for s in lengths)], rows)


def real_scale_numbers(forward, backward, recompute) -> dict:
    """The same sweeps as numbers a page can quote: ``forward.<impl>.<s>`` (peak bytes),
    ``backward.<impl>.<s>.peak_bytes`` and ``.kept_bytes`` (chunked with recompute as
    ``chunked_recompute``), ``scores_bytes.<s>``."""
    def by_length(result, impl, keys):
        return {str(r["seq_len"]): {k: r[k] for k in keys} for r in result.rows if r["impl"] == impl}
    kept = ("peak_bytes", "kept_bytes")
    return {"seq_lens": list(forward.config.seq_lens),
            "scores_bytes": {str(s): b for s, b in _at(forward, "naive", "scores_bytes").items()},
            "forward": {i: {s: v["peak_bytes"] for s, v in by_length(forward, i, ("peak_bytes",)).items()}
                        for i in forward.impls},
            "backward": {i: by_length(backward, i, kept) for i in backward.impls}
            | {"chunked_recompute": by_length(recompute, "chunked", kept)}}


def _at(result, impl: str, key: str = "peak_bytes") -> dict[int, int]:
    return {r["seq_len"]: r[key] for r in result.rows if r["impl"] == impl}


def report(result) -> None:
    c = result.config
    mode = ("forward + backward" + (", chunked recomputes" if c.recompute else "")) if c.backward \
        else "forward only (no grad)"
    heads = f"{c.heads} heads" + (f" ({c.key_value_heads} key/value heads)" if c.key_value_heads != c.heads else "")
    print(f"Lab 05 on {result.device}: " + (f"{c.model}'s attention, " if c.model_spec() else "")
          + f"batch {c.batch}, {heads}, head dim {c.head_dim}, {c.dtype}, "
          f"{'causal' if c.causal else 'not causal'}, chunk {c.chunk}, {mode}" + (f"\n{TRACED}" if c.fake else "") + "\n")
    print(rows_table(result).text())
    print("\nFitted slope of log(bytes) against log(s) (2 = quadratic, 1 = linear):")
    kept = result.slopes("kept_bytes")
    for impl, p in result.slopes().items():
        print(f"  {impl:8s} peak {'n/a' if p is None else f'{p:.2f}'}"
              + (f"   kept for backward {kept[impl]:.2f}" if c.backward and kept[impl] is not None else ""))
    if result.backends_ran:
        print(f"SDPA ran the {', '.join(result.backends_ran)} backend (named from the aten op that "
              f"allocated its output; --sdpa-backend {c.sdpa_backend}).")
    bad, tol = result.outside_tolerance, TOLERANCE[c.dtype]
    if c.fake:
        print("Traced: no output to hold against float64.")
    else:
        print(f"Every output within tolerance of float64: |error| <= {tol:.0e} x max(1, max |value|)." if not bad
              else f"OUTSIDE the {tol:.0e} tolerance: {', '.join(bad)}")
    if result.cuda:
        print(f"CUDA allocator: max allocated {format_bytes(result.cuda['max_memory_allocated'])} in the sweep")
    if c.snapshot:
        print(f"memory history written to {c.snapshot} (open it at https://pytorch.org/memory_viz)")
