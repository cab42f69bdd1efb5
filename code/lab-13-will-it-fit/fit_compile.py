"""Lab 13 - torch.compile's training step: what AOTAutograd's partitioner saves for backward.

``torch.compile(block)`` hands each block to AOTAutograd. It traces forward and backward into one joint
graph and splits it in two. The split is inductor's own: its joint-graph passes, then
``min_cut_rematerialization_partition`` (``torch/_inductor/compile_fx.py: partition_fn``), which saves the
cheapest set of tensors that backward can start from and recomputes cheap pointwise ops (casts, RMSNorm's
scaling, SiLU, RoPE) in backward instead. The forward graph's outputs beyond the block's own output are
what it saves.

The backend here is that pipeline with one change: the compilers return the two FX graphs as they are,
with no code generated. They run as Python, op by op, so on fake tensors and under the ledger like any
eager step. Every block is compiled as torchtitan compiles it, ``torch.compile(block, fullgraph=True)`` per
block (``apply_compile`` in https://github.com/pytorch/torchtitan/blob/81c1243395b46ce693a0681cfe1bb20e9b9433fb/torchtitan/models/llama3/infra/parallelize.py);
the embedding, the head and the loss stay eager. ``tests/test_lab13.py`` holds the compiled step's loss and gradients to eager's and
its trace to the real ledger.

What inductor's generated code changes, which no graph run as Python can show:

* **Fusion** (``torch/_inductor/scheduler.py``): a chain of pointwise ops becomes one kernel, so its
  intermediate tensors are never allocated. The trace allocates each one, then frees it.
* **Buffer reuse** (``torch/_inductor/codegen/wrapper.py``: ``ReuseLine``; ``codegen/memory_planning.py``):
  a dead buffer of the same size is handed to the next op instead of a new allocation.
* **CUDA graphs** (``mode="reduce-overhead"``, ``torch/_inductor/cudagraph_trees.py``): a private memory
  pool that outlives the step. The default mode uses none.

So the saved tensors are the compiled step's, to the byte. Its temporaries are an upper bound.

Checkpointing (``--checkpointing full``, ``save-matmuls``, ``save-alternate-matmuls``; every-kth-block's on
its K-th blocks, ``fit_every_kth.py``) goes inside each
compiled block, as torchtitan wraps each block in its checkpoint before compiling it: Lab 04's
``run_blocks`` on the one block, so Dynamo traces the checkpoint and the partitioner must recompute what
it does not save. Where it recomputes an op tagged ``nondeterministic_seeded`` (attention, even at
dropout 0), ``functionalize_rng_ops`` (``torch/_functorch/partitioners.py``, called whenever such an op
must be recomputed; no config turns it off) wraps it in the higher-order ops ``run_and_save_rng_state``
(forward) and ``run_with_rng_state`` (backward; ``torch/_prims/rng_prims.py``). A dispatch mode needs a
rule for each (else ``NotImplementedError`` from ``torch/_ops.py``): the rule below, for the ledger and
for Traffic, runs torch's own implementation with the wrapped op under the mode, so the ledger counts
the op's bytes. The rng state the graph keeps is host memory (``torch.cuda.get_rng_state`` is a CPU
tensor): not counted. Not traced: every-k (a segment spans blocks, each compiled alone), a MoE,
``--tp`` (``check_compile`` says why), ``--cp``, QLoRA's NF4 linears (LoRA's adapters compile with their
block). Under ``--pp`` the first stage's blocks are compiled alone, and 1F1B's p + 1 micro-batches run through them.

Under FSDP2 (``--zero-stage 2/3``) torchtitan checkpoints, compiles, then ``fully_shard``s each block
(``parallelize_llama`` in torchtitan/models/llama3/parallelize.py, ``apply_compile`` in
torchtitan/distributed/compile.py, at torchtitan commit b5bcd76c66d0acb1a08b176d9639425bc55e0b2a). Lab 13
shards first; ``block.compile`` compiles the module's whole call, hooks included, so either order runs
the same. FSDP2's hooks are ``torch._dynamo.disable``'d (``_dynamo_disable`` in
``torch/distributed/fsdp/_fully_shard/_fsdp_common.py``): they run eagerly around each block's one
compiled graph, which holds no collective (tested).
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state
from torch.utils.weak import WeakIdKeyDictionary

from labkit import labs
from labkit.config import UsageError
from labkit.ledger import Ledger
from labkit.traffic import Traffic
from fit_every_kth import inside, run_blocks

lab04 = labs.load(4)  # run_blocks: the checkpoint each compiled block holds
HOST_STATES = WeakIdKeyDictionary()  # the rng states the compiled forwards kept: host memory, not the device's


def under(mode, op):
    """``op`` run with ``mode`` (the ledger) entered again: the rng ops' rules hand it to torch's own."""
    def run(*args, **kwargs):
        with mode:
            return op(*args, **kwargs)
    return run


def save_rng_state(mode, op, *args, **kwargs):
    """The rule of a mode (it runs with the mode popped): torch's implementation, the op seen by the mode."""
    state, out = run_and_save_rng_state(under(mode, op), *args, **kwargs)
    HOST_STATES[state] = True
    return state, out


def with_rng_state(mode, state, op, *args, **kwargs):
    return run_with_rng_state(state, under(mode, op), *args, **kwargs)


