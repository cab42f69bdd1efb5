"""Lab 04 - torchtitan's op-level checkpointing policy (``--checkpointing save-alternate-matmuls`` in Lab 13).

torchtitan's ``selective_ac_option = 'op'`` keeps attention's output and every other ``mm``'s output, counted per
block, in forward and in recompute alike (torchtitan commit 9dec370, ``torchtitan/parallelisms/parallelize_llama.py``
L214-262; Lab 16 traces its published runs). Its ``context_fn`` makes a fresh count at every call, and so must this
one: torch.compile calls ``context_fn`` once per trace of a block and traces it twice (Dynamo's pass, then
AOTAutograd's), so a count kept across calls would start the second trace at the eighth ``mm`` and save the other
half (k, o, up: not q, v, gate, down)."""

from __future__ import annotations

from functools import partial

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import checkpointing  # ATTENTION: the fused attention ops whose output is kept (read at call time: it imports this)


def save_alternate_matmuls(counts: dict, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Asked once per op of a checkpointed block: keep attention's output and every other ``mm``'s, redo the rest."""
    if op is torch.ops.aten.mm.default:
        key = "recompute" if ctx.is_recompute else "forward"
        counts[key] = counts.get(key, 0) + 1
        return CheckpointPolicy.MUST_SAVE if counts[key] % 2 else CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if op in checkpointing.ATTENTION else CheckpointPolicy.PREFER_RECOMPUTE


def contexts():
    """The ``context_fn`` of a block's checkpoint: the policy with a count of its own."""
    return create_selective_checkpoint_contexts(partial(save_alternate_matmuls, {}))
