"""Lab 04 - activation checkpointing: trade compute for memory, and measure both sides.

Backward needs tensors that forward computed. Keeping all of them is the default. Activation
checkpointing keeps fewer and recomputes the rest during backward. Four strategies, all with
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``:

    none          keep everything the blocks save for backward (the reference)
    full          checkpoint every block: keep its input, recompute its inside in backward
    every-k       checkpoint segments of k blocks: keep n/k inputs, recompute k blocks at once
    save-matmuls  checkpoint every block with an op-level policy: keep every matmul output,
                  recompute the cheap pointwise ops. On a CPU with dropout it keeps the T x T
                  attention scores (two bmm), which Korthikanti et al.'s selective recomputation drops.

TinyGPT runs its blocks through a seam (``model(x, y, run_blocks=...)``), so the lab wraps the
blocks and leaves the rest of the model alone; the zoo's real architectures have the same seam, so
``--model llama-3-70b --fake`` runs the same strategies at real size on fake tensors (bytes and
FLOPs, no values, no time). For each strategy the lab measures activation
memory (when a memory ledger watches), the recompute cost (extra FLOPs counted by
``FlopCounterMode``, time per step) and checks that the gradients equal the no-checkpointing
gradients bit for bit, dropout included. How many blocks a segment should hold: ``segments.py``.

Run it: the commands are in this folder's README.md (and on the lab's page).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from functools import partial
from typing import Literal

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode

from labkit import cli, labs, marks, provenance
from labkit.config import MAX_LAYERS, MAX_STEPS, UsageError, option
from labkit.cuda import allocator_stats, ledger_vs_allocator, record_snapshot, reset_peak
from labkit.ledger import Ledger
from labkit.scale import TINY, RealScale
from labkit.table import Table
from labkit.timeline import Timeline

from block_costs import CPU_ATTENTION_FLOPS, checks
from model_setup import DTYPES, ModelShape, build_for, grads_equal, grads_of, time_steps
from model_setup import build  # noqa: F401  (Lab 09 and the tests build the same TinyGPT: lab04.build)
import titan_policy  # torchtitan's op-level policy: save-alternate-matmuls

STRATEGIES = ("none", "full", "every-k", "save-matmuls")
GPU_TARGETS = {  # targets for the GPU run (tests/test_lab04.py, marked cuda), not results
    "full": {"min_activation_reduction": 0.60, "max_time_overhead": 0.35},
    "save-matmuls": {"min_activation_reduction": 0.40, "max_time_overhead": 0.10},
}


# --8<-- [start:policy]
aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
DROPOUT_ARG = {  # fused attention kernels: the position of their dropout_p argument
    "_scaled_dot_product_flash_attention": 3, "_scaled_dot_product_flash_attention_for_cpu": 3,
    "_scaled_dot_product_efficient_attention": 5, "_scaled_dot_product_cudnn_attention": 5,
}
ATTENTION = {getattr(aten, n).default: i for n, i in DROPOUT_ARG.items() if hasattr(aten, n)}


def save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Asked once per op of a checkpointed block's forward: keep its output, or redo it?"""
    if op in MATMULS:
        return CheckpointPolicy.MUST_SAVE  # (1)!
    if op in ATTENTION:  # (2)!
        i = ATTENTION[op]
        dropout_p = args[i] if len(args) > i else kwargs.get("dropout_p", 0.0)
        return CheckpointPolicy.MUST_SAVE if dropout_p == 0 else CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.PREFER_RECOMPUTE  # (3)!
# --8<-- [end:policy]


# --8<-- [start:blocks]
def run_segment(blocks, x):
    for block in blocks:
        x = block(x)
    return x


