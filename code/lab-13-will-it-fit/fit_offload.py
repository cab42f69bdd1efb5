"""Lab 13 - activation offload (``--offload-activations``): Lab 09's saved-tensor hooks around the blocks.

Every tensor a block saves for backward waits on the host between its forward and its backward, in a
host buffer the ledger counts as ``host_copies``; backward fetches each one back just before its
gradient needs it. Lab 09's ``StreamedOffload`` does it as a GPU would: copies out on a side stream,
the last two saved tensors kept (backward needs them first), those under 4 KiB kept (not worth a
copy), the parameters and the batch never moved, two fetched ahead. On the CPU trace the copies
happen at once, so the device's bytes are those of a run whose copies keep pace; how fast PCIe must
be for that is Lab 09's measurement. The head and the loss run outside the hooks: the loss's
tensors are needed first in backward and would come straight back.

With checkpointing, the hooks see what checkpoint saves (each checkpointed segment's input) and
move that; the recomputed tensors never leave the device. The numbers of the step are unchanged:
the same tensors come back (Lab 09 holds the gradients equal).
"""

from __future__ import annotations

from labkit import labs

lab09 = labs.load(9, "offload_hooks")  # StreamedOffload: the saved-tensor hooks


# --8<-- [start:offload]
def offloaded(run_blocks, config, model, idx):
    """``run_blocks`` with every tensor the blocks save for backward sent to the host (Lab 09's streamed
    hooks), when ``config.offload_activations``; ``model``'s parameters and the batch ``idx`` stay."""
    if not config.offload_activations:
        return run_blocks

    def run(blocks, x):
        with lab09.StreamedOffload(x.device, resident=(*model.parameters(), idx)):
            return run_blocks(blocks, x)
    return run
# --8<-- [end:offload]
