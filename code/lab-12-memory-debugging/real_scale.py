"""Lab 12 - what a loop trains and what the ledger recorded, at any size.

``training_setup`` builds what ``run_leak`` trains: the flags' TinyGPT, or a zoo model
(``--model llama-3-8b``), on fake tensors with ``--fake`` (``labkit.fake``: every byte counted,
nothing allocated); AdamW; a token stream. ``live_at_peak`` reads the ledger's record back to its
highest moment and groups what was alive there by the line that allocated it.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from labkit import budget, fake, stacks
from labkit.ledger import Ledger
from labkit.models import GPTConfig, RandomTokens, SyntheticTokens, TinyGPT
from labkit.timeline import Timeline


def training_setup(config, device: torch.device):
    """The model (the flags' TinyGPT, or ``--model``'s zoo model; on fake tensors with ``--fake``),
    AdamW, the token stream and a held-out batch, as ``run_leak`` trains them. Refuses a size the
    machine cannot hold (a trace allocates nothing: no check)."""
    torch.manual_seed(config.seed)
    spec, model_config = config.model_spec(), config.model_config()
    if spec is not None and not config.fake:  # fp32 weights, AdamW's two moments, fp32 logits
        budget.require(12 * spec.param_count() + 4 * config.batch_size * config.seq_len * spec.vocab, device,
                       f"12 B x {spec.param_count():,} parameters + 4 B x {config.batch_size} x "
                       f"{config.seq_len} tokens x {spec.vocab} logits")
    elif not config.fake:
        budget.require_gpt_training(model_config, config.batch_size, device)
    model = config.build_model(functools.partial(TinyGPT, model_config))
    if not config.fake:  # fake parameters live on the CPU already (and Module.to would try to swap them)
        model = model.to(device)
    # a trace or a zoo model: the AdamW CUDA would run (foreach); the toy on a CPU keeps torch's default
    kwargs = fake.cuda_default_optimizer_kwargs("adamw") if config.fake or spec is not None else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, **kwargs)
    data = (SyntheticTokens(model_config.vocab, config.seq_len, seed=config.seed) if spec is None
            else RandomTokens(spec.vocab, config.seq_len, seed=config.seed))
    return model, optimizer, data, data.batch(10**6, config.batch_size, device)  # held out: never trained on


def shape_of(config) -> GPTConfig:
    """The trained model's shape as a GPTConfig: the flags', or the zoo model's at ``--seq-len``."""
    spec = config.model_spec()
    if spec is None:
        return config.model_config()
    return GPTConfig(vocab=spec.vocab, seq_len=config.seq_len, width=spec.width, layers=spec.layers, heads=spec.heads)


def numbers(losses: list, config) -> list[tuple[float, float]]:
    """The losses as numbers; none from a trace (fake tensors have no values)."""
    if config.fake:
        return []
    return [tuple(v.item() if isinstance(v, torch.Tensor) else v for v in pair) for pair in losses]


def tensors(config) -> contextlib.ExitStack:
    """Where a loop runs: ``config.tensors()``, and on fake tensors :class:`NoValues` too."""
    stack = contextlib.ExitStack()
    stack.enter_context(config.tensors())
    if config.fake:
        stack.enter_context(NoValues())
    return stack


class NoValues(TorchDispatchMode):
    """``.item()`` of a fake tensor reads NaN (0 for an integer) instead of raising: a trace has bytes,
    not values, and reading one number allocates nothing, so the loop's fix (keep ``.item()``, not
    the tensor) runs as written."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and fake.is_fake(args[0]):
            return float("nan") if args[0].is_floating_point() else 0
        return func(*args, **(kwargs or {}))


class LedgerAt:
    """A ledger as it stood just after its event ``event``: what ``stacks.live_by_origin`` reads."""

    def __init__(self, ledger: Ledger, event: int) -> None:
        freed = {ev[1]: i for i, ev in enumerate(ledger.events) if ev[0] == "free"}
        self.records = [r for r in ledger.records if r.born <= event < freed.get(r.sid, len(ledger.events))]
        self.scope_of, self.category_of = ledger.scope_of, ledger.category_of

    def live_records(self) -> list:
        return self.records


def live_at_peak(ledger: Ledger, timeline: Timeline) -> list[dict]:
    """What was alive at the run's highest device total, by origin (``stacks.live_by_origin``)."""
    total = timeline.device_total()
    return stacks.live_by_origin(LedgerAt(ledger, max(range(len(total)), key=total.__getitem__)))
