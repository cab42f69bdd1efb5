"""What a training lab needs around its unchanged step to run a real model (``--model``) on fake tensors (``--fake``).

Lab 02's step, Lab 03's recipes and Lab 06's accumulation loop run as they are; only the harness
around them changes at real size. Labs 03 and 06 use this file too (``labs.load(2, "scale_harness")``).

* :func:`build_model`: the lab's TinyGPT or the zoo's model, real or fake.
* :func:`token_source`: ``SyntheticTokens`` for TinyGPT, :class:`labkit.models.RandomTokens` for a
  zoo model (SyntheticTokens' table is 4.2 GB of int64 at Llama 3's vocabulary and 4,096 positions).
* :func:`values_read_as_zero`: a fake tensor has no value, so ``loss.item()`` in a lesson's step
  would raise; inside this block such a read gives 0 (a step that reads a value, such as
  GradScaler's inf check, takes the path of a normal step). A traced run reports no loss.
* :func:`adamw_options`: which AdamW implementation runs. PyTorch picks ``foreach`` on CUDA and the
  for-loop on CPU, and under fake tensors it would pick the for-loop; a traced run asks for CUDA's.
* :func:`require_memory`: the RAM floor a real run checks first (a fake run allocates nothing).
* :func:`peaks_by_step_and_phase`: the peak of each phase of each step, so step 0 (no AdamW state
  yet) and step 1 sit side by side; :func:`peak_phase`: where the run peaks.
"""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException

from labkit import budget, fake
from labkit.models import RandomTokens, SyntheticTokens, gpt_param_count
from labkit.timeline import Timeline

#: What every traced figure is, said once.
TRACED = "traced on fake tensors: bytes, no values, no time"


def build_model(config, tiny, device, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """``config.build_model(tiny, dtype)`` (the lab's TinyGPT, or the zoo model ``--model`` names) on
    ``device``, its floating-point weights in ``dtype`` (None: float32); a traced model stays where
    :func:`labkit.fake.materialize` put it (fake, on the CPU)."""
    model = config.build_model(tiny, dtype)
    if config.fake:
        return model
    return model.to(device) if dtype is None else model.to(device, dtype)  # (labkit's build_model casts a zoo model only)


def token_source(config, model_config):
    """The lab's ``SyntheticTokens`` for its TinyGPT (``--model tiny``), :class:`RandomTokens` for a zoo model."""
    spec = config.model_spec()
    if spec is None:
        return SyntheticTokens(model_config.vocab, model_config.seq_len, seed=config.seed)
    return RandomTokens(spec.vocab, config.seq_len, seed=config.seed)


class _ZeroValues(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        try:
            return func(*args, **(kwargs or {}))
        except DataDependentOutputException:  # a value read from a fake tensor: item, float, int, bool
            kind = {"__float__": float, "__int__": int, "__index__": int, "__bool__": bool}.get(func.__name__)
            tensor = args[0]
            return (kind or (float if tensor.is_floating_point() else bool if tensor.dtype == torch.bool else int))(0)


def values_read_as_zero(traced: bool) -> contextlib.AbstractContextManager:
    """With ``traced``, a value read from a fake tensor is 0 instead of an error (the lesson's code is
    unchanged); a constant the fake mode still knows (AdamW's step counter) reads as itself."""
    return _ZeroValues() if traced else contextlib.nullcontext()


ADAMW = {"foreach": {"foreach": True}, "for-loop": {"foreach": False}, "fused": {"fused": True}}


def adamw_options(impl: str, traced: bool) -> dict:
    """``torch.optim.AdamW`` keyword arguments for ``impl`` (``auto``: PyTorch's choice for the device,
    made explicit as CUDA's, ``foreach``, when ``traced``)."""
    if impl == "auto":
        return fake.cuda_default_optimizer_kwargs("adamw") if traced else {}
    return dict(ADAMW[impl])


def require_memory(config, model_config, batch: int, device, weights: torch.dtype | None = None) -> None:
    """Refuse a real run the machine cannot hold; a ``--fake`` run allocates nothing and passes.

    The floor: the weights and AdamW's two moments, in the weights' dtype (``weights``, float32 when
    None: 12 B per parameter), and one logit per token and vocabulary entry of a batch, in that dtype."""
    if config.fake:
        return
    spec, size = config.model_spec(), (weights or torch.float32).itemsize
    if spec is None and size == 4:
        budget.require_gpt_training(model_config, batch, device)
        return
    params, vocab, name = ((gpt_param_count(model_config), model_config.vocab, "TinyGPT") if spec is None
                           else (spec.param_count(), spec.vocab, spec.name))
    budget.require(3 * size * params + size * batch * config.seq_len * vocab, device,
                   f"{3 * size} B x {params:,} parameters of {name} + {size} B x {batch} x {config.seq_len} tokens x "
                   f"{vocab:,} logits")


def peaks_by_step_and_phase(tl: Timeline, phases=("forward", "backward", "optimizer")) -> dict[str, dict[str, int]]:
    """``"step S phase"`` -> device bytes by category at that phase's highest moment in step S
    (as :meth:`Timeline.peaks_by_phase`, which merges the steps: a phase also sees the row it was entered in)."""
    total, best = tl.device_total(), {}
    for span in tl.spans:
        key = f"step {span.step} {span.name}"
        for i in range(max(span.start - 1, 0), min(span.end, len(total))) if span.name in phases else ():
            if key not in best or total[i] > total[best[key]]:
                best[key] = i
    return {key: tl.row(i) for key, i in best.items()}


def peak_phase(tl: Timeline) -> str:
    """The phase (and step) the run's highest row belongs to, e.g. ``"step 1 optimizer"``."""
    total = tl.device_total()
    i = max(range(len(total)), key=total.__getitem__)
    return f"step {tl.step[i]} {tl.phase[i]}"