for _mode in (Ledger, Traffic):  # the trace's dispatch modes: the ledger, and Traffic where a process group runs
    run_and_save_rng_state.py_impl(_mode)(save_rng_state)
    run_with_rng_state.py_impl(_mode)(with_rng_state)


# --8<-- [start:compile]
class Partitioned:
    """A torch.compile backend: inductor's partition of the joint graph, the two graphs run as Python."""

    def __init__(self) -> None:
        self.graphs = 0  # forward graphs partitioned (every block has the same one: one, normally)
        self.calls = 0  # compiled forwards run
        self.saved: list[int] = []  # bytes each run saved for backward, beyond its inputs
        from torch._dynamo.backends.common import aot_autograd  # here: inductor takes a second to import

        self.backend = aot_autograd(fw_compiler=self.forward, bw_compiler=self.backward, partition_fn=self.partition)

    def partition(self, joint, inputs, **kwargs):
        from torch._inductor.compile_fx import partition_fn

        self.user_outputs = kwargs["num_fwd_outputs"]  # the block's own outputs; the rest are saved
        return partition_fn(joint, inputs, **kwargs)  # inductor's joint-graph passes, then its min-cut

    def forward(self, graph, example_inputs):
        self.graphs += 1
        keep = self.user_outputs

        def run(args):
            inputs = {t.untyped_storage()._cdata for t in args if isinstance(t, torch.Tensor)}
            outputs = graph(*args)  # the forward graph as Python: the ledger sees each op
            self.calls += 1
            self.saved.append(storage_bytes(outputs[keep:], inputs))
            return outputs
        run._boxed_call = True  # AOTAutograd passes the inputs as one list it may free early
        return run

    def backward(self, graph, example_inputs):
        def run(args):
            return graph(*args)
        run._boxed_call = True
        return run


def storage_bytes(tensors, skip: set) -> int:
    """Bytes of the distinct storages of ``tensors``, less those in ``skip`` (the inputs: weights, x)."""
    seen = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors
            if isinstance(t, torch.Tensor) and t not in HOST_STATES}
    return sum(n for key, n in seen.items() if key not in skip)


@contextlib.contextmanager
def compiled(model, config, steady: int):
    """Every block of ``model`` compiled by :class:`Partitioned` (with ``config.compile``) for the step run
    in the block; after it, an error unless each ran compiled in each of its micro-batches (``steady`` at
    most): Dynamo falls back to eager silently when it cannot compile, and that must not pass."""
    if not config.compile:
        yield None
        return
    torch._dynamo.reset()  # a fresh cache: this trace's shapes, this backend
    backend = Partitioned()
    for i, block in enumerate(model.blocks):
        if inside(config, i) != "none":  # torchtitan's order: the checkpoint inside, then compile
            block.forward = partial(lab04.run_blocks, [block.forward], strategy=inside(config, i))
        block.compile(backend=backend.backend, fullgraph=True)
    yield backend
    expected = len(model.blocks) * min(config.accumulation, config.pp + 1 if config.pp > 1 else steady)  # (1F1B: p + 1)
    if backend.calls != expected:
        raise RuntimeError(f"--compile: {backend.calls} compiled block forwards ran, not {expected} (one per block and "
                           "micro-batch): a block ran eager, or ran again")
# --8<-- [end:compile]


def outside(config):
    """Lab 04's run_blocks (``fit_every_kth.run_blocks``) as the step runs the blocks: checkpointed by
    ``--checkpointing``, or not where each compiled block holds its own."""
    return partial(run_blocks, strategy="none" if config.compile else config.checkpointing,
                   every=config.checkpoint_every or 1)


def check_compile(config) -> None:
    """What ``--compile`` traces: a training step of a dense zoo Llama, each block checkpointed inside (or
    not), with FSDP2's hooks around it (ZeRO-2/3, HSDP, --offload params) or not."""
    if not config.compile:
        return
    for bad, why in ((config.task != "train", f"--task {config.task} has no backward to partition: --task train"),
                     (config.spec.family != "llama" or config.spec.experts, f"{config.model} is not a dense zoo Llama "
                      "(a MoE's routing depends on the tokens' values, which a compiled graph of fake tensors lacks)"),
                     (config.checkpointing == "every-k", "every-k's segments span blocks, and each block is "
                      "compiled alone: --checkpointing none, full, every-kth-block or an op-level policy"),
                     # --tp stays refused: on torch 2.13 the embedding's RowwiseParallel output is redistributed with
                     # async_op=True (torch/distributed/tensor/parallel/style.py, _prepare_output_fn), so the first
                     # compiled block's input is an AsyncCollectiveTensor; AOTAutograd (inductor and aot_eager too, gloo
                     # or the fake group alike) hands its gradient to Redistribute.backward as a plain tensor, skipping to_local's
                     # backward: "'Tensor' object has no attribute '_local_tensor'" (torch/distributed/tensor/
                     # _redistribute.py, NestedRedistribute.forward). On fake tensors funcol returns a waited plain tensor
                     # instead (_are_we_tracing() in _functional_collectives.py), so the trace runs but its real twin fails.
                     (config.tp > 1, "DTensor's split blocks are not traced compiled (on torch 2.13 the real step fails "
                      "in backward): --tp 1"),
                     (config.method == "qlora", "Lab 15's NF4 linears read their weights back under a ledger mark that "
                      "Dynamo cannot trace: --method lora, or QLoRA eager")):
        if bad:
            raise UsageError(f"--compile: {why}")
