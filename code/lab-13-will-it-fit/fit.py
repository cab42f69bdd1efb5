"""Lab 13 - will it fit? A real model's training step (or prefill, or decode step), traced at real size, per rank.

The other labs each teach one technique on a toy. This one composes them on a real architecture
(``labkit.zoo``: Llama 3 8B/70B/405B, Mixtral, any Hugging Face causal-LM config.json) and asks the
question a reader brings: does this step fit this GPU? The answer is a trace, not a formula: the
model is built on fake tensors (``labkit.fake``), one steady-state step runs (forward, backward,
optimizer, with AdamW's state already there), and the memory ledger counts every storage the
step would hold, rounded as the CUDA allocator rounds. Nothing is allocated, so Llama-3-70B
traces on a laptop in seconds.

    precision       Lab 03's recipes: fp32, bf16 (pure bf16: no fp32 master), mixed (fp32 weights + bf16 autocast)
    checkpointing   Lab 04's run_blocks: full, every-k, op-level (save-matmuls, save-alternate-matmuls), every-kth-block
    accumulation    Lab 06's micro-batches into one optimizer step
    --loss          full (the model's), chunked or fused-linear (``fit_loss.py``): never every logit at once
    --float8        tensorwise: the blocks' linears multiply in float8, as torchao's (``fit_float8.py``); with
                    -all-gather, FSDP2 gathers them in float8 (``fit_float8_gather.py``); with --tp, torchao's
                    float8 TP styles (``fit_float8_tp.py``)
    --task decode   one step against a KV cache preallocated to --kv-len tokens per sequence (``fit_decode.py``)
    --compile       each block torch.compile'd: what AOTAutograd's partitioner saves, traced (``fit_compile.py``)
    --offload       optimizer: Lab 07's engine; params: FSDP2's CPU offload of the shards
    levers          --optimizer-in-backward (``fit_backward.py``), --offload-activations (``fit_offload.py``)
    --fsdp-units    blocks-embed-head: the embedding and the head as FSDP2 units of their own (``fit_units.py``)
    --zero-stage    1: ZeroRedundancyOptimizer; 2 and 3: Lab 11's FSDP2 wrap (with --precision mixed,
                    FSDP2's MixedPrecisionPolicy instead of autocast); all under the fake process
                    group, as rank 0 of --dp ranks
    --tp --sp --pp --cp  one rank of a split model: TP/SP, 1F1B, HSDP (``fit_parallel.py``), the ring (``fit_context.py``)
    --method        lora or qlora: Lab 15's adapters on a frozen base, NF4 under qlora (``fit_finetune.py``)

Beside the trace: Lab 01's formulas per category and the gap explained (``fit_gap.py``), the GPU's
usable bytes (``fit_gpus.py``) and the levers that would make it fit, each re-traced
(``fit_levers.py``).

Run it:
    .venv/bin/python code/lab-13-will-it-fit/fit.py --model llama-3-8b --seq 4096 --gpu h100-80gb
    .venv/bin/python code/lab-13-will-it-fit/fit.py --model llama-3-70b --dp 8 --zero-stage 3 --json
    .venv/bin/python code/lab-13-will-it-fit/fit.py --model llama-3-8b --task infer --precision bf16 --gpu l4-24gb
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Literal

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer

from labkit import cli, fake, labs, marks, provenance, zoo
from labkit import cuda as cuda_kit
from labkit.config import INT64_MAX, MAX_TOKENS, LabConfig, UsageError, option
from labkit.ledger import Ledger
from labkit.timeline import Timeline
from fit_compile import check_compile, compiled, outside
from fit_gap import derive
from fit_backward import OptimizerInBackward, check_levers
from fit_decode import check_decode, decode
from fit_finetune import AdamW8bit, Adapters, adapt, base_dtype
import fit_context
import fit_float8 as float8
import fit_parallel
import fit_pipeline
import fit_units
from fit_gpus import GPUS
from fit_levers import search
from fit_loss import LOSSES
from fit_offload import offloaded
from fit_report import report, summary
from fit_setup import ShardOptimizer, WeightCasts, build, create_state, fake_process_group, label, label_gradients, traffic

lab03 = labs.load(3)  # autocast(recipe, device): the mixed-precision recipe
lab04 = labs.load(4)  # run_blocks: full, every-k, save-matmuls and save-alternate-matmuls checkpointing
lab07 = labs.load(7)  # install: ZeRO-Offload's AdamW on the host
lab11 = labs.load(11)  # wrap: ZeRO-2 and ZeRO-3 as FSDP2's fully_shard
lab16 = labs.load(16, "reserved_bytes")  # reserved: the step in reserved bytes, simulated
TrainingRun = labs.load(1, "fit_inputs").TrainingRun  # --batch ... --offload, shared with the calculator


# --8<-- [start:recipes]
PRECISIONS = {  # the weights' dtype, and Lab 03's autocast recipe for the forward
    "fp32": (torch.float32, "fp32"),  # fp32 weights, gradients, optimizer state; no autocast
    "bf16": (torch.bfloat16, "fp32"),  # (1)!
    "mixed": (torch.float32, "bf16"),  # (2)!
}
OPTIMIZERS = {  # (3)!
    "adamw": (torch.optim.AdamW, fake.cuda_default_optimizer_kwargs("adamw")),  # CUDA's default: foreach
    "adamw-foreach": (torch.optim.AdamW, {"foreach": True}),
    "adamw-fused": (torch.optim.AdamW, {"fused": True}),
    "adamw8bit": (AdamW8bit, {}),  # Lab 15's: moments as 8-bit codes in blocks of 2,048
    "sgd": (torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9, **fake.cuda_default_optimizer_kwargs("sgd")}),
}
# --8<-- [end:recipes]


# --8<-- [start:step]
def train_step(model, optimizer, idx, *, recipe: str, blocks, micro_batches: int = 1, head_loss=None) -> None:
    """One optimizer step over ``micro_batches`` forward/backward passes of ``idx`` (tokens as their own
    targets: only shapes matter), autocast by Lab 03's ``recipe``, the blocks run by ``blocks`` (Lab 04's
    run_blocks and a strategy), the loss by ``head_loss`` (``fit_loss.LOSSES``: None is the model's own)."""
    for _ in range(micro_batches):
        with marks.phase("forward", 1), lab03.autocast(recipe, idx.device):
            loss = model(idx, idx, run_blocks=blocks, head_loss=head_loss)[1]  # (1)!
        with marks.phase("backward", 1):
            (loss / micro_batches).backward()  # (2)!
    with marks.phase("optimizer", 1):
        optimizer.step()  # (3)!
    with marks.phase("zero_grad", 1):
        optimizer.zero_grad(set_to_none=True)


def prefill(model, idx, *, recipe: str) -> None:
    """The forward of a prompt of ``idx`` tokens, as a server's prefill runs it: no graph is kept."""
    with torch.no_grad(), marks.phase("prefill", 0), lab03.autocast(recipe, idx.device):
        model(idx)  # (4)!
# --8<-- [end:step]


#: micro-batches the trace runs: the second is the steady state (it runs with the first one's gradients
#: alive), and every later one allocates and frees the same bytes; so --accumulation 1000000 costs two
STEADY_MICRO_BATCHES = 2


# --8<-- [start:trace]
def trace(config: Config, tensors=fake.tensors, device: str = "cpu") -> Trace:
    """The steady-state step of ``config`` under a memory ledger: rank 0's bytes, phase by phase.

    ``tensors``: the context the step runs in (``fake.tensors``: fake storages rounded to the CUDA
    allocator's blocks; ``contextlib.nullcontext`` builds the real twin); ``device``: where."""
    weights, recipe = PRECISIONS[config.precision]
    weights = base_dtype(config, weights)  # under LoRA, the frozen base's (Lab 15)
    recipe = "fp32" if fsdp_mixed(config) else recipe  # FSDP2 casts the weights itself: no autocast
    t0 = time.perf_counter()
    with fake_process_group(fit_parallel.world(config), device, config.tp, config.replicate) as mesh, \
            tensors():
        model = build(fit_pipeline.stage_spec(config.spec, config.pp), weights, device)  # (1)!
        adapt(model, config)  # Lab 15: adapters on a frozen base (NF4 under qlora); none under --method full
        if config.float8 != "none":
            float8.convert(model, config.float8)  # fit_float8.py: the blocks' linears as torchao's Float8Linear
        mesh, split = fit_parallel.apply(model, config, mesh)  # --tp: Megatron's split as DTensor's plan
        with fit_parallel.real_meshes():
            optimizer = shard(model, config, mesh)  # (2)!
        idx = torch.zeros(config.batch, fit_context.local_tokens(config), dtype=torch.long, device=device)  # --cp
        if optimizer is not None:
            create_state(optimizer)  # (3)!
        cuda_kit.reset_peak(torch.device(device))  # on a GPU: the allocator's peak from here (no-op on CPU)
        ledger = Ledger(device)
        casts = WeightCasts(ledger)  # autocast's casts of the weights, as the ledger counts them
        with ledger, traffic(), split, compiled(model, config, STEADY_MICRO_BATCHES):  # (4)!
            label(ledger, model, optimizer)
            if config.task == "train":
                blocks = outside(config)  # Lab 04's run_blocks, or every-kth-block's (fit_every_kth.py)
                fit_pipeline.step_for(config, train_step)(model, optimizer, idx, recipe=recipe,
                                                          blocks=offloaded(blocks, config, model, idx),
                           micro_batches=min(config.accumulation, STEADY_MICRO_BATCHES), head_loss=LOSSES[config.loss])
            elif config.task == "decode":
                decode(model, ledger, config, weights, device)
            else:
                prefill(model, idx, recipe=recipe)
        timeline, allocator = ledger.timeline(), cuda_kit.allocator_stats(torch.device(device))
    return Trace(config, timeline, time.perf_counter() - t0, ledger, keep=(model, optimizer), casts=casts.sids,
                 allocator=allocator)


def shard(model, config: Config, mesh):
    """Who holds which bytes: ZeRO over the ranks of ``mesh``, or offload to the host; returns rank
    0's optimizer (None for inference)."""
    make, kwargs = OPTIMIZERS[config.optimizer]
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if fsdp_mixed(config)
              else lab11.NO_CASTS)
    if config.offload == "params":  # (5)!
        for module in (*model.blocks, model):
            fully_shard(module, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False), mp_policy=policy)
    elif config.zero_stage >= 2:
        fit_units.shard_embed_head(model, config, mesh, policy)  # --fsdp-units blocks-embed-head: two more units
        lab11.wrap(config.zero_stage, model, mesh, lr=1e-3, mp_policy=policy)  # (6)!
    if config.task != "train":
        return None
    if config.zero_stage >= 2 or config.tp > 1:
        return ShardOptimizer(model.parameters(), partial(make, **kwargs), host=config.offload == "params")
    if config.zero_stage == 1:  # (7)!
        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=make, **kwargs)
    if config.optimizer_in_backward:  # fit_backward.py: each parameter stepped by its own hook, in backward
        return OptimizerInBackward.install(model, partial(make, **kwargs))
    if config.offload == "optimizer":  # (8)!
        label_gradients(model)
        return lab07.install("gradients", model, lr=1e-3, weight_decay=0.0, overlap=False,
                             impl="fused" if kwargs.get("fused") else "foreach")
    return make([p for p in model.parameters() if p.requires_grad], **kwargs)  # under LoRA, the adapters alone