def run_blocks(blocks, x, strategy: str = "none", every: int = 1):
    """TinyGPT's loop over its ``blocks``, from the hidden state ``x``, checkpointed by ``strategy``
    (one of ``STRATEGIES``, or torchtitan's ``save-alternate-matmuls``); ``every`` is k, the blocks per
    segment of every-k."""
    if strategy == "none":
        return run_segment(blocks, x)  # (1)!
    if strategy == "save-matmuls":
        policy = partial(create_selective_checkpoint_contexts, save_matmuls)  # (2)!
        for block in blocks:
            x = checkpoint(block, x, use_reentrant=False, context_fn=policy)
        return x
    if strategy == "save-alternate-matmuls":  # torchtitan's: a fresh count for every block
        for block in blocks:
            x = checkpoint(block, x, use_reentrant=False, context_fn=titan_policy.contexts)
        return x
    k = 1 if strategy == "full" else every
    for i in range(0, len(blocks), k):
        x = checkpoint(run_segment, blocks[i:i + k], x, use_reentrant=False)  # (3)!
    return x
# --8<-- [end:blocks]


# --8<-- [start:step]
def train_step(model, x, y, strategy: str = "none", every: int = 1, seed: int = 0) -> torch.Tensor:
    """One forward and backward of ``model`` on ``(x, y)``, its blocks run by :func:`run_blocks`
    with ``strategy`` and ``every``; ``seed`` reseeds the generator first, so every strategy draws
    the same dropout masks. Returns the loss (a tensor: reading it waits for the device)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # (1)!
    with marks.phase("forward", 0):
        loss = model(x, y, run_blocks=partial(run_blocks, strategy=strategy, every=every))[1]  # (2)!
    with marks.phase("backward", 0):
        loss.backward()  # (3)!
    return loss.detach()
# --8<-- [end:step]


# --8<-- [start:config]
@dataclass
class Config(RealScale, ModelShape):
    """Compare activation-checkpointing strategies: memory kept, compute redone."""

    strategy: Literal["none", "full", "every-k", "save-matmuls", "all"] = option(
        "all", "which strategy to measure against 'none' (default: all of them)")
    every: int | None = option(
        None, "k for every-k: blocks per checkpointed segment (default: round(sqrt(layers)), the textbook rule, "
        "kept to show its cost: a block here keeps K_blk, many times its input I_blk, so k = 1 peaks lower "
        "until --layers passes 2*K_blk/I_blk; see segments.py)", min=1, max=MAX_LAYERS)
    steps: int = option(5, "timed forward+backward steps per strategy", min=1, max=MAX_STEPS)
    dtype: Literal["float32", "bfloat16"] = option(
        "float32", "element type of the weights and activations, no autocast (bfloat16: a pure-bf16 step)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.blocks_per_segment > self.depth:
            where = f"--layers {self.depth}" if self.model == TINY else f"the {self.depth} blocks of --model {self.model}"
            raise UsageError(f"--every {self.blocks_per_segment} is larger than {where}: a segment "
                             f"cannot hold more blocks than the model has")

    @property
    def depth(self) -> int:
        """The blocks of the model run: ``--layers``, or the zoo model's own."""
        return (self.model_spec() or self).layers

    @property
    def blocks_per_segment(self) -> int:
        """k of every-k: ``--every``, or the textbook round(sqrt(layers)) on purpose (its --help)."""
        return self.every if self.every is not None else max(1, round(math.sqrt(self.depth)))
# --8<-- [end:config]


# --8<-- [start:run]
def run(config: Config) -> Result:
    device = cli.pick_device(config.device)
    if config.snapshot and device.type != "cuda":
        raise UsageError("--snapshot needs a CUDA device (memory history is a CUDA allocator feature)")
    strategies = list(STRATEGIES) if config.strategy == "all" else list(dict.fromkeys(["none", config.strategy]))
    k, seed, t0 = config.blocks_per_segment, config.seed, time.perf_counter()
    results, ledgers = {}, {}
    with config.tensors(), record_snapshot(config.snapshot):  # --fake: every tensor from here on is fake
        model, x, y = build_for(config, device)
        if not config.fake:  # a trace has shapes and bytes, no values to compare
            train_step(model, x, y, "none", k, seed)
            reference = grads_of(model)  # (1)!
        for s in strategies:
            model.zero_grad(set_to_none=True)
            reset_peak(device)
            ledgers[s] = ledger = measure_memory(model, x, y, s, k, seed)
            tl = ledger.timeline()
            r = results[s] = activation_memory(tl) | {"cuda": ledger_vs_allocator(tl, allocator_stats(device))}
            if not config.fake:
                r["grads_equal"], r["max_abs_grad_diff"] = grads_equal(grads_of(model), reference)  # (2)!
                train_step(model, x, y, s, k, seed)
                r["grads_equal_without_ledger"] = grads_equal(grads_of(model), reference)[0]
            r["forward_flops"], r["backward_flops"] = count_flops(model, x, y, s, k, seed)
    times = {} if config.fake else time_steps(  # nor any time: a trace runs no kernel
        {s: partial(timed_step, model, x, y, s, k, seed) for s in strategies}, config.steps)
    base = results["none"]
    for s, r in results.items():
        r["recompute_flops"] = r["backward_flops"] - base["backward_flops"]  # (3)!
        r["recompute_flops_of_forward"] = r["recompute_flops"] / max(base["forward_flops"], 1)
        r["activation_reduction"] = 1 - r["activation_peak_bytes"] / base["activation_peak_bytes"]
        r["step_times_s"] = times.get(s)
        r["step_time_s"] = statistics.median(times[s]) if times else None
        r["time_overhead"] = r["step_time_s"] / base["step_time_s"] - 1 if times else None  # "none" first: 0
    return Result(config, device, model, k, results, ledgers, time.perf_counter() - t0)
