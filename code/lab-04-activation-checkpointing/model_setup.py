"""Lab 04 - the TinyGPT and the batch that Labs 04 and 09 measure, and how they compare steps.

``ModelShape`` holds the flags of the model and the batch (each lab's ``Config`` adds its own);
``build`` makes the model and the batch from it, seeded, so both labs measure the same set-up;
``build_for`` does the same for Lab 04's ``--model``, ``--fake`` and ``--dtype``;
``grads_of`` and ``grads_equal`` compare gradients bit for bit; ``time_steps`` times steps
interleaved. None of it is the lesson: ``checkpointing.py`` is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from labkit import budget, cli
from labkit.config import MAX_BATCH, MAX_LAYERS, LabConfig, option
from labkit.models import SyntheticTokens, TinyGPT, TinyGPTShape, gpt_param_count
from labkit.scale import TINY

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class ModelShape(TinyGPTShape, LabConfig):
    """The TinyGPT and the batch that Labs 04 and 09 measure (:func:`build`)."""

    layers: int = option(4, "transformer blocks", min=1, max=MAX_LAYERS)
    batch_size: int = option(4, "sequences per step", min=1, max=MAX_BATCH)
    dropout: float = option(0.1, "dropout probability", min=0, below=1)
    snapshot: Path | None = option(None, "CUDA only: write a memory_viz history pickle here", path="write")


def build(shape: ModelShape, device):
    """``(model, x, y)``: the TinyGPT of ``shape`` in train mode on ``device``, seeded with its seed,
    and batch 0 of ``SyntheticTokens``. Lab 09 builds the same."""
    budget.require_gpt_training(shape.model_config(), shape.batch_size, device)  # too big for the machine: refused
    torch.manual_seed(shape.seed)
    model = TinyGPT(shape.model_config()).to(device).train()
    x, y = SyntheticTokens(shape.vocab, shape.seq_len, seed=shape.seed).batch(0, shape.batch_size, device)
    return model, x, y


def build_for(config, device):
    """``(model, x, y)`` for a Lab 04 ``config``: :func:`build` for the lab's own run (TinyGPT in
    float32 on real tensors); otherwise ``config.build_model`` (the zoo model of ``--model``, or the
    TinyGPT, in ``--dtype``; fake under ``--fake``) and random token ids of its vocabulary, one
    (B, T + 1) tensor whose two views are the inputs and the targets, as ``SyntheticTokens`` gives
    them: a byte count needs no learnable data, and a trace has no values anyway."""
    if config.model == TINY and not config.fake and config.dtype == "float32":
        return build(config, device)
    dtype, spec = DTYPES[config.dtype], config.model_spec()
    if not config.fake:  # a trace allocates nothing; a real run must fit its weights and gradients
        n = spec.param_count() if spec else gpt_param_count(config.model_config())
        budget.require(2 * dtype.itemsize * n, device, f"weights and gradients, 2 x {dtype.itemsize} B x {n:,} parameters")
    torch.manual_seed(config.seed)
    model = config.build_model(partial(TinyGPT, config.model_config()), dtype)  # fake: on the CPU, in dtype
    model = (model if config.fake else model.to(device, dtype)).train()
    ids = torch.randint((spec or config).vocab, (config.batch_size, config.seq_len + 1), device=device)
    return model, ids[:, :-1], ids[:, 1:]


def time_steps(step_of: dict, steps: int) -> dict[str, list[float]]:
    """Seconds per call of each ``step_of[name]()`` (a step that waits for the device, as ``.item()``
    does), ``steps`` times after one warm-up each, the names interleaved so that drift hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in step_of}
    for step in step_of.values():
        step()  # warm-up (allocator, kernels, caches)
    for _ in cli.progress(range(steps), total=steps, desc="timing"):
        for name, step in step_of.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    return times


def grads_of(model) -> list[torch.Tensor]:
    return [p.grad.detach().to("cpu", copy=True) for p in model.parameters()]  # a copy, off the device


def grads_equal(a: list, b: list) -> tuple[bool, float]:
    equal = all(torch.equal(u, v) for u, v in zip(a, b))
    return equal, max(float((u - v).abs().max()) for u, v in zip(a, b))
