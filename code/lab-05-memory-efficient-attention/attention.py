"""Lab 05 - memory-efficient attention: the N x N score matrix, and three ways to hold it.

softmax(Q K^T / sqrt(d)) V, written as it reads, materialises one score per (query, key) pair:
batch x heads x N x N elements. Three implementations, measured by the memory ledger (labkit):

    naive    the whole score matrix and its softmax at once                 O(N^2) bytes
    chunked  one block of query rows at a time against all the keys         O(N) for a fixed block
    sdpa     F.scaled_dot_product_attention; the ledger names the backend that ran

Every query row still sees every key, so the softmax of each row and the output are unchanged.
--backward measures forward + backward: chunking alone then keeps N x N probabilities for backward
again, unless each block is recomputed (--recompute), as the fused kernels do.

Run it:
    python code/lab-05-memory-efficient-attention/attention.py --device cpu
    python code/lab-05-memory-efficient-attention/attention.py --device cpu --backward --recompute
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time
import warnings
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # makes code/labkit importable

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from labkit import Ledger, UsageError, emit_json, lab_parser, pick_device, progress, provenance, run_lab  # noqa: E402
from labkit.cli import positive_int  # noqa: E402
from labkit.cuda import allocator_stats, record_snapshot, reset_peak  # noqa: E402
from labkit.plot import format_bytes  # noqa: E402

LAB = "lab-05-memory-efficient-attention"
IMPLS = ("naive", "chunked", "sdpa")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2, "float16": 4e-3}  # |error| vs float64 per unit of max |value|
# The aten op each fused SDPA backend runs (same names in torch 2.11 and 2.13); MATH is bmm + softmax.
FUSED_OPS = {f"_scaled_dot_product_{op}": name for op, name in [
    ("flash_attention_for_cpu", "FLASH_ATTENTION"), ("flash_attention", "FLASH_ATTENTION"),
    ("efficient_attention", "EFFICIENT_ATTENTION"), ("cudnn_attention", "CUDNN_ATTENTION"),
    ("fused_attention_overrideable", "OVERRIDEABLE")]}
PIN = {"math": "MATH", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION"}


def seq_list(text: str) -> list[int]:
    """argparse type for ``--seq-lens 256,512,1024``: one or more positive whole numbers."""
    try:
        values = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole numbers like 256,512, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected one or more positive lengths like 256,512, got {text!r}")
    return sorted(set(values))


# --8<-- [start:config]
def parse_args(argv=None):
    p = lab_parser("Naive, query-chunked and fused (SDPA) attention: peak bytes against sequence length.")
    p.add_argument("--impl", choices=[*IMPLS, "all"], default="all")
    p.add_argument("--seq-lens", type=seq_list, default=[128, 256, 512, 1024, 2048], metavar="N,N,...")
    p.add_argument("--chunk", type=positive_int, default=128, help="query rows per block (chunked)")
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--heads", type=positive_int, default=2)
    p.add_argument("--head-dim", type=positive_int, default=32)
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--causal", action="store_true", help="mask future keys (default: full attention)")
    p.add_argument("--backward", action="store_true", help="measure forward + backward, not forward alone")
    p.add_argument("--recompute", action="store_true", help="chunked: recompute each block in backward")
    p.add_argument("--sdpa-backend", choices=["auto", *PIN], default="auto",
                   help="pin SDPA to one backend with torch.nn.attention.sdpa_kernel (auto: let PyTorch choose)")
    p.add_argument("--snapshot", type=Path, help="CUDA only: dump a memory-history pickle for memory_viz")
    return p.parse_args(argv)
# --8<-- [end:config]


# --8<-- [start:naive]
def naive_attention(q, k, v, causal: bool = False, q_offset: int = 0):
    """softmax(q k^T / sqrt(d)) v, materialising every score. q: (B, H, Nq, d); k, v: (B, H, N, d)."""
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)  # (1)!
    if causal:
        rows = torch.arange(q.shape[-2], device=q.device)[:, None] + q_offset
        scores.masked_fill_(torch.arange(k.shape[-2], device=q.device) > rows, float("-inf"))  # (2)!
    probs = scores.softmax(dim=-1)  # (3)!
    return probs @ v  # (4)!
# --8<-- [end:naive]


# --8<-- [start:chunked]
def chunked_attention(q, k, v, chunk: int, causal: bool = False, recompute: bool = False):
    """The same function, one block of ``chunk`` query rows at a time against all keys."""
    out = torch.empty_like(q)  # (1)!
    block = naive_attention
    if recompute and torch.is_grad_enabled():
        block = partial(checkpoint, naive_attention, use_reentrant=False, preserve_rng_state=False)  # (2)!
    for start in range(0, q.shape[-2], chunk):
        rows = slice(start, start + chunk)
        out[..., rows, :] = block(q[..., rows, :], k, v, causal, start)  # (3)!
    return out
# --8<-- [end:chunked]


# --8<-- [start:sdpa]
@contextlib.contextmanager
def sdpa_backend(name: str, device: torch.device):
    """Pin SDPA to one backend with ``sdpa_kernel``; ``auto`` lets PyTorch choose."""
    if name == "auto":
        yield
        return
    backend = getattr(torch.nn.attention.SDPBackend, PIN[name], None)  # (1)!
    if backend is None or (device.type == "cpu" and name not in ("math", "flash")):
        raise UsageError(f"--sdpa-backend {name}: torch {torch.__version__} has no such backend on "
                         f"{device.type} (CPU offers auto, math and flash)")
    with torch.nn.attention.sdpa_kernel([backend]), warnings.catch_warnings():  # (2)!
        warnings.simplefilter("ignore")  # a backend that declines an input warns, then raises
        try:
            yield
        except torch.cuda.OutOfMemoryError:
            raise
        except RuntimeError as err:
            msg = (str(err).strip().splitlines() or ["no kernel"])[0][:160]
            raise UsageError(f"--sdpa-backend {name} cannot run this input: {msg}") from None


def backend_that_ran(ops: list[str]) -> str:
    """Name the SDPA backend from the aten ops the ledger saw allocate memory."""
    for op in ops:
        if op in FUSED_OPS:
            return FUSED_OPS[op]  # (3)!
    return "MATH"  # (4)!
# --8<-- [end:sdpa]


def attention_fn(impl: str, args):
    return {"naive": lambda q, k, v: naive_attention(q, k, v, args.causal),
            "chunked": lambda q, k, v: chunked_attention(q, k, v, args.chunk, args.causal, args.recompute),
            "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=args.causal)}[impl]


def make_qkv(n: int, args, device, requires_grad: bool = False, seed_offset: int = 0):
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + n + seed_offset)
    shape = (args.batch, args.heads, n, args.head_dim)
    return [torch.randn(shape, generator=g).to(device, DTYPES[args.dtype]).requires_grad_(requires_grad)
            for _ in range(3)]


def reference(n: int, args, device) -> tuple:
    """The same inputs in float64 through the chunked maths: the yardstick every output is held to."""
    q, k, v = [t.double().requires_grad_(args.backward) for t in make_qkv(n, args, device)]
    with torch.enable_grad() if args.backward else torch.no_grad():
        out = chunked_attention(q, k, v, args.chunk, args.causal, recompute=True)
        if args.backward:
            out.backward(make_qkv(n, args, device, seed_offset=7)[0].double())
    return out.detach(), [t.grad for t in (q, k, v)] if args.backward else None


# --8<-- [start:train_step]
def train_step(attend, q, k, v, grad_out, ledger: Ledger):
    """The attention part of a training step: forward, then backward from a given output gradient."""
    with ledger.phase("forward"):
        out = attend(q, k, v)  # (1)!
    with ledger.phase("backward"):
        out.backward(grad_out)  # (2)!
    return out.detach(), [t.grad for t in (q, k, v)]
# --8<-- [end:train_step]


# --8<-- [start:measure]
def measure(impl: str, n: int, args, device: torch.device, ref: tuple | None = None) -> dict:
    """One implementation at one length: peak bytes, bytes kept after forward, backend, error."""
    q, k, v = make_qkv(n, args, device, requires_grad=args.backward)
    grad_out = make_qkv(n, args, device, seed_offset=7)[0] if args.backward else None
    ledger, e = Ledger(device), q.element_size()  # (1)!
    row = {"impl": impl, "seq_len": n, "scores_bytes": args.batch * args.heads * n * n * e}
    reset_peak(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    try:
        with sdpa_backend(args.sdpa_backend if impl == "sdpa" else "auto", device), ledger:
            if args.backward:
                out, grads = train_step(attention_fn(impl, args), q, k, v, grad_out, ledger)
            else:
                with torch.no_grad(), ledger.phase("forward"):
                    out, grads = attention_fn(impl, args)(q, k, v), None
    except torch.cuda.OutOfMemoryError:
        return row | {"oom": True}  # (2)!
    tl = ledger.timeline()
    after_forward = next(s.end for s in tl.spans if s.name == "forward") - 1
    row["backend"] = backend_that_ran([r.op for r in ledger.records]) if impl == "sdpa" else None
    row["peak_bytes"] = ledger.peak(tl)["total"]  # (3)!
    row["kept_bytes"] = tl.device["activations"][after_forward]  # (4)!
    row["predicted_bytes"] = predicted_bytes(impl, n, args, e, row["backend"])
    if device.type == "cuda":
        row["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(device) - base  # (5)!
    return row | errors(out, grads, ref or reference(n, args, device), TOLERANCE[args.dtype])
# --8<-- [end:measure]


# --8<-- [start:formulas]
def predicted_bytes(impl: str, n: int, args, e: int, backend: str | None = None) -> int | None:
    """Derived (not causal): the forward peak, or with --backward the bytes alive after forward."""
    bh, d = args.batch * args.heads, args.head_dim
    out, scores = bh * n * d * e, bh * n * n * e  # the output B.H.N.d and one N x N matrix B.H.N.N
    fused = impl == "sdpa" and backend != "MATH"
    if args.causal or (args.backward and impl == "sdpa" and not fused):
        return None
    if fused:
        return out + bh * n * 4  # (1)!
    if args.backward:
        return out if impl == "chunked" and args.recompute else scores + 2 * out  # (2)!
    if impl == "chunked":
        c = min(args.chunk, n)
        return out + 2 * bh * c * n * e + bh * c * d * e  # (3)!
    return 2 * scores + out  # (4)!
# --8<-- [end:formulas]


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


# --8<-- [start:sweep]
def sweep(args) -> dict:
    device = pick_device(args.device)
    if args.snapshot and device.type != "cuda":
        raise UsageError("--snapshot needs a CUDA device (memory history is a CUDA allocator feature)")
    if args.recompute and not args.backward:
        raise UsageError("--recompute only changes the backward pass: add --backward")
    impls = IMPLS if args.impl == "all" else (args.impl,)
    with sdpa_backend(args.sdpa_backend if "sdpa" in impls else "auto", device):
        pass  # refuses a backend this machine does not have before anything runs
    jobs = [(impl, n) for n in args.seq_lens for impl in impls]
    refs, rows, t0 = {}, [], time.perf_counter()
    with record_snapshot(args.snapshot):
        for impl, n in progress(jobs, total=len(jobs), desc="sweep", quiet=args.json):
            refs = refs if n in refs else {n: reference(n, args, device)}  # one float64 run per length
            rows.append(measure(impl, n, args, device, refs[n]))
    wall = time.perf_counter() - t0
    done = [r for r in rows if not r.get("oom")]

    def slopes(key):  # the exponent p in bytes ~ N^p, per implementation
        return {i: fit_slope([r["seq_len"] for r in done if r["impl"] == i],
                             [r[key] for r in done if r["impl"] == i]) for i in impls}

    bad = [f"{r['impl']} N={r['seq_len']}" for r in done if not r["within_tolerance"]]
    return {"lab": LAB, "device": str(device),
            "config": {k: getattr(args, k) for k in ("impl", "seq_lens", "chunk", "batch", "heads", "head_dim",
                                                     "dtype", "causal", "backward", "recompute", "sdpa_backend")},
            "rows": rows, "slopes": slopes("peak_bytes"), "kept_slopes": slopes("kept_bytes"),
            "sdpa_backend_ran": sorted({r["backend"] for r in done if r["backend"]}),
            "tolerance": TOLERANCE[args.dtype], "outside_tolerance": bad,
            "cuda": allocator_stats(device), "provenance": provenance.collect(LAB, device, wall)}
# --8<-- [end:sweep]


def main(argv=None) -> None:
    args = parse_args(argv)
    result = sweep(args)
    if args.json:
        emit_json(result)
        return
    c, fb = result["config"], format_bytes
    print(f"Lab 05 on {result['device']}: batch {c['batch']}, {c['heads']} heads, head dim {c['head_dim']}, "
          f"{c['dtype']}, {'causal' if c['causal'] else 'not causal'}, chunk {c['chunk']}, " + (
              ("forward + backward" + (", chunked recomputes" if c["recompute"] else "")) if c["backward"]
              else "forward only (no grad)"))
    print(f"\n| impl | N | peak | kept after forward | derived {'kept' if c['backward'] else 'peak'} | "
          "N x N scores | max abs error | backend |\n|---|---:|---:|---:|---:|---:|---:|---|")
    for r in result["rows"]:
        if r.get("oom"):
            print(f"| {r['impl']} | {r['seq_len']} | out of memory | | | {fb(r['scores_bytes'])} | | |")
            continue
        err = f"{r['max_abs_error']:.1e}" + (f", grad {r['grad_max_abs_error']:.1e}" if c["backward"] else "")
        derived = "-" if r["predicted_bytes"] is None else fb(r["predicted_bytes"])
        print(f"| {r['impl']} | {r['seq_len']} | {fb(r['peak_bytes'])} | {fb(r['kept_bytes'])} | {derived} | "
              f"{fb(r['scores_bytes'])} | {err} | {r['backend'] or '-'} |")
    print("\nFitted slope of log(bytes) against log(N) (2 = quadratic, 1 = linear):")
    for impl, s in result["slopes"].items():
        kept = result["kept_slopes"][impl] if c["backward"] else None
        print(f"  {impl:8s} peak {'n/a' if s is None else f'{s:.2f}'}"
              + ("" if kept is None else f"   kept for backward {kept:.2f}"))
    if result["sdpa_backend_ran"]:
        print(f"SDPA ran the {', '.join(result['sdpa_backend_ran'])} backend (named from the aten op that "
              f"allocated its output; --sdpa-backend {c['sdpa_backend']}).")
    bad, tol = result["outside_tolerance"], result["tolerance"]
    print(f"Every output within tolerance of float64: |error| <= {tol:.0e} x max(1, max |value|)." if not bad
          else f"OUTSIDE the {tol:.0e} tolerance: {', '.join(bad)}")
    if result["cuda"]:
        print(f"CUDA allocator: max allocated {fb(result['cuda']['max_memory_allocated'])} in the sweep")
    if args.snapshot:
        print(f"memory history written to {args.snapshot} (open it at https://pytorch.org/memory_viz)")


if __name__ == "__main__":
    run_lab(main)
