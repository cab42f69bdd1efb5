"""The refusals Lab 13 and the calculator share for flags traced apart (checkpointing policies, the
levers, float8, tensor and pipeline parallelism): each a combination no twin test has traced, or one
the formulas do not count; each one line (``UsageError``), as every bad input is."""

from __future__ import annotations

from labkit.config import UsageError


def check_checkpointing(run, layers: int) -> None:
    """--checkpoint-every against --checkpointing and the model's ``layers`` (UsageError naming them)."""
    k, every = run.checkpoint_every, run.checkpointing in ("every-k", "every-kth-block")
    if every and k is None:
        raise UsageError(f"--checkpointing {run.checkpointing} needs --checkpoint-every K: "
                         + ("the blocks per segment" if run.checkpointing == "every-k" else "every K-th block checkpointed"))
    if not every and k is not None:
        raise UsageError(f"--checkpoint-every {k} sizes the segments of --checkpointing every-k (or picks every-kth-block's "
                         f"blocks); --checkpointing is {run.checkpointing}")
    if k is not None and k > layers:
        raise UsageError(f"--checkpoint-every {k} is more than the model's {layers} blocks")


def check_combinations(run) -> None:
    """What ``TrainingRun`` (Lab 13's Config and the calculator's Inputs alike) refuses together."""
    check_context(run)
    if run.pp > run.accumulation:
        raise UsageError(f"--pp {run.pp} needs --accumulation {run.pp} or more: 1F1B keeps a micro-batch in flight "
                         "per stage (PyTorch's Schedule1F1B refuses fewer)")
    for flag, bad in (("--loss chunked or fused-linear", run.loss != "full"), ("--offload", run.offload != "none")):
        if bad and run.pp > 1:
            raise UsageError(f"{flag} with --pp is not traced: the trace is the first stage's (no loss; its own "
                             "optimizer on the device)")
    for flag, bad in (("--zero-stage 1", run.zero_stage == 1), ("--offload", run.offload != "none"),
                      ("--loss chunked or fused-linear", run.loss != "full")):
        if bad and run.tp > 1:
            raise UsageError(f"{flag} with --tp is not traced (Lab 13): the optimizer or the loss would bypass the "
                             "split weights")
    if run.float8 != "none" and run.precision == "fp32":
        raise UsageError(f"--float8 {run.float8} casts bf16 activations, as torchao trains: --precision mixed or bf16")
    if run.float8 == "tensorwise-all-gather" and (run.zero_stage < 2 or run.offload == "params" or run.replicate > 1):
        raise UsageError("--float8 tensorwise-all-gather casts FSDP2's shards to float8 before their all-gather: it needs "
                         "--zero-stage 2 or 3, and is not traced with --offload params or --replicate")
    if run.float8 == "tensorwise-all-gather" and run.tp > 1:
        raise UsageError("--float8 tensorwise-all-gather with --tp is not traced (Lab 13): FSDP2's float8 gather of "
                         "split weights is not built; --float8 tensorwise traces torchao's float8 TP styles")
    if run.float8 != "none" and run.checkpointing not in ("none", "full"):
        raise UsageError(f"--float8 {run.float8} with --checkpointing {run.checkpointing}: "
                         + ("save-matmuls and save-alternate-matmuls save aten.mm outputs, not float8's _scaled_mm"
                            if not run.checkpointing.startswith("every") else "not traced together") + ": none or full")
    if run.fsdp_units != "blocks" and (run.zero_stage < 2 or run.offload == "params" or run.pp > 1):
        raise UsageError(f"--fsdp-units {run.fsdp_units} makes FSDP2 units: it needs --zero-stage 2 or 3, and is not "
                         "traced with --offload params or --pp")
    if run.offload_activations and run.zero_stage >= 2:
        raise UsageError(f"--offload-activations with --zero-stage {run.zero_stage}: FSDP2's gathered weights "
                         "would be offloaded with the activations; traced with --zero-stage 0 or 1")
    if run.optimizer_in_backward and (run.accumulation > 1 or run.zero_stage or run.offload != "none"):
        raise UsageError("--optimizer-in-backward steps and frees each gradient as backward makes it: no "
                         "--accumulation (nothing left to add the next micro-batch to), --zero-stage (its step "
                         "waits for every gradient's reduce-scatter) or --offload")
    if run.checkpointing in ("every-k", "every-kth-block", "save-alternate-matmuls") and (run.tp > 1 or run.pp > 1):
        raise UsageError(f"--checkpointing {run.checkpointing} with --tp or --pp is not traced together (Lab 13)")
    for lever, on in (("--optimizer-in-backward", run.optimizer_in_backward),
                      ("--offload-activations", run.offload_activations)):
        if on and (run.tp > 1 or run.pp > 1 or run.float8 != "none"):
            raise UsageError(f"{lever} with --tp, --pp or --float8 is not traced together (Lab 13): leave one out")
    for lever, on in (("--optimizer-in-backward", run.optimizer_in_backward),
                      ("--offload-activations", run.offload_activations),
                      (f"--checkpointing {run.checkpointing}", run.checkpointing in ("every-k", "every-kth-block", "save-alternate-matmuls"))):
        if on and run.method != "full":
            raise UsageError(f"{lever} with --method {run.method} is not traced together (Lab 13 traces it with every "
                             "weight trained): leave one out")


