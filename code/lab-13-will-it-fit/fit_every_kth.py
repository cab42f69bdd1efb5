"""Lab 13 - every K-th block checkpointed (``--checkpointing every-kth-block --checkpoint-every K``).

This is the layer-level selective checkpointing people launch with torchtitan:
``--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option K``. It is not
Lab 04's every-k. Every-k checkpoints segments of K blocks, each segment as one checkpoint, so a
segment's input is all it keeps. Here each block stands alone. Every K-th block is wrapped in a full
checkpoint and keeps only its input. The other blocks are not wrapped and keep everything.

Which blocks? torchtitan counts the blocks as it wraps them, from 1, and wraps a block when the count
is a multiple of K (``_apply_layer_sac`` and its ``_layer_sac_count``, in
https://github.com/pytorch/torchtitan/blob/1f029641b5caeb4df18ac094263e8bcc674b3686/torchtitan/distributed/activation_checkpoint.py).
Counted from 0, those are blocks K - 1, 2K - 1, ... Where K does not divide the layers, the last
L mod K blocks are not checkpointed. torchtitan removed this option in commit 114151ad (pull request
2357, March 2026), after the commit cited; its op-level policy stayed (``save-alternate-matmuls``).

Under ``--compile`` each block is compiled alone, as torchtitan does. A checkpointed block holds its
checkpoint inside its compiled graph (``fit_compile.py``); the other blocks are compiled plain.
"""

from __future__ import annotations

from torch.utils.checkpoint import checkpoint

from labkit import labs

lab04 = labs.load(4)  # run_blocks: none, full, every-k and the op-level policies


# --8<-- [start:every-kth]
def checkpointed(i: int, k: int) -> bool:
    """Is block ``i`` (counted from 0) checkpointed? torchtitan's count runs from 1: every K-th block."""
    return (i + 1) % k == 0


def run_blocks(blocks, x, strategy: str = "none", every: int = 1):
    """Lab 04's run_blocks, plus ``every-kth-block``: block i is wrapped in a full checkpoint when
    ``checkpointed(i, every)``; the other blocks run plain and keep everything for backward."""
    if strategy != "every-kth-block":
        return lab04.run_blocks(blocks, x, strategy=strategy, every=every)
    for i, block in enumerate(blocks):
        x = checkpoint(block, x, use_reentrant=False) if checkpointed(i, every) else block(x)
    return x
# --8<-- [end:every-kth]


def inside(config, i: int) -> str:
    """The checkpointing compiled block ``i`` holds inside (``--compile``): every-kth-block's, block by block."""
    if config.checkpointing != "every-kth-block":
        return config.checkpointing
    return "full" if checkpointed(i, config.checkpoint_every) else "none"
