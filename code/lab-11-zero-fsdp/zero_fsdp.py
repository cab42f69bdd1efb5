"""Lab 11 - ZeRO and FSDP: one training run at ZeRO stages 0 to 3, memory measured on every rank.

The same small GPT trains on N ranks (torchrun), each rank on its own micro-batch, four ways:

    stage 0  DistributedDataParallel: every rank holds every byte (the reference)
    stage 1  DDP + ZeroRedundancyOptimizer: each rank keeps the AdamW state of its own parameters
    stage 2  FSDP2 fully_shard(reshard_after_forward=False): parameters, gradients and AdamW state
             sharded; the gathered weights stay from forward until the end of backward
    stage 3  FSDP2 fully_shard(reshard_after_forward=True): each block's gathered weights are freed
             after its forward and gathered again for its backward

``wrap`` is the only place the stages differ; the step is Lab 02's. Every rank runs its own memory
ledger (labkit) and counts its collectives (``labkit.traffic``); rank 0 holds the bytes of every
rank against Lab 01's ZeRO formulas (``zero_model_state``) and the losses against DDP's. The
tables and the report are in ``zero_report.py``.

At real size, ONE rank of an N-rank job runs in this process (``--world-size N``: PyTorch's fake
process group; collectives move no data) and, with ``--fake``, on fake tensors: the same stages,
step and ledger, every byte counted, nothing allocated (``trace`` below; no losses, no time).

Run it (it starts two ranks itself, --nproc-per-node N for more, or runs under torchrun; gloo on
CPU; on CUDA, NCCL with one GPU per rank, gloo when ranks share a GPU):
    .venv/bin/python code/lab-11-zero-fsdp/zero_fsdp.py --device cpu
    .venv/bin/python code/lab-11-zero-fsdp/zero_fsdp.py --device cpu --stage 3 --json
    .venv/bin/python code/lab-11-zero-fsdp/zero_fsdp.py --model llama-3-8b --fake --world-size 8 --seq-len 4096 --batch-size 1 --steps 2
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit import budget, cli, labs
from labkit import dist as labdist
from labkit.config import (
    MAX_BATCH, MAX_LAYERS, MAX_LR, MAX_SECONDS, MAX_STEPS, MAX_TOKENS, MAX_VOCAB, MAX_WIDTH, LabConfig, UsageError,
    option,
)
from labkit.cuda import allocator_stats, record_snapshot, reset_peak
from labkit.ledger import Ledger
from labkit.models import TinyGPT, TinyGPTShape
from labkit.scale import RealScale
from labkit.traffic import Traffic
from zero_report import (MODEL_STATE, STAGES, Result, StageRun, TraceResult, rank_measurement, report,
                         traced_measurement)

lab01 = labs.load(1)  # zero_model_state: the formulas the bytes are held against
lab02 = labs.load(2)  # train_step, unchanged: it gets the wrapped model
scale = labs.load(2, "scale_harness")  # a zoo model, its tokens, AdamW's implementation, fake values
world = labs.load(10, "fake_world")  # one rank of N in this process: the fake process group

LOSS_RTOL = 1e-5  # losses (relative) and final parameters (absolute) against DDP; CPU runs measure 0


NO_CASTS = MixedPrecisionPolicy()  # fully_shard's default: parameters and gradients keep their dtype


# --8<-- [start:wrap]
def wrap(stage: int, model: torch.nn.Module, mesh, lr: float, mp_policy=NO_CASTS, **adamw):
    """The only place the stages differ: which rank holds which bytes (``adamw``: AdamW's
    implementation, ``foreach=True`` or ``fused=True``, when the caller names one; ``mp_policy``:
    FSDP2's mixed precision for stages 2 and 3: by default none, as ``fully_shard``'s own default)."""
    if stage <= 1:
        on_gpu = mesh.device_type == "cuda"
        ddp = DDP(model, device_ids=[torch.cuda.current_device()] if on_gpu else None)  # (1)!
        if stage == 0:
            return ddp, torch.optim.AdamW(model.parameters(), lr=lr, **adamw)
        return ddp, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=lr,
                                            **adamw)  # (2)!
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=(stage == 3), mp_policy=mp_policy)  # (3)!
    fully_shard(model, mesh=mesh, reshard_after_forward=(stage == 3), mp_policy=mp_policy)  # (4)!
    return model, torch.optim.AdamW(model.parameters(), lr=lr, **adamw)  # (5)!
# --8<-- [end:wrap]


# --8<-- [start:label]
def local(t: torch.Tensor) -> torch.Tensor:
    """The part of a tensor this rank holds: a DTensor's local shard, or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def model_state(model, optimizer) -> dict[str, list[torch.Tensor]]:
    """Parameters, gradients and AdamW state, as what THIS rank holds."""
    opt = getattr(optimizer, "optim", optimizer)  # (1)!
    params = list(model.parameters())
    return {"parameters": [local(p) for p in params],  # (2)!
            "gradients": [local(p.grad) for p in params if p.grad is not None],
            "optimizer_state": [local(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]}
# --8<-- [end:label]


# --8<-- [start:train]
def train_stage(stage: int, build, data, device: torch.device, mesh, *, seed: int, steps: int, batch_size: int,
                lr: float, adamw: dict | None = None, snapshot: Path | None = None) -> StageRun:
    """This rank's training at ``stage`` under its own ledger and traffic counter.

    ``build``: makes the model on ``device``, this rank's; ``data``: its token batches
    (``data.batch(index, batch_size, device)``); ``mesh``: every rank (a ``DeviceMesh``); ``seed``:
    the initial weights' (the same on every rank and at every stage); ``steps``; ``batch_size``:
    sequences per rank; ``lr``, ``adamw``: AdamW's; ``snapshot``: a CUDA memory history."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)  # the same initial weights on every rank and at every stage
    model = build()
    shape = [p.numel() for p in model.parameters()]  # P and T, before any sharding
    model, optimizer = wrap(stage, model, mesh, lr, **(adamw or {}))
    ledger = Ledger(device)
    label(ledger, model, optimizer)
    losses, t0 = [], time.perf_counter()
    with record_snapshot(snapshot), ledger, Traffic() as traffic:  # (1)!
        for step in cli.progress(range(steps), total=steps, desc=f"stage {stage}", quiet=rank != 0):
            if step == steps - 1:
                reset_peak(device)  # CUDA: the allocator's peak over the last step, like the ledger's
            x, y = data.batch(step * world + rank, batch_size, device)  # (2)!
            losses.append(lab02.train_step(model, optimizer, x, y, step))  # (3)!
            label(ledger, model, optimizer)  # (4)!
    return StageRun(stage, model, ledger, ledger.timeline(), traffic.summary(), losses, time.perf_counter() - t0,
                    allocator_stats(device), sum(shape), len(shape))
# --8<-- [end:train]


def label(ledger: Ledger, model, optimizer) -> None:
    """Tell the ledger, from outside, which storages are this rank's model state (a label given
    later wins, and labels are resolved when the ledger is read)."""
    for category, tensors in model_state(model, optimizer).items():
        ledger.track(tensors, category)


def full_params(model) -> torch.Tensor:
    """Every parameter, whole, on every rank (a collective: ``DTensor.full_tensor()`` all-gathers)."""
    return torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).detach().flatten().cpu()
                      for p in model.parameters()])


# --8<-- [start:config]
@dataclass
class Config(world.OneRankOfMany, RealScale, TinyGPTShape, LabConfig):
    """Train a toy GPT (or, with --model, a real one) at ZeRO stages 0-3; memory per rank against Lab 01."""

    seq_len: int = option(32, "tokens per sequence", min=1, max=MAX_TOKENS)
    width: int = option(64, "model width", min=1, max=MAX_WIDTH)
    layers: int = option(4, "transformer blocks", min=1, max=MAX_LAYERS)
    vocab: int = option(128, "vocabulary size", min=1, max=MAX_VOCAB)
    timeout: int = option(60, "seconds a rank waits for the others before the job fails (PyTorch: 30 min)",
                          min=1, max=MAX_SECONDS)
    stage: Literal["0", "1", "2", "3", "all"] = option(
        "all", "which stage to run; all runs 0, 1, 2, 3 (stage 0 is the reference)")
    steps: int = option(3, "training steps per stage", min=1, max=MAX_STEPS)
    batch_size: int = option(4, "sequences per rank per step", min=1, max=MAX_BATCH)
    lr: float = option(1e-3, "AdamW learning rate", above=0, max=MAX_LR)
    timelines: bool = option(False, "add rank 0's ledger timeline of each stage's last step to the result")
    snapshot: Path | None = option(None, "CUDA only: memory_viz pickles, one per stage and rank "
                                         "(NAME.stageS.rankR.pickle)", path="write")
    adamw: Literal["auto", "foreach", "for-loop", "fused"] = option(
        "auto", "AdamW's implementation; auto: PyTorch's choice (foreach on CUDA, for-loop on CPU; with --fake, CUDA's)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.world_size is not None and (self.device == "cuda" or self.snapshot):
            raise UsageError("--world-size runs one rank in this process on the CPU: drop --device cuda and --snapshot")
        device = cli.pick_device(self.device)  # resolves auto, refuses cuda without a GPU; launches nothing
        if self.snapshot and device.type != "cuda":
            raise UsageError("--snapshot needs a CUDA device (memory history is a CUDA allocator feature)")

    @property
    def stages(self) -> list[int]:
        return [0, 1, 2, 3] if self.stage == "all" else [int(self.stage)]
# --8<-- [end:config]


# --8<-- [start:run]
def run(config: Config) -> Result | TraceResult | None:
    """Every rank trains each stage; rank 0 gathers what every rank measured and holds it against
    Lab 01's formulas and DDP's losses. The other ranks return None. (With ``--world-size``: one
    rank, traced in this process.)"""
    if config.world_size:
        return trace(config)  # (5)!
    if config.snapshot:
        labdist.writable_dir(config.snapshot.parent, "--snapshot")  # (1)!
    model_config, t0 = config.model_config(), time.perf_counter()
    require_memory(config, cli.pick_device(config.device), int(os.environ.get("WORLD_SIZE", 1)))
    training = dict(seed=config.seed, steps=config.steps, batch_size=config.batch_size, lr=config.lr,
                    adamw=scale.adamw_options(config.adamw, config.fake))
    with labdist.joined(config.device, timeout_s=config.timeout) as (device, backend):  # (2)!
        rank, world = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh(device.type, (world,))
        build, data = builder(config, device), scale.token_source(config, model_config)
        stages, timelines, reference = [], {}, None
        for stage in config.stages:
            trained = train_stage(stage, build, data, device, mesh, **training,
                                  snapshot=_per_rank(config.snapshot, stage, rank))
            params, tensors = trained.params, trained.tensors
            final = full_params(trained.model)  # a collective: every rank takes part
            per_rank = [None] * world
            dist.all_gather_object(per_rank, rank_measurement(trained, backend))  # (3)!
            stages.append(against_lab01_and_ddp(stage, per_rank, params, tensors, final, reference))
            if stage == 0:
                reference = {"losses": stages[-1]["losses"], "final_params": final}  # DDP: what the others must equal
            if config.timelines:
                timelines[str(stage)] = trained.timeline.step_window(config.steps - 1).to_dict()
            del trained  # its model holds the process group: it goes before the group does
    if rank != 0:
        return None
    result = Result(config, model_config, device, backend, world, params, tensors, LOSS_RTOL, stages,
                    timelines if config.timelines else None, time.perf_counter() - t0)
    check_promises(result)  # (4)!
    return result
# --8<-- [end:run]


# --8<-- [start:trace]
def trace(config: Config) -> TraceResult:
    """ONE rank (rank 0) of a ``--world-size`` job, in this process, every stage: the same wrap,
    step and ledger under the fake process group, and with ``--fake`` on fake tensors."""
    device, t0 = torch.device("cpu"), time.perf_counter()
    model_config, n = config.model_config(), config.world_size
    require_memory(config, device, n)
    training = dict(seed=config.seed, steps=config.steps, batch_size=config.batch_size, lr=config.lr,
                    adamw=scale.adamw_options(config.adamw, config.fake))
    stages, timelines = [], {}
    with world.fake_world(n):  # (1)!
        mesh = init_device_mesh("cpu", (n,))
        for stage in config.stages:
            with config.tensors(), scale.values_read_as_zero(config.fake):  # (2)!
                build, data = builder(config, device), scale.token_source(config, model_config)
                trained = train_stage(stage, build, data, device, mesh, **training)  # (3)!
            derived = lab01.zero_model_state(trained.params, "fp32", "adamw", zero_stage=stage, dp=n,
                                             tensors=trained.tensors)
            stages.append(traced_measurement(trained, {k: derived[k] for k in MODEL_STATE}))  # (4)!
            if config.timelines:
                timelines[str(stage)] = trained.timeline.step_window(config.steps - 1).to_dict()
            del trained  # its model holds the process group: it goes before the group does
    return TraceResult(config, stages, timelines if config.timelines else None, time.perf_counter() - t0)
# --8<-- [end:trace]


def builder(config: Config, device: torch.device):
    """What ``train_stage`` calls to make the model: the lab's TinyGPT or the zoo's, real or fake."""
    return lambda: scale.build_model(config, lambda: TinyGPT(config.model_config()), device)


def require_memory(config: Config, device: torch.device, ranks: int) -> None:
    """Refuse a real run this machine cannot hold (ZeRO-3's floor for the toy GPT: its shards); a
    ``--fake`` run allocates nothing."""
    if config.model_spec() is None and not config.fake:
        budget.require_gpt_training(config.model_config(), config.batch_size, device, dp=ranks)
    else:
        scale.require_memory(config, config.model_config(), config.batch_size, device)


# ---------------------------------------------------------------------- what the lab derives and checks
def against_lab01_and_ddp(stage: int, per_rank: list[dict], params: int, tensors: int, final: torch.Tensor,
                          reference: dict | None) -> dict:
    """One stage: every rank's measurements, Lab 01's formulas, the match with DDP.

    ``per_rank``: ``rank_measurement`` of every rank; ``params``, ``tensors``: P and T of the
    model; ``final``: this rank's whole parameters after the last step; ``reference``: DDP's losses
    and final parameters (None while stage 0 has not run)."""
    world = len(per_rank)
    derived = lab01.zero_model_state(params, "fp32", "adamw", zero_stage=stage, dp=world, tensors=tensors)
    losses = [sum(r["losses"][i] for r in per_rank) / world for i in range(len(per_rank[0]["losses"]))]
    out = {"stage": stage, "name": STAGES[stage], "losses": losses,
           "lab01": {k: derived[k] for k in MODEL_STATE} | {"master_weights": derived["master_weights"]},
           "ranks": per_rank, "max_loss_rel_diff_vs_ddp": None, "max_param_abs_diff_vs_ddp": None}
    if reference is not None:
        out["max_loss_rel_diff_vs_ddp"] = max(abs(a - b) / abs(b) for a, b in zip(losses, reference["losses"]))
        out["max_param_abs_diff_vs_ddp"] = (final - reference["final_params"]).abs().max().item()
    return out


def check_promises(result: Result) -> None:
    """Every stage must train like DDP within ``LOSS_RTOL``. A broken promise is not bad input:
    ``CheckFailed`` (exit code 1, not 2), carrying the result, so that its numbers are reported
    before the one line that says so."""
    for s in result.stages:
        loss, params = s["max_loss_rel_diff_vs_ddp"], s["max_param_abs_diff_vs_ddp"]
        if loss is not None and not (loss <= LOSS_RTOL and params <= LOSS_RTOL):  # NaN fails too
            raise labdist.CheckFailed(f"stage {s['stage']} differs from DDP beyond {LOSS_RTOL:.0e}: "
                                      f"loss rel. diff {loss:.1e}, params abs. diff {params:.1e}", result)


def _per_rank(path: Path | None, stage: int, rank: int) -> Path | None:
    return None if path is None else path.with_name(f"{path.stem}.stage{stage}.rank{rank}.pickle")


if __name__ == "__main__":
    with labdist.one_voice() as voice:  # rank 0 speaks for every rank
        cli.main(Config, voice.ranked(run), report)
