"""Lab 05 - memory-efficient attention: the s x s score matrix, and three ways to hold it.

softmax(Q K^T / sqrt(d_head)) V, written as it reads, materialises one score per (query, key) pair:
b x a x s x s elements (micro-batch b, heads a, sequence length s: the handbook's notation).
Three implementations, measured by the memory ledger (labkit):

    naive    the whole score matrix and its softmax at once                 O(s^2) bytes
    chunked  one block of query rows at a time against all the keys         O(s) for a fixed block
    sdpa     F.scaled_dot_product_attention; the ledger names the backend that ran

Every query row still sees every key, so the softmax of each row and the output are unchanged.
--backward measures forward + backward: chunking alone then keeps s x s probabilities for backward
again, unless each block is recomputed (--recompute), as the fused kernels do.

With ``--kv-heads`` k and v have fewer heads than q (grouped-query attention); ``--model`` takes a
zoo model's attention shape and ``--fake`` traces the sweep on fake tensors (bytes, no values).

Run it: the commands are in this folder's README.md (and on the lab's page).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from attention_measures import TOLERANCE, TRACED, errors, fit_slope, report

from labkit import budget, cli, labs, marks, provenance
from labkit.config import MAX_BATCH, MAX_HEADS, MAX_TOKENS, MAX_WIDTH, LabConfig, UsageError, option
from labkit.cuda import allocator_stats, record_snapshot, reset_peak
from labkit.ledger import Ledger
from labkit.scale import RealScale


# --8<-- [start:naive]
def naive_attention(q, k, v, causal: bool = False, q_offset: int = 0):
    """softmax(q k^T / sqrt(d_head)) v, materialising every score. q: (b, a, s_q, d_head); k, v:
    (b, a_kv, s, d_head), a_kv dividing a; ``causal`` hides the keys after each query, whose
    positions start at ``q_offset``."""
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])  # (1)!
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)  # (2)!
    if causal:
        rows = torch.arange(q.shape[-2], device=q.device)[:, None] + q_offset
        scores.masked_fill_(torch.arange(k.shape[-2], device=q.device) > rows, float("-inf"))  # (3)!
    probs = scores.softmax(dim=-1)  # (4)!
    return probs @ v  # (5)!


def repeat_kv(t, heads: int):
    """Grouped-query attention: k or v (b, a_kv, s, d_head), each head repeated for the a / a_kv
    query heads it serves; a copy, as Hugging Face's eager attention makes (``repeat_kv``)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)
# --8<-- [end:naive]


# --8<-- [start:chunked]
def chunked_attention(q, k, v, chunk: int, causal: bool = False, recompute: bool = False):
    """The same function, one block of ``chunk`` query rows at a time against all keys; ``causal``
    as above; ``recompute``: each block recomputes its probabilities in backward instead of keeping them."""
    out = torch.empty_like(q)  # (1)!
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])  # once for every block
    block = naive_attention
    if recompute and torch.is_grad_enabled():
        block = partial(checkpoint, naive_attention, use_reentrant=False, preserve_rng_state=False)  # (2)!
    for start in range(0, q.shape[-2], chunk):
        rows = slice(start, start + chunk)
        out[..., rows, :] = block(q[..., rows, :], k, v, causal, start)  # (3)!
    return out
# --8<-- [end:chunked]


# The aten op each fused SDPA backend runs (same names in torch 2.11 and 2.13); MATH is bmm + softmax.
FUSED_OPS = {f"_scaled_dot_product_{op}": name for op, name in [
    ("flash_attention_for_cpu", "FLASH_ATTENTION"), ("flash_attention", "FLASH_ATTENTION"),
    ("efficient_attention", "EFFICIENT_ATTENTION"), ("cudnn_attention", "CUDNN_ATTENTION"),
    ("fused_attention_overrideable", "OVERRIDEABLE")]}
