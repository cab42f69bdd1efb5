"""Lab 13 - tensor and sequence parallelism (``--tp``, ``--sp``), as PyTorch's DTensor runs them.

Megatron's split (Shoeybi et al. 2019, https://arxiv.org/abs/1909.08053), written as DTensor's
``parallelize_module`` plan that torchtitan applies to Llama (``apply_tp`` in
``torchtitan/models/llama3/infra/parallelize.py``): in every block Q, K, V and the MLP's gate and up
matrices are split by columns (each rank whole heads and a slice of the MLP), the output
projections by rows; the embedding by rows (vocabulary), the head by columns, and its output stays
split over the vocabulary, so the loss runs under ``loss_parallel`` (each rank the logits of its
slice of the vocabulary, never all of them). The norms stay whole on every rank.

``--sp`` (sequence parallelism, Korthikanti et al. 2022, https://arxiv.org/abs/2205.05198,
section 4.2.2): the norms and the residual stream between the sublayers are split along the
sequence (each rank its s/t tokens); each sublayer all-gathers its input once. PyTorch saves that
gathered input for the column-parallel matmuls' backward, whole on every rank; Megatron keeps only
the rank's shard and gathers it again in backward (Lab 01's ``tp_trace.py`` counts the difference).

This process plays rank 0 of a ``--dp`` x ``--cp`` x ``--tp`` mesh under the fake process group: collectives
return at once and move nothing, and the ledger counts each DTensor as its local shard, which is
what the rank's GPU holds. ZeRO-2/3 (FSDP2) then shards those local shards over the ``dp`` ranks.
"""

from __future__ import annotations

import contextlib

from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
import fit_context
import fit_float8_tp
import fit_pipeline
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               loss_parallel, parallelize_module)


# --8<-- [start:plan]
def plan(sp: bool, float8: bool = False) -> tuple[dict, dict]:
    """torchtitan's plan for Llama: (the root's styles, every block's styles). ``sp``: the stream
    between sublayers split along the sequence (Shard(1)), else whole on every rank (Replicate); ``float8``:
    the blocks' linears and their inputs in torchao's float8 styles (``fit_float8_tp.py``)."""
    stream = Shard(1) if sp else Replicate()
    root = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
            "head": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False)}
    block = {"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(), "attn.v_proj": ColwiseParallel(),
             "attn.o_proj": RowwiseParallel(output_layouts=stream),
             "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
             "mlp.down_proj": RowwiseParallel(output_layouts=stream)}
    if sp:  # the norms on this rank's tokens; each sublayer gathers its input once
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        root["norm"] = SequenceParallel()
        block |= {"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(), "attn": gather, "mlp": gather}
    return root, block | (fit_float8_tp.block_plan(sp) if float8 else {})


def tensor_parallel(model, mesh, sp: bool, float8: bool = False):
    """``model`` split over the 1-D ``mesh`` of its tensor-parallel ranks; returns the context the step
    runs in (``loss_parallel``: the cross-entropy of logits split over the vocabulary)."""
    root, block = plan(sp, float8)
    root = {name: style for name, style in root.items() if getattr(model, name, None) is not None}  # --pp: a stage
    for b in model.blocks:
        parallelize_module(b, mesh, block)
    parallelize_module(model, mesh, root)
    return loss_parallel()
# --8<-- [end:plan]


def apply(model, config, mesh):
    """Split ``model`` as ``config`` says (nothing without ``--tp`` or ``--pp``); returns (the mesh ZeRO shards
    over: under ``--replicate`` R, HSDP's R x dp / R mesh, FSDP2 sharding over dp / R ranks and replicating
    across R, each of them x cp; the context the step runs in: ``--tp``'s loss_parallel and ``--cp``'s ring, which
    runs on the TP rank's local heads)."""
    if config.pp > 1:
        fit_pipeline.first_stage(model)
    if mesh is None or mesh.ndim == 1:
        return mesh, fit_context.context_parallel(config)  # --cp: the ring, on a mesh of dp x cp ranks
    data = mesh["replicate", "shard"] if config.replicate > 1 else mesh["shard"]  # HSDP: replicate x shard
    step = tensor_parallel(model, mesh["tp"], config.sp, config.float8 != "none") if config.tp > 1 else contextlib.nullcontext()
    ring = fit_context.context_parallel(config, stride=config.tp)  # --cp: the ring on each TP rank's local heads
    return (data if config.dp * config.cp > 1 else None), both(step, ring)


@contextlib.contextmanager
def both(first, second):
    """The step run in ``first`` and ``second`` together (loss_parallel and the ring)."""
    with first, second:
        yield


def world(config) -> int | None:
    """The ranks FSDP shards over, as torchtitan folds context parallelism into its FSDP mesh (dp_shard x cp);
    None: no process group (no ZeRO)."""
    return config.dp * config.cp if config.zero_stage else None



@contextlib.contextmanager
def real_meshes():
    """FSDP2 over a 2-D mesh joins the data- and tensor-parallel meshes per parameter
    (``DeviceMesh._concatenate``), computing ranks with tensor ops: on the real rank table, never on
    fake tensors (which cannot answer ``nonzero``). Plumbing of the trace, not of the lesson."""
    concatenate = DeviceMesh._concatenate

    def outside_fake(meshes):
        with unset_fake_temporarily():
            return concatenate(meshes)

    DeviceMesh._concatenate = staticmethod(outside_fake)
    try:
        yield
    finally:
        DeviceMesh._concatenate = staticmethod(concatenate)


def check(config) -> str | None:
    """What ``--tp`` cannot trace, in one line (None: it can); TrainingRun.check_sharding holds the rules it
    shares with the calculator (--sp needs --tp and a sequence it divides)."""
    s, t = config.spec, config.tp
    if (broken := fit_pipeline.check(config) or fit_context.check(config)) is not None:
        return broken
    if t == 1:
        return None
    if s.family not in ("llama",):
        return f"--tp {t} splits a zoo Llama's modules (torchtitan's plan), not {config.model}'s"
    if s.heads % t or s.kv_heads % t or s.ffn % t:
        return f"--tp {t} does not split {s.heads} heads, {s.kv_heads} KV heads and an MLP of {s.ffn} evenly"
    if config.task != "train":
        return f"--tp {t} is traced for training: --task {config.task} splits over GPUs in Lab 14"
    return None