def fsdp_mixed(config: Config) -> bool:
    """Mixed precision under FSDP2 (ZeRO-2/3): its MixedPrecisionPolicy gathers bf16 weights and
    reduces fp32 gradients, as torchtitan trains; autocast would keep a bf16 copy of whole weights."""
    return config.precision == "mixed" and config.zero_stage >= 2
# --8<-- [end:trace]


# ----------------------------------------------------------------------------- the configuration

@dataclass
class Step:
    """The model and the step traced (first on a command line, before how the step runs)."""

    model: str = option("llama-3-8b", "a zoo model (llama-3-8b, llama-3-70b, mixtral-8x7b, ...) or the path of a "
                        "Hugging Face config.json of a causal LM", metavar="NAME|PATH")
    task: Literal["train", "infer", "decode"] = option(
        "train", "train: one training step; infer: one prefill forward of --batch x --seq tokens; decode: one decode "
        "step of --new-tokens per sequence against a KV cache preallocated to --kv-len tokens per sequence")


@dataclass
class Config(TrainingRun, Step, Adapters, LabConfig):
    """Will this step fit this GPU? A real model traced at real size on fake tensors, per rank."""

    gpu: Literal[tuple(GPUS)] = option("h100-80gb", "the GPU to fit (its memory less a CUDA context and headroom)")
    kv_len: int | None = option(None, "decode: tokens the KV cache is preallocated to, per sequence (default: --seq)",
                                min=1, max=MAX_TOKENS)
    new_tokens: int = option(1, "decode: new tokens per sequence in the step (1: plain decoding; more: a speculative "
                             "decoder verifying its drafted tokens)", min=1, max=MAX_TOKENS)
    levers: Literal["needed", "all", "none"] = option(
        "needed", "levers traced: needed (when it does not fit, the cheapest until it fits), all, or none")

    def __post_init__(self) -> None:
        super().__post_init__()
        spec, z = self.spec, self.zero_stage
        if spec.family == "flux":
            raise UsageError(f"--model {self.model} is a diffusion transformer, not a causal LM: nothing to tokenise")
        if (broken := fit_parallel.check(self)) is not None:
            raise UsageError(broken)
        self.check_sharding()
        self.check_checkpointing(spec.layers)
        self.check_adapters()
        fit_units.check(self)
        if self.loss != "full" and spec.family == "hf":
            raise UsageError(f"--loss {self.loss} applies the head itself: a zoo model's (--model llama-3-8b, ...), "
                             "not a Hugging Face config's")
        float8.check(self)
        check_decode(self)
        check_compile(self)
        check_levers(self)
        if self.task != "train":
            for flag, bad in (("--checkpointing", self.checkpointing != "none"), ("--accumulation", self.accumulation > 1),
                              ("--loss chunked or fused-linear", self.loss != "full"), ("--float8", self.float8 != "none"),
                              ("--zero-stage 1 or 2", z in (1, 2)), ("--offload optimizer", self.offload == "optimizer")):
                if bad:
                    raise UsageError(f"{flag} needs a backward or an optimizer: --task {self.task} has neither")
        logits = self.batch * self.seq * max(spec.vocab, 1) * 4
        if logits > INT64_MAX:
            raise UsageError(f"--batch {self.batch} x --seq {self.seq} x {spec.vocab:,} logits x 4 bytes is {logits:.3g} "
                             "bytes: more than a 64-bit integer counts")

    @cached_property
    def spec(self):
        """The zoo entry (or Hugging Face config) ``--model`` names."""
        return zoo.get(self.model)


