"""Real scale on a laptop: run a lab's own step at real size on fake tensors, and count it.

A *fake tensor* (``torch._subclasses.fake_tensor.FakeTensor``) has a shape, a dtype, a device and a
storage of the right size, but no data: every aten op computes what its outputs would be (their
sizes, strides, dtypes, aliasing) and allocates nothing. A whole Llama-3-8B training step runs this
way in seconds and a few hundred MB of RAM. The :class:`labkit.ledger.Ledger` sees fake storages
born and freed exactly where real ones would be (the op sequence, the autograd graph, what backward
saves and frees are all the same code), so its timeline of a fake step is the timeline of the real
step. A test holds this to the byte on CPU: TinyGPT and a small Llama, fake against real, every
category at every phase peak.

How a lab uses it (nothing in the lab's own code changes)::

    with fake.tensors():                                  # real tensors are never created from here
        model = fake.materialize(lambda: Llama(cfg), dtype=torch.bfloat16)   # meta, then to_empty
        ledger = Ledger("cpu").track_module(model)       # the same ledger as on real tensors
        with ledger:
            step(model, batch)                            # the lab's own step, unchanged
    ledger.timeline().peaks_by_phase()

What the trace follows, said plainly (this PyTorch is a CPU build; a fake CUDA tensor cannot be
dispatched in it, so the fake tensors live on ``cpu`` and each op takes its CPU path):

* **Allocator rounding**: ``tensors(block=512)`` rounds every storage up to the CUDA caching
  allocator's 512-byte blocks, as the ledger does on a real GPU; ``block=None`` counts exact bytes.
* **Autocast**: the trace runs ``torch.autocast("cpu", ...)``. CPU and CUDA autocast keep different
  op lists; :data:`CUDA_AUTOCAST_LOWER` and :data:`CUDA_AUTOCAST_FP32` hold CUDA's lists and
  :func:`autocast_audit` lists the calls of a traced step whose dtype CUDA would change (none, for the zoo's models:
  tested), so a reader knows where CPU dispatch would not match CUDA's.
* **Attention**: ``F.scaled_dot_product_attention`` takes the CPU flash kernel, which saves the
  output and a float32 log-sum-exp per query row for backward, as CUDA's flash kernel does; CUDA's
  also keeps two 8-byte RNG tensors (seed, offset) and its memory-efficient kernel pads the
  log-sum-exp to 32 rows. Those bytes (under 1 KiB per layer) are not in the trace.
* **Optimizers**: ``torch.optim`` picks its implementation from the tensor type, and a fake tensor
  is not a plain ``Tensor``, so under fake tensors an optimizer left to its default runs the
  for-loop implementation. On CUDA the default is ``foreach``. Pass ``foreach=True`` or
  ``fused=True`` explicitly (:func:`cuda_default_optimizer_kwargs`) to trace what CUDA would run.

The GPU issue runs the same configurations for real at sizes that fit a card and records traced
peak against ``torch.cuda.max_memory_allocated``.

Fake tensors are internal to PyTorch (``torch._subclasses``). They exist and behave the same in
2.11 and 2.13 (the versions this project runs); :func:`require` turns their absence into one
clear line.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn

#: The CUDA caching allocator hands out multiples of 512 bytes (labkit.ledger.CUDA_BLOCK).
CUDA_BLOCK = 512


class FakeUnavailable(RuntimeError):
    """This PyTorch lacks the fake-tensor internals a trace needs."""


def require():
    """``FakeTensorMode`` and ``FakeTensor`` from this PyTorch, or :class:`FakeUnavailable`."""
    try:
        from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    except ImportError as exc:  # pragma: no cover - every supported version has them
        raise FakeUnavailable(
            f"torch {torch.__version__} has no torch._subclasses.fake_tensor ({exc}); "
            "fake-tensor traces need torch 2.11 or newer") from exc
    return FakeTensorMode, FakeTensor


@dataclass
class FakeContext:
    """The fake mode a trace runs under, and how its storages are counted."""

    mode: object  # a FakeTensorMode
    block: int | None  # round storages up to this many bytes (None: exact)


_active: list[FakeContext] = []


def active() -> FakeContext | None:
    """The innermost :func:`tensors` block in force, or None (a ledger asks this when entered)."""
    return _active[-1] if _active else None


@contextlib.contextmanager
def tensors(block: int | None = CUDA_BLOCK) -> Iterator[FakeContext]:
    """Inside this block every tensor is fake: shapes, dtypes and storages, no data.

    ``block``: the allocator granularity a :class:`~labkit.ledger.Ledger` entered inside rounds
    every storage up to (512, the CUDA caching allocator's, by default; ``None`` counts exact bytes,
    as on a CPU run).
    """
    FakeTensorMode, _ = require()
    if block is not None and block <= 0:
        raise ValueError(f"block must be positive or None, got {block}")
    # Tensors made before the block (a meta model, a constant) may flow in; they are converted.
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    ctx = FakeContext(mode=mode, block=block)
    _active.append(ctx)
    try:
        with mode:
            yield ctx
    finally:
        _active.remove(ctx)


def is_fake(t: torch.Tensor) -> bool:
    """True for a fake tensor (of any fake mode)."""
    _, FakeTensor = require()
    return isinstance(t, FakeTensor)


def materialize(build: Callable[[], nn.Module], device: str | torch.device = "cpu",
                dtype: torch.dtype | None = None) -> nn.Module:
    """Build a module on the meta device (instant at any size), then give it fake storage.

    ``build``: a function that constructs the module (its constructor runs under
    ``torch.device("meta")``, so no weight is initialised). ``device``: where its fake storages
    live. ``dtype``: cast the floating-point parameters and buffers first (as ``module.to(dtype)``
    would). Inside :func:`tensors` the result holds fake tensors; outside, real uninitialised ones
    (what ``to_empty`` gives), so the same call builds the real twin of a traced model.
    """
    with outside(), torch.device("meta"):  # meta, not fake-of-meta: to_empty swaps it for fake
        module = build()
        if dtype is not None:
            module = module.to(dtype)
    shared = _shared_parameters(module)
    module = module.to_empty(device=device)
    for owners in shared:  # to_empty gives every owner of a tied weight its own copy: tie them again
        first, name = owners[0]
        for owner, other in owners[1:]:
            setattr(owner, other, getattr(first, name))
    return module


def _shared_parameters(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Each parameter held by more than one (module, name): tied embeddings, for instance."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in module.modules():
        for name, p in sub._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((sub, name))
    return [group for group in owners.values() if len(group) > 1]


def outside():
    """Step out of the fake mode for a block: what it makes is real (a no-op outside the mode). Guarded
    for torch versions that lack ``unset_fake_temporarily``."""
    if active() is None:
        return contextlib.nullcontext()
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
    except ImportError as exc:  # pragma: no cover - 2.11 and 2.13 both have it
        raise FakeUnavailable(f"torch {torch.__version__} lacks unset_fake_temporarily ({exc})") from exc
    return unset_fake_temporarily()


def cuda_default_optimizer_kwargs(name: str) -> dict:
    """The implementation CUDA picks by default for ``torch.optim.<name>``, made explicit.

    AdamW, Adam and SGD default to ``foreach`` on CUDA when every tensor is a plain CUDA tensor
    (``torch/optim/optimizer.py: _default_to_fused_or_foreach``); a fake tensor is not, so a trace
    must ask for it.
    """
    if name.lower() in ("adamw", "adam", "sgd", "adagrad", "rmsprop"):
        return {"foreach": True}
    return {}


# ----------------------------------------------------------------------------- autocast, CPU vs CUDA
# CUDA autocast's op lists, from the table "CUDA Ops that can autocast to float16 / to float32" of
# https://docs.pytorch.org/docs/2.13/amp.html (the same in 2.11). The CPU lists are shorter; rather
# than keep a second table, the audit runs each listed call and looks at what CPU autocast gave.
CUDA_AUTOCAST_LOWER = frozenset((
    "__matmul__", "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm", "chain_matmul", "multi_dot",
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "gru_cell",
    "linear", "lstm_cell", "matmul", "mm", "mv", "prelu", "rnn_tanh_cell", "rnn_relu_cell",
    "scaled_dot_product_attention"))
CUDA_AUTOCAST_FP32 = frozenset((
    "__pow__", "__rdiv__", "__rpow__", "__rtruediv__", "acos", "asin", "binary_cross_entropy_with_logits",
    "cosh", "cosine_embedding_loss", "cdist", "cosine_similarity", "cross_entropy", "cumprod", "cumsum",
    "dist", "erfinv", "exp", "expm1", "group_norm", "hinge_embedding_loss", "kl_div", "l1_loss",
    "layer_norm", "log", "log_softmax", "log10", "log1p", "log2", "margin_ranking_loss", "mse_loss",
    "multilabel_margin_loss", "multi_margin_loss", "nll_loss", "norm", "normalize", "pdist",
    "poisson_nll_loss", "pow", "prod", "reciprocal", "rsqrt", "sinh", "smooth_l1_loss",
    "soft_margin_loss", "softmax", "softmin", "softplus", "sum", "renorm", "tan", "triplet_margin_loss"))
_LOW = (torch.bfloat16, torch.float16)


class _AutocastAudit(torch.overrides.TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.differs: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if torch.is_autocast_enabled("cpu") and (name in CUDA_AUTOCAST_LOWER or name in CUDA_AUTOCAST_FP32):
            flat_in, _ = torch.utils._pytree.tree_flatten((args, kwargs or {}))
            flat_out, _ = torch.utils._pytree.tree_flatten(out)
            floats = [t for t in flat_in if isinstance(t, torch.Tensor) and t.is_floating_point()]
            cuda_dtype = (torch.get_autocast_dtype("cpu") if name in CUDA_AUTOCAST_LOWER else torch.float32)
            got = [t.dtype for t in flat_out if isinstance(t, torch.Tensor) and t.is_floating_point()]
            if floats and got and any(d != cuda_dtype for d in got):
                self.differs[name] = self.differs.get(name, 0) + 1
        return out


@contextlib.contextmanager
def autocast_audit() -> Iterator[dict[str, int]]:
    """Count, by name, the calls made under CPU autocast whose output dtype CUDA autocast would change.

    For every call on CUDA's lists made while CPU autocast is on, the dtype CPU autocast gave is
    compared with CUDA's rule (the autocast dtype for the lower-precision list, float32 for the
    float32 list). The dict it yields fills in as the block runs; empty means the traced step holds
    the tensors a CUDA run would hold, dtype for dtype.
    """
    audit = _AutocastAudit()
    with audit:
        yield audit.differs