PIN = {"math": "MATH", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION"}


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


# --8<-- [start:train_step]
def train_step(attend, q, k, v, grad_out):
    """The attention part of a training step: ``attend(q, k, v)`` forward, then backward from the
    output gradient ``grad_out``. Returns the output and the gradients of q, k and v."""
    with marks.phase("forward"):
        out = attend(q, k, v)  # (1)!
    with marks.phase("backward"):
        out.backward(grad_out)  # (2)!
    return out.detach(), [t.grad for t in (q, k, v)]


def inference(attend, q, k, v):
    """Forward alone, without autograd: nothing is kept for a backward."""
    with torch.no_grad(), marks.phase("forward"):
        return attend(q, k, v)
# --8<-- [end:train_step]


# --8<-- [start:formulas]
def score_matrix_bytes(s: int, batch: int, heads: int, e: int) -> int:
    """One s x s matrix per head, b.a.s.s elements of e bytes: the scores, or the probabilities."""
    return batch * heads * s * s * e


def predicted_bytes(impl: str, s: int, *, batch: int, heads: int, head_dim: int, e: int, chunk: int,
                    backward: bool = False, recompute: bool = False, causal: bool = False,
                    backend: str | None = None, kv_heads: int | None = None) -> int | None:
    """Derived bytes of ``impl`` at length ``s`` (None where no formula is given: causal masks, and
    the math backend with backward): the forward peak, or with ``backward`` the bytes alive after
    forward. ``batch``, ``heads``, ``head_dim``: the shape of q; ``e``: bytes per element;
    ``chunk``: query rows per block; ``recompute``: chunked recomputes each block in backward;
    ``backend``: the SDPA backend that ran; ``kv_heads``: k and v's heads, when fewer than q's
    (grouped-query attention: the unfused paths repeat k and v to every query head, two copies of
    the output's size, alive to the end and kept for backward)."""
    ba, out = batch * heads, batch * heads * s * head_dim * e  # the output, b.a.s.d_head
    scores = score_matrix_bytes(s, batch, heads, e)
    fused = impl == "sdpa" and backend != "MATH"
    kv = 2 * out if kv_heads not in (None, heads) and not fused else 0
    if causal or (backward and impl == "sdpa" and not fused):
        return None
    if fused:
        return out + ba * s * 4  # (1)!
    if backward:
        return kv + (out if impl == "chunked" and recompute else scores + 2 * out)  # (2)!
    if impl == "chunked":
        c = min(chunk, s)
        return kv + out + 2 * ba * c * s * e + ba * c * head_dim * e  # (3)!
    return kv + 2 * scores + out  # (4)!
# --8<-- [end:formulas]


IMPLS = ("naive", "chunked", "sdpa")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the fitted slopes tests/test_lab05.py holds a CPU sweep to (2 = quadratic, 1 = linear)


@dataclass
class Config(RealScale, LabConfig):
    """Naive, query-chunked and fused (SDPA) attention: peak bytes against sequence length."""

    FAMILIES = (*RealScale.FAMILIES, "flux")  # only the attention's shape is read: a Flux block's works too

    impl: Literal["naive", "chunked", "sdpa", "all"] = option("all", "which implementation to measure")
    seq_lens: tuple[int, ...] = option((128, 256, 512, 1024, 2048), "sequence lengths s to sweep",
                                       min=1, max=MAX_TOKENS, metavar="S,S,...")
    chunk: int = option(128, "query rows per block (chunked)", min=1, max=MAX_TOKENS)
    batch: int = option(1, "sequences per batch", min=1, max=MAX_BATCH)
    heads: int = option(2, "attention heads (query heads)", min=1, max=MAX_HEADS)
    kv_heads: int | None = option(None, "key/value heads dividing --heads (GQA; default: --heads)", min=1, max=MAX_HEADS)
    head_dim: int = option(32, "dimension of each head", min=1, max=MAX_WIDTH)
    dtype: Literal["float32", "bfloat16", "float16"] = option("float32", "element type of q, k and v")
    causal: bool = option(False, "mask future keys (default: full attention)")
    backward: bool = option(False, "measure forward + backward, not forward alone")
    recompute: bool = option(False, "chunked: recompute each block in backward (with --backward)")
    sdpa_backend: Literal["auto", "math", "flash", "efficient", "cudnn"] = option(
        "auto", "pin SDPA to one backend with torch.nn.attention.sdpa_kernel (auto: let PyTorch choose)")
    snapshot: Path | None = option(None, "CUDA only: write a memory_viz history pickle here", path="write")

    def __post_init__(self) -> None:
        super().__post_init__()
        self.seq_lens = tuple(sorted(set(self.seq_lens)))
        if self.recompute and not self.backward:
            raise UsageError("--recompute only changes the backward pass: add --backward")
        spec = self.model_spec()
        if spec is not None:  # --model: its attention's shape replaces --heads, --kv-heads and --head-dim
            self.heads, self.kv_heads, self.head_dim = spec.heads, spec.kv_heads, spec.head_dim
        if self.heads % self.key_value_heads:
            raise UsageError(f"--heads {self.heads} is not a multiple of --kv-heads {self.kv_heads}")

    @property
    def key_value_heads(self) -> int:
        """a_kv: ``--kv-heads``, or one per query head."""
        return self.kv_heads or self.heads


# --8<-- [start:run]
def run(config: Config) -> Result:
    device = cli.pick_device(config.device)
    if config.snapshot and device.type != "cuda":
        raise UsageError("--snapshot needs a CUDA device (memory history is a CUDA allocator feature)")
    impls = IMPLS if config.impl == "all" else (config.impl,)
    s, e = max(config.seq_lens), torch.finfo(DTYPES[config.dtype]).bits // 8  # too big for the machine: refused
    if not config.fake:  # a trace allocates nothing
        budget.require(4 * config.batch * config.heads * s * config.head_dim * e + ("naive" in impls) * score_matrix_bytes(
            s, batch=config.batch, heads=config.heads, e=e), device, f"q, k, v and the output at s = {s:,}"
            + (" and one s x s matrix per head (naive)" if "naive" in impls else ""))
    with sdpa_backend(config.sdpa_backend if "sdpa" in impls else "auto", device):
        pass  # refuses a backend this machine does not have before anything runs
    jobs = [(impl, s) for s in config.seq_lens for impl in impls]
    rows, timelines, refs, t0 = [], {}, {}, time.perf_counter()
    with config.tensors(), record_snapshot(config.snapshot):  # --fake: every tensor from here on is fake
        for impl, s in cli.progress(jobs, total=len(jobs), desc="sweep"):
            if s not in refs:  # one float64 run per length; a trace has no values to compare
                refs = {s: None if config.fake else reference(s, config, device)}
            row, timelines[impl, s] = measure(impl, s, config, device, refs[s])
            rows.append(row)
    return Result(config, device, impls, rows, timelines, time.perf_counter() - t0, allocator_stats(device))
# --8<-- [end:run]


# ---------------------------------------------------------------------- one measurement
def attention_fn(impl: str, chunk: int, causal: bool, recompute: bool):
    """Implementation ``impl`` as a function of (q, k, v), with ``chunk``, ``causal`` and ``recompute`` bound."""
    return {"naive": lambda q, k, v: naive_attention(q, k, v, causal),
            "chunked": lambda q, k, v: chunked_attention(q, k, v, chunk, causal, recompute),
            "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                   enable_gqa=k.shape[1] != q.shape[1])}[impl]


def make_qkv(s: int, config: Config, device, requires_grad: bool = False, seed_offset: int = 0):
    """q, k and v of length ``s`` in the shape and dtype of ``config``, on ``device``: the same for
    every implementation (drawn from ``config.seed``, ``s`` and ``seed_offset``)."""
    g = torch.Generator().manual_seed(config.seed * 1_000_003 + s + seed_offset)
    return [torch.randn(config.batch, heads, s, config.head_dim, generator=g).to(device, DTYPES[config.dtype])
            .requires_grad_(requires_grad) for heads in (config.heads, config.key_value_heads, config.key_value_heads)]


def reference(s: int, config: Config, device) -> tuple:
    """The same inputs in float64 through the chunked maths: the yardstick every output is held to."""
    q, k, v = [t.double().requires_grad_(config.backward) for t in make_qkv(s, config, device)]
    with torch.enable_grad() if config.backward else torch.no_grad():
        out = chunked_attention(q, k, v, config.chunk, config.causal, recompute=True)
        if config.backward:
            out.backward(make_qkv(s, config, device, seed_offset=7)[0].double())
    return out.detach(), [t.grad for t in (q, k, v)] if config.backward else None


# --8<-- [start:measure]
def measure(impl: str, s: int, config: Config, device: torch.device, ref: tuple):
    """One implementation at one length: its row (peak bytes, bytes kept after forward, backend,
    error against ``ref``, the float64 :func:`reference`) and the ledger's timeline."""
    q, k, v = make_qkv(s, config, device, requires_grad=config.backward)
    grad_out = make_qkv(s, config, device, seed_offset=7)[0] if config.backward else None
    attend = attention_fn(impl, config.chunk, config.causal, config.recompute)
    ledger, e = Ledger(device), q.element_size()  # (1)!
    row = {"impl": impl, "seq_len": s, "scores_bytes": score_matrix_bytes(s, config.batch, config.heads, e)}
    reset_peak(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    try:
        with sdpa_backend(config.sdpa_backend if impl == "sdpa" else "auto", device), ledger:
            if config.backward:
                out, grads = train_step(attend, q, k, v, grad_out)
            else:
                out, grads = inference(attend, q, k, v), None
    except torch.cuda.OutOfMemoryError:
        return row | {"oom": True}, None  # (2)!
    tl = ledger.timeline()
    after_forward = next(span.end for span in tl.spans if span.name == "forward") - 1
    row["backend"] = backend_that_ran([r.op for r in ledger.records]) if impl == "sdpa" else None
    row["peak_bytes"] = tl.peak()["total"]  # (3)!
    row["kept_bytes"] = tl.device["activations"][after_forward]  # (4)!
    row["predicted_bytes"] = predicted_bytes(
        impl, s, batch=config.batch, heads=config.heads, head_dim=config.head_dim, e=e, chunk=config.chunk,
        backward=config.backward, recompute=config.recompute, causal=config.causal, backend=row["backend"],
        kv_heads=config.key_value_heads)
    if device.type == "cuda":
        row["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(device) - base  # (5)!
    return row | (errors(out, grads, ref, TOLERANCE[config.dtype]) if ref is not None else {}), tl
# --8<-- [end:measure]


# ---------------------------------------------------------------------- the result and its report
@dataclass
class Result:
    config: Config
    device: torch.device
    impls: tuple[str, ...]
    rows: list[dict]  # one per (implementation, length), in sweep order
    timelines: dict  # (impl, s) -> the ledger's Timeline of that measurement (None: out of memory)
    wall_time_s: float
    cuda: dict | None

    def slopes(self, key: str = "peak_bytes") -> dict[str, float | None]:
        """The exponent p in bytes ~ s^p, per implementation (``key``: peak_bytes or kept_bytes)."""
        done = [r for r in self.rows if not r.get("oom")]
        return {i: fit_slope([r["seq_len"] for r in done if r["impl"] == i],
                             [r[key] for r in done if r["impl"] == i]) for i in self.impls}

    @property
    def backends_ran(self) -> list[str]:
        return sorted({r["backend"] for r in self.rows if r.get("backend")})

    @property
    def outside_tolerance(self) -> list[str]:
        return [f"{r['impl']} s={r['seq_len']}" for r in self.rows if r.get("within_tolerance") is False]

    def summary(self) -> dict:
        c = self.config
        return {"lab": labs.slug(__file__), "device": str(self.device), "model": c.model,
                "traced": TRACED if c.fake else None,
                "config": {k: list(getattr(c, k)) if k == "seq_lens" else getattr(c, k) for k in (
                    "impl", "seq_lens", "chunk", "batch", "heads", "kv_heads", "head_dim", "dtype", "causal",
                    "backward", "recompute", "sdpa_backend")},
                "rows": self.rows, "slopes": self.slopes(), "kept_slopes": self.slopes("kept_bytes"),
                "sdpa_backend_ran": self.backends_ran, "tolerance": TOLERANCE[c.dtype],
                "outside_tolerance": self.outside_tolerance, "cuda": self.cuda,
                "provenance": provenance.collect(__file__, self.device, self.wall_time_s)}


if __name__ == "__main__":
    cli.main(Config, run, report)