# ----------------------------------------------------------------------------- the run
def run(config: Config) -> Result:
    t0 = time.perf_counter()
    if config.seq > config.spec.context > 0:
        print(f"warning: --seq {config.seq} is longer than {config.model}'s context ({config.spec.context:,} "
              "tokens); tracing it anyway", file=sys.stderr)
    traced = trace(config)
    measured = measure_on_gpu(config, traced) if cli.pick_device(config.device).type == "cuda" else None
    levers = [] if config.levers == "none" else search(traced, trace, every=config.levers == "all")
    return Result(config, traced, levers, measured, time.perf_counter() - t0)


def measure_on_gpu(config: Config, traced: Trace, device: str = "cuda") -> dict:
    """The same step on real tensors on ``device``, when one rank holds it all (and, on a GPU, it fits
    what is free): the trace's peak beside the real ledger's and, on a GPU, the allocator's own
    counters over the step (``max_memory_allocated``: every block as rounded, up to 512 B; the
    ``requested_bytes`` peak: what the tensors asked for; the reserved peak). On ``cpu``: the plumbing."""
    free = torch.cuda.mem_get_info()[0] if device == "cuda" else None
    if config.dp * config.cp > 1 or config.offload != "none" or free is not None and traced.per_rank_peak_bytes > free:
        return {"measured": False, "why": "runs single-rank steps that fit the free memory only", "free_bytes": free}
    if config.seq > config.spec.context > 0:
        return {"measured": False, "why": "a real step cannot run past the model's context", "free_bytes": free}
    real = trace(config, tensors=contextlib.nullcontext, device=device)
    stats = cuda_kit.ledger_vs_allocator(real.timeline, real.allocator) or {}
    peak = traced.timeline.peak()["total"]
    allocated = stats.get("max_memory_allocated", 0) - stats.get("unseen_before_window", 0)
    return {"measured": True, "device": device, "device_name": torch.cuda.get_device_name() if free else "cpu",
            "free_bytes": free, "traced_peak_bytes": peak, "ledger_peak_bytes": real.timeline.peak()["total"],
            **{k: stats.get(k) for k in ("max_memory_allocated", "max_requested_bytes", "max_memory_reserved")},
            "unseen_before_step": stats.get("unseen_before_window"),
            "traced_over_allocated": peak / allocated if allocated > 0 else None}


