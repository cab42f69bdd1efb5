"""Lab 13 - FSDP2's units: what is gathered together, and for how long (``--fsdp-units``).

``fully_shard`` makes each module it wraps one unit: its parameters are all-gathered together before
the module's forward and freed together after it (``reshard_after_forward=True``), then gathered
again for its backward. Whatever no inner unit claims belongs to the root, the model itself.

    blocks             Lab 11's ``wrap``: each block a unit, the root holding the token embedding, the
                       final norm and the head. The root's weights are gathered before the embedding's
                       forward; backward gathers them again at its start (the head's gradient comes first)
                       and frees them at its end (the embedding's gradient comes last), so under ZeRO-3 the
                       embedding and the head are whole on the rank through all of backward.
    blocks-embed-head  torchtitan's ``apply_fsdp_to_decoder`` (``torchtitan/distributed/fsdp.py`` at commit
                       b5bcd76c66d0acb1a08b176d9639425bc55e0b2a): the embedding its own unit, the final norm
                       and the head one unit that is not resharded after forward (backward needs it at once),
                       then the blocks. torchtune's recipes shard the same two apart
                       (``custom_sharded_layers: ['tok_embeddings', 'output']`` in
                       ``recipes/configs/llama3/8B_full.yaml`` at commit
                       bd2a0fc7c31430972728494fa01aaeeb0ebf1ba1, the head alone there). The embedding is then
                       whole only around its own forward and backward; the root holds no weight.

Why the root stays gathered: FSDP2 runs a unit's post-backward (which frees its weights) when the
gradients of its forward inputs are ready, and the root's input, the token ids, has none; so the
root is resharded in the final callback of backward (``_root_post_backward_final_callback`` in
torch 2.13's ``torch/distributed/fsdp/_fully_shard/_fsdp_state.py``). Left to choose
(``reshard_after_forward=None``), FSDP2 does not even reshard the root after forward (``lazy_init``
there: "For the root, do not reshard after forward"); Lab 11 passes True, so the root is gathered
again when backward starts.

With a 128k vocabulary each of the embedding and the head is 0.5 billion parameters (Llama-3-8B: 1 GiB
each in bf16), so the difference is a gigabyte or two per rank at the start of backward, on every rank.
"""

from __future__ import annotations

from torch.distributed.fsdp import fully_shard

from labkit.config import UsageError

MAX_FSDP_RANKS = 1024  # FSDP2 chunks every parameter into --dp shards: Llama-3-8B at 1,024 traces in ~30 s


# --8<-- [start:units]
def shard_embed_head(model, config, mesh, mp_policy) -> None:
    """Under ``--fsdp-units blocks-embed-head``, the embedding and the final norm with the head as units of their own
    (before Lab 11's ``wrap`` makes the blocks and the root units); nothing under ``blocks``."""
    if config.zero_stage < 2 or config.fsdp_units == "blocks":
        return
    fully_shard(model.embed, mesh=mesh, reshard_after_forward=config.zero_stage == 3, mp_policy=mp_policy)
    fully_shard([model.norm, model.head], mesh=mesh, reshard_after_forward=False, mp_policy=mp_policy)
# --8<-- [end:units]


def check(config) -> None:
    """Lab 13's refusals for FSDP2's ranks and units (the calculator's shared ones are in Lab 01's fit_rules.py)."""
    if config.zero_stage >= 2 and config.dp > MAX_FSDP_RANKS:
        raise UsageError(f"--dp {config.dp} with --zero-stage {config.zero_stage}: FSDP2 splits every parameter into "
                         f"--dp shards on the trace, so its time grows with --dp; up to {MAX_FSDP_RANKS} traces in about "
                         "30 s (rank 0's bytes past that are the same shares, smaller)")
    if config.fsdp_units != "blocks" and (config.spec.tied or config.spec.family == "hf"):
        raise UsageError(f"--fsdp-units {config.fsdp_units} wraps a zoo model's embedding and head apart: "
                         f"{config.model}'s " + ("head shares the embedding's weight" if config.spec.tied else
                                                 "modules are a Hugging Face config's"))