def check_context(run) -> None:
    """--cp: what it needs and what it is not traced with (Lab 13's fit_context.py)."""
    c = run.cp
    if c == 1:
        return
    if run.seq % (2 * c):
        raise UsageError(f"--cp {c} cuts each sequence into {2 * c} chunks (torchtitan's head-tail split, two per rank): "
                         f"--seq {run.seq} is not a multiple of {2 * c}")
    if run.zero_stage < 2:
        raise UsageError(f"--cp {c} shards the model with FSDP over --dp x --cp ranks, as torchtitan does: "
                         "give --zero-stage 2 or 3")
    if run.sp and (run.seq // c) % run.tp:
        raise UsageError(f"--sp splits each rank's --seq / --cp = {run.seq // c} tokens over --tp {run.tp}: "
                         f"give a --seq that --cp x --tp = {c * run.tp} divides")
    split = [f for f, on in (("--pp", run.pp > 1),
                             ("--float8", run.float8 != "none"), ("--offload", run.offload != "none"),
                             ("--offload-activations", run.offload_activations),
                             ("--optimizer-in-backward", run.optimizer_in_backward),
                             (f"--method {run.method}", run.method != "full"),
                             (f"--checkpointing {run.checkpointing}", run.checkpointing not in ("none", "full")),
                             (f"--task {getattr(run, 'task', 'train')}", getattr(run, "task", "train") != "train")) if on]
    if split:
        raise UsageError(f"--cp {c} with {' and '.join(split)} is not traced together (Lab 13): leave one out")


def check_lever_formulas(inputs, family: str, dims: dict) -> None:
    """What the calculator's formulas do not count (Lab 13 traces some of these)."""
    if inputs.offload_activations and (family == "gpt" or dims["experts"] or dims["layers"] < 2):
        raise UsageError("--offload-activations: the formula counts what a dense Llama block of two or more saves "
                         "last (no GPT preset or --experts: Lab 13 traces Mixtral's)")
    if inputs.cp > 1 and (inputs.task != "train" or family == "gpt"):
        raise UsageError(f"--cp {inputs.cp}: the formula rings a Llama's or Mixtral's attention in training (Lab 13): "
                         "--task train, no GPT preset")
    if inputs.fsdp_units != "blocks" and (family == "gpt" or dims["tied"] or inputs.tp > 1):
        raise UsageError(f"--fsdp-units {inputs.fsdp_units}: the formula counts an untied embedding and head, unsplit (no "
                         "GPT preset, --tied or --tp: Lab 13 traces --tp)")
    if inputs.checkpointing == "every-kth-block" and (family == "gpt" or dims["experts"] or inputs.offload != "none" or
                                                       inputs.offload_activations or inputs.optimizer_in_backward
                                                       or inputs.fsdp_units != "blocks"):
        raise UsageError("--checkpointing every-kth-block: the formula counts a dense Llama's blocks with every gradient on "
                         "the device (no GPT preset, --experts, --offload, --offload-activations, --optimizer-in-backward "
                         "or --fsdp-units blocks-embed-head)")
    if family == "gpt" and inputs.checkpointing == "save-alternate-matmuls":
        raise UsageError("--checkpointing save-alternate-matmuls counts a Llama block's matmuls: no GPT preset")


def check_pipeline(inputs, family: str, layers: int) -> None:
    """--pp: the configurations whose first stage the formula follows (Lab 13 traces the others too)."""
    if inputs.pp == 1:
        return
    if inputs.pp > layers:
        raise UsageError(f"--pp {inputs.pp} is more pipeline stages than {layers} layers")
    if family == "gpt":
        raise UsageError(f"--pp {inputs.pp}: the formula cuts a Llama or Mixtral into stages")
    for flag, bad in (("--accumulation equal to --pp", inputs.accumulation == inputs.pp),
                      (f"--checkpointing {inputs.checkpointing}", inputs.checkpointing not in ("none", "full")),
                      ("--zero-stage 2 or 3", inputs.zero_stage >= 2)):
        if bad:
            raise UsageError(f"{flag} with --pp: the first stage's peak has no formula here yet (Lab 13 traces it)")