@dataclass
class Trace:
    """A traced step and what is derived from it (``fit_gap``): the peak per rank, by category."""

    config: Config
    timeline: Timeline  # the ledger's: rank 0's device and host bytes over the step
    seconds: float
    ledger: Ledger | None = field(default=None, repr=False)  # the recorder, for tests that compare events
    keep: tuple = field(default=(), repr=False)  # the model and optimizer: freed whenever Python collects them,
    # they would log frees after the step, at a moment that varies from run to run
    casts: set = field(default_factory=set, repr=False)  # the ledger's ids of weights' dtype casts
    allocator: dict | None = field(default=None, repr=False)  # on a GPU: labkit.cuda.allocator_stats after the step
    derived: dict = field(default_factory=dict)  # filled by fit_gap.derive

    def __post_init__(self) -> None:
        self.derived = derive(self)

    @property
    def per_rank_peak_bytes(self) -> int:
        return self.derived["peak"]["total"]

    @cached_property
    def reserved(self) -> dict:
        """The step in reserved bytes, the CUDA context added (Lab 16's model of the caching allocator)."""
        return lab16.reserved(self)

    @property
    def fits(self) -> bool:
        return self.reserved["need_bytes"] <= GPUS[self.config.gpu].total_bytes


@dataclass
class Result:
    config: Config
    trace: Trace
    levers: list[dict]
    measured: dict | None
    wall_time_s: float

    def summary(self) -> dict:
        return summary(self) | {"provenance": provenance.collect(__file__, "cpu", self.wall_time_s)}


if __name__ == "__main__":
    cli.main(Config, run, report)
