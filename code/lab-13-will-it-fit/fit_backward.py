"""Lab 13 - the optimizer step fused into backward (``--optimizer-in-backward``).

A plain step keeps every parameter's gradient from the moment backward makes it until
``optimizer.step()`` has read them all: one gradient per parameter, alive together (16 GB for an
8B model in bf16, 32 GB in fp32). Backward makes them one parameter at a time, though, and each is
final as soon as it is accumulated. So give each parameter an optimizer of its own and step it from a
``register_post_accumulate_grad_hook``, then drop its gradient: only the gradient of the parameter
being stepped (at most the largest one, the head or the embedding) is ever alive. This is
PyTorch's recipe ("How to save memory by fusing the optimizer step into the backward pass",
https://docs.pytorch.org/tutorials/intermediate/optimizer_step_in_backward_tutorial.html) and
torchtune's ``optimizer_in_bwd``.

The update is the same, parameter by parameter (``tests/test_lab13.py`` holds the weights equal to
the plain optimizer's). What it gives up: nothing can read all the gradients at once, so no clipping
by the global gradient norm and no gradient accumulation (the gradient is gone before the next
micro-batch could add to it); and ZeRO, whose step waits for a reduce-scatter of every gradient.
"""

from __future__ import annotations

import torch

from labkit.config import UsageError
from fit_setup import label_gradients


# --8<-- [start:in_backward]
class OptimizerInBackward:
    """One optimizer per parameter (``make([p])``), each stepped by its parameter's hook as soon as backward has
    accumulated its gradient, which the hook then frees. ``step()`` steps whatever gradient is still set (none,
    after a backward; the zero gradients that make AdamW's state before the first step)."""

    def __init__(self, params, make) -> None:
        self.each = {p: make([p]) for p in params if p.requires_grad}
        for p in self.each:
            p.register_post_accumulate_grad_hook(self.step_one)

    @classmethod
    def install(cls, model, make) -> OptimizerInBackward:
        """For ``model``'s parameters, their gradients labelled first (the hooks drop each one as it is made)."""
        label_gradients(model)
        return cls(model.parameters(), make)

    def step_one(self, p: torch.Tensor) -> None:
        self.each[p].step()  # this parameter's update, now
        p.grad = None  # and its gradient freed: the next one backward makes can reuse its memory

    def step(self) -> None:
        for p, optimizer in self.each.items():
            if p.grad is not None:
                optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.each:
            p.grad = None

    @property
    def param_groups(self) -> list[dict]:
        return [g for optimizer in self.each.values() for g in optimizer.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for optimizer in self.each.values() for p, s in optimizer.state.items()}
# --8<-- [end:in_backward]


def check_levers(config) -> None:
    """The refusals of ``--optimizer-in-backward`` and ``--offload-activations`` Lab 13 adds to the ones it
    shares with the calculator (Lab 01's ``fit_rules.check_combinations``: --tp, --pp, --float8): no
    backward to put them in, or ``--compile``, not traced with them (UsageError in one line)."""
    lever = "--optimizer-in-backward" if config.optimizer_in_backward else "--offload-activations"
    if not (config.optimizer_in_backward or config.offload_activations):
        return
    if config.task != "train":
        raise UsageError(f"{lever} needs a backward or an optimizer: --task {config.task} has neither")
    if config.compile:
        raise UsageError(f"{lever} with --compile is not traced together (Lab 13): leave one out")