# --8<-- [end:run]


# ---------------------------------------------------------------------- how the lab measures
# --8<-- [start:measure]
def activation_memory(tl: Timeline) -> dict:
    """What this lab calls activation memory, read from one step's ledger timeline."""
    fwd = next(s for s in tl.spans if s.name == "forward")
    act, tmp = tl.device["activations"], tl.device["temporaries"]
    return {
        "kept_bytes": act[fwd.end - 1],  # (1)!
        "activation_peak_bytes": max(a + t for a, t in zip(act, tmp)),  # (2)!
        "peak_bytes": tl.peak()["total"]}


def measure_memory(model, x, y, strategy: str, every: int, seed: int = 0) -> Ledger:
    """One :func:`train_step` (same arguments) under a memory ledger that knows the model and the
    batch; returns the ledger."""
    ledger = Ledger(x.device)
    ledger.track_module(model)
    ledger.track((x, y), "other")
    with ledger:  # checkpoint's own dispatch modes nest inside the ledger's  (3)!
        train_step(model, x, y, strategy, every, seed)
    return ledger


def count_flops(model, x, y, strategy: str, every: int, seed: int = 0) -> tuple[int, int]:
    """FLOPs of one forward and of its backward (same arguments as :func:`train_step`)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as fwd:
        loss = model(x, y, run_blocks=partial(run_blocks, strategy=strategy, every=every))[1]
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as bwd:
        loss.backward()  # (4)!
    return fwd.get_total_flops(), bwd.get_total_flops()
# --8<-- [end:measure]


def timed_step(model, x, y, strategy: str, every: int, seed: int = 0) -> float:
    """:func:`train_step` (same arguments), then read the loss: the clock waits for the device."""
    return train_step(model, x, y, strategy, every, seed).item()


# ---------------------------------------------------------------------- the result and its report
@dataclass
class Result:
    config: Config
    device: torch.device
    model: torch.nn.Module  # TinyGPT, or the zoo model of --model
    every: int  # k of every-k
    results: dict[str, dict]
    ledgers: dict[str, Ledger]
    wall_time_s: float

    @property
    def block_input_bytes(self) -> int:
        """I_blk: one (b, s, h) block input in --dtype, what a checkpoint keeps."""
        c = self.config
        return c.batch_size * c.seq_len * (c.model_spec() or c).width * DTYPES[c.dtype].itemsize

    @property
    def per_block_bytes(self) -> int | None:
        """K_blk, measured: what one block keeps for backward (none's kept bytes less full's, per block,
        plus the input that full keeps)."""
        r = self.results
        if "full" not in r:
            return None
        return (r["none"]["kept_bytes"] - r["full"]["kept_bytes"]) // self.config.depth + self.block_input_bytes

    def summary(self) -> dict:
        kept, block_input, c = self.per_block_bytes, self.block_input_bytes, self.config
        spec = c.model_spec()
        return {"lab": labs.slug(__file__), "device": str(self.device), "model": c.model,
                "config": asdict(spec) if spec else asdict(c.model_config()), "dtype": c.dtype,
                "batch_size": c.batch_size, "seq_len": c.seq_len, "layers": c.depth, "every": self.every,
                "strategies": list(self.results), "traced": TRACED if c.fake else None,
                "block_input_bytes": block_input, "per_block_bytes": kept,
                "per_block_over_input": kept / block_input if kept else None,
                # L > 2·K_blk/I_blk: (L/2)·I_blk + 2·K_blk < L·I_blk + K_blk
                "two_block_segments_pay_beyond": 2 * kept / block_input if kept else None,
                "activation_memory": "activation_peak_bytes: highest live activations + temporaries over forward and "
                                     "backward; kept_bytes: activations alive when forward ends",
                "timing": None if c.fake else
                f"median wall-clock seconds of {c.steps} forward+backward steps on {self.device.type}",
                "gpu_targets": GPU_TARGETS, "results": self.results,
                "provenance": provenance.collect(__file__, self.device, self.wall_time_s)}


TRACED = ("traced on fake tensors (labkit.fake): bytes as the CUDA caching allocator would round them and FLOPs, "
          "no values (gradients not compared) and no time")


def strategies_table(result: Result) -> Table:
    """Per strategy: memory kept and peak, recompute, step time, gradients against none."""
    rows = []
    for s, r in result.results.items():
        same = "reference" if s == "none" else "not compared (traced)" if "grads_equal" not in r else \
            "identical" if r["grads_equal"] else f"differ by up to {r['max_abs_grad_diff']:.1e}"
        ms = r["step_time_s"] * 1e3 if r["step_time_s"] is not None else None
        rows.append([f"every-k (k = {result.every})" if s == "every-k" else s, r["kept_bytes"], r["activation_peak_bytes"],
                     r["activation_reduction"], r["recompute_flops"], r["recompute_flops_of_forward"],
                     ms, r["time_overhead"], same])
    return Table(["strategy", ("kept after forward", "bytes"), ("activation peak", "bytes"), ("reduction", "pct:0"),
                  ("recompute FLOPs", "int"), ("of forward", "pct:0"), ("step, ms", "float:1"), ("overhead", "pct:0"),
                  "gradients"], rows)


def gpu_targets_table() -> Table:
    return Table(["strategy", ("activation reduction, at least", "pct:0"), ("step-time overhead, at most", "pct:0")],
                 [[s, t["min_activation_reduction"], t["max_time_overhead"]] for s, t in GPU_TARGETS.items()])


def report(result: Result) -> None:
    c, kind = result.config, result.device.type
    shape = c.model_spec() or c
    model = (f"TinyGPT, {c.layers} blocks of width {c.width}" if c.model == TINY
             else f"{c.model}, {shape.layers} blocks of width {shape.width}")
    print(f"Lab 04 on {result.device}: {model}, {c.dtype}, batch {c.batch_size} x {c.seq_len} tokens"
          + (f", dropout {c.dropout}" if c.model == TINY else "") + f"; every-k uses k = {result.every}"
          + (f"\n{TRACED}" if c.fake else "") + "\n")
    print(strategies_table(result).text())
    for s, r in result.results.items():
        if r["cuda"]:
            print(f"{s}: CUDA max allocated {r['cuda']['max_memory_allocated']:,} B, ledger peak / (max allocated - "
                  f"unseen before) = {r['cuda']['ledger_over_allocator']:.3f}")
    print("\nactivation peak = highest activations + temporaries over forward and backward (ledger; recomputed "
          "tensors are born in backward, so they count as temporaries). reduction and overhead: against 'none'. "
          "Recompute FLOPs: backward FLOPs minus none's, as a share of the forward's."
          + (" Step times are CPU wall clock: no GPU claim." if kind == "cpu" and not c.fake else ""))
    if set(result.results) == set(STRATEGIES) and c.model == TINY and c.dtype == "float32" and not c.fake:
        print("\nFormula against measurement:\n" + checks(result).text())  # TinyGPT's fp32 formulas, exact bytes
    if c.snapshot:
        print(f"memory history written to {c.snapshot} (open it at https://pytorch.org/memory_viz)")


if __name__ == "__main__":
    cli.main(Config, run, report)
