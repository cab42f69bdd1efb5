"""Lab 13 - pipeline parallelism (``--pp``): the first stage of a 1F1B schedule, traced.

Each of p stages holds L/p of the blocks (here rounded up: the first stage's share); the first stage
also holds the embedding, the last the final norm, the head and the loss. Under 1F1B (Narayanan et
al. 2021, https://arxiv.org/abs/2104.04473, section 2.2; PyTorch's
``torch.distributed.pipelining.Schedule1F1B``) stage s runs forwards of successive micro-batches
until p - s are in flight, then alternates one backward (the oldest) and one forward, then drains.
The first stage is the fullest: p micro-batches' activations at once, and from its first backward
on the gradients beside them. PyTorch's schedule refuses fewer micro-batches than stages.

This file runs stage 0's own schedule in this process (no other stage exists: what crosses to stage 1
is the stage's output, kept until its backward, as PyTorch's stage keeps it; what comes back is a
gradient shaped like it, received into a buffer, ``communication``): the warm-up of p forwards, one
steady pair (a backward, then a forward: p in flight with the gradients alive), the drain, the
optimizer step. Every later steady pair allocates and frees what the traced one did, so
``--accumulation`` 10,000 traces p + 1 micro-batches.

The interleaved schedule (v model chunks per rank) is not traced: its first stage holds
1 + (p - 1) / (p v) times the activations 1F1B's does (Korthikanti et al. 2022,
https://arxiv.org/abs/2205.05198, section 4.2.3), said on the page as that formula.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial
from types import MethodType

import torch

from labkit import labs, marks

lab03 = labs.load(3)  # autocast(recipe, device)


def stage_spec(spec, pp: int):
    """The first stage's model: ⌈L / p⌉ blocks (its embedding; the head and final norm are the last stage's)."""
    return replace(spec, layers=math.ceil(spec.layers / pp))


def first_stage(model) -> None:
    """Make ``model`` the first stage: no final norm, no head (an untied one), and a forward that returns
    the last block's output (called as the model, so that FSDP2's hooks on the root run)."""
    model.norm = None
    if not model.spec.tied:
        model.head = None
    model.forward = MethodType(_stage_forward, model)


def _stage_forward(self, idx, run_blocks):
    return run_blocks(self.blocks, self.embed_tokens(idx))


# --8<-- [start:schedule]
def first_stage_step(model, optimizer, idx, *, recipe: str, blocks, stages: int, accumulation: int,
                     receive=torch.zeros_like, **_) -> None:
    """One optimizer step of 1F1B's first stage over ``accumulation`` micro-batches (at least ``stages``), the
    blocks run by ``blocks`` (Lab 04's run_blocks and a strategy, as ``fit.train_step``):
    ``stages`` forwards, then a backward and a forward while forwards remain, then the other backwards.
    ``receive(out)``: the gradient the next stage sends back for ``out`` (the trace's: a buffer, zeros)."""
    forwards = min(accumulation, stages + 1)  # the warm-up and one steady pair: later pairs repeat it
    in_flight = []  # each micro-batch's output, sent to stage 1 and kept for its backward

    def forward():
        with marks.phase("forward", 1), lab03.autocast(recipe, idx.device):
            in_flight.append(model(idx, blocks))

    def backward():
        out = in_flight.pop(0)
        with marks.phase("backward", 1):
            with marks.category("communication"):
                grad = receive(out)  # the buffer stage 1's gradient is received into
            out.backward(grad)

    for _ in range(stages):  # the warm-up: p micro-batches in flight
        forward()
    for _ in range(forwards - stages):  # the steady state: one backward, one forward
        backward()
        forward()
    while in_flight:
        backward()
    with marks.phase("optimizer", 1):
        optimizer.step()
    with marks.phase("zero_grad", 1):
        optimizer.zero_grad(set_to_none=True)
# --8<-- [end:schedule]


def check(config) -> str | None:
    """What ``--pp`` cannot trace, in one line (None: it can); TrainingRun.check_sharding holds the rules
    it shares with the calculator (micro-batches at least p)."""
    if config.pp == 1:
        return None
    if config.task != "train":
        return f"--pp {config.pp} is traced for training: --task {config.task} runs on one GPU here"
    if config.pp > config.spec.layers:
        return f"--pp {config.pp} is more pipeline stages than {config.model}'s {config.spec.layers} layers"
    if config.spec.family not in ("llama", "mixtral"):
        return f"--pp {config.pp} cuts a zoo Llama or Mixtral into stages, not {config.model}"
    return None


def step_for(config, train_step):
    """The step ``fit.trace`` runs: 1F1B's first stage under ``--pp``, else ``train_step``."""
    if config.pp == 1:
        return train_step
    return partial(first_stage_step, stages=config.pp, accumulation=config.accumulation)
