"""Lab 10 - data parallel training with DistributedDataParallel (DDP), measured per rank.

Lab 02's loop on N processes ("ranks"). Every rank holds the whole model and optimizer and trains
on its own slice of the batch. During backward, DDP copies gradients into flat *buckets* of about
``bucket_cap_mb`` and all-reduces each bucket as soon as it is full, so communication overlaps the
rest of backward. After the all-reduce every rank holds the same averaged gradient, takes the same
optimizer step, and the replicas stay identical.

What it checks and measures, on every rank:
  * the buckets (a communication hook sees each one: parameters and bytes), against the layout
    derived from the parameter sizes, and against what DDP itself reports;
  * that all ranks hold bit-identical parameters after every step (digests, all-gathered);
  * that training equals one process on the concatenated batch, within a stated tolerance;
  * memory per rank from a labkit Ledger, with the buckets as their own "communication" category.

At real size, ONE rank of an N-rank job runs in this process (``--world-size N``: PyTorch's fake
process group, ``fake_world.py``) and, with ``--fake``, on fake tensors: the same ``train``, every
byte counted, nothing allocated (no values, no replicas to compare, no time).

Run it: the commands are in this folder's README.md (and on the lab's page).
"""

from __future__ import annotations

import hashlib
import json
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_report import RankRun, Result, bucket_report, compare, memory_report
from ddp_trace_report import TraceResult, report
from fake_world import OneRankOfMany, fake_world
from labkit import cli, files, labs, marks
from labkit import dist as labdist
from labkit.config import (
    MAX_BATCH, MAX_BYTES, MAX_LR, MAX_SECONDS, MAX_STEPS, MAX_TOKENS, MAX_VOCAB, MAX_WIDTH, LabConfig, UsageError,
    option,
)
from labkit.cuda import allocator_stats, ledger_vs_allocator, record_snapshot, reset_peak
from labkit.ledger import Ledger
from labkit.models import TinyGPT, TinyGPTShape
from labkit.scale import RealScale
from labkit.timeline import Timeline

lab02 = labs.load(2)  # Lab 02's train_step, unchanged: it gets the DDP model
scale = labs.load(2, "scale_harness")  # a zoo model, its tokens, AdamW's implementation, fake values

MIB = 1024 * 1024
# DDP against one process is not bit-exact (see single_process_reference). Allowed differences:
# losses and last gradients, max |diff| / max |value| (a few fp32 roundings); parameters,
# ||diff|| / ||how far training moved them||. Not max |diff| for parameters: where a true gradient
# is zero (attention's key bias), AdamW divides rounding noise by eps and one weight may move apart.
TOLERANCE = {"loss": 1e-5, "grads": 1e-4, "params": 1e-2}


# --8<-- [start:hook]
class BucketLog:
    """What the hook below saw: for every backward, each bucket's parameters and bytes; and the
    buckets themselves, held weakly (a log must not keep a bucket alive that DDP has freed)."""

    def __init__(self, names: dict[int, str]):
        self.names, self.backwards, self.buffers = names, [], weakref.WeakValueDictionary()


def logged_allreduce(log, bucket):  # no annotations: a string one (lazy annotations) fails DDP's check
    """A DDP communication hook: average the bucket with all_reduce, as DDP does by default, and
    record which parameters it holds and its bytes (``dist.GradBucket`` is a public API)."""
    buffer = bucket.buffer()  # (1)!
    log.buffers[bucket.index()] = buffer  # (2)!
    if bucket.index() == 0:
        log.backwards.append([])  # buckets are reduced in index order: 0 opens a backward
    log.backwards[-1].append({"index": bucket.index(), "bytes": buffer.numel() * buffer.element_size(),
                              "params": [log.names[id(p)] for p in bucket.parameters()]})
    buffer.div_(dist.get_world_size())  # (3)!
    marks.record_stream(buffer, "nccl")  # on a GPU, NCCL's stream uses the bucket too (Lab 16)
    work = dist.all_reduce(buffer, async_op=True)  # (4)!
    return work.get_future().then(lambda fut: fut.value()[0])
# --8<-- [end:hook]


# --8<-- [start:derive]
def derive_buckets(sizes: list[tuple[str, int]], cap_bytes: int, first_cap_bytes: int | None = None):
    """DDP's rule: walk the gradients in the order they become ready, fill a bucket, and close it
    as soon as it holds at least the cap (the first bucket may have its own cap)."""
    buckets, current, filled = [], [], 0
    for name, nbytes in sizes:
        current.append(name)
        filled += nbytes
        cap = first_cap_bytes if first_cap_bytes and not buckets else cap_bytes
        if filled >= cap:  # (1)!
            buckets.append(current)
            current, filled = [], 0
    return buckets + ([current] if current else [])
# --8<-- [end:derive]


def replicas_identical(module: torch.nn.Module) -> bool | None:
    """True when every rank's parameters are bit for bit the same: a digest per rank, all-gathered.
    None under the fake process group (``--world-size``): one rank runs, there is nothing to compare."""
    if dist.get_backend() == "fake":
        return None
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, h.hexdigest())
    return len(set(digests)) == 1


# --8<-- [start:train]
def train(build, data, device: torch.device, *, seed: int, steps: int, batch_size: int, lr: float,
          bucket_cap_mb: float, grad_as_bucket_view: bool, adamw: dict | None = None,
          snapshot: Path | None = None) -> RankRun:
    """This rank's training, under its own ledger. ``build``: makes the model on ``device``;
    ``data``: the token batches (``data.batch(index, batch_size, device)``); ``seed``: ``seed + rank``
    seeds this rank's model; ``batch_size``: sequences per rank; ``lr``, ``adamw``: AdamW's
    (``adamw``: its implementation, when named); ``bucket_cap_mb``, ``grad_as_bucket_view``: DDP's;
    ``snapshot``: a CUDA memory history, one file per rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed + rank)  # (1)!
    model = build()
    names = [n for n, _ in model.named_parameters()]
    identical = {"before DDP": replicas_identical(model)}
    ledger = Ledger(device).track_module(model)
    log, ready = BucketLog({id(p): n for n, p in model.named_parameters()}), []
    hooks = [p.register_post_accumulate_grad_hook(lambda p, n=n: ready.append(n))
             for n, p in model.named_parameters()]  # (2)!
    reset_peak(device)
    losses, t0 = [], time.perf_counter()
    with record_snapshot(_per_rank(snapshot, rank)), ledger:
        with marks.phase("wrap"), marks.category("communication"):
            ddp = DDP(model, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=grad_as_bucket_view)  # (3)!
        ddp.register_comm_hook(state=log, hook=logged_allreduce)
        identical["after DDP()"] = replicas_identical(ddp.module)  # (4)!
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=lr, **(adamw or {}))
        ledger.track_optimizer(optimizer)
        for step in cli.progress(range(steps), total=steps, desc=f"rank {rank}", quiet=rank != 0):
            if step == steps - 1:
                reset_peak(device)  # CUDA: the allocator's peak over the last step, as the ledger's below
            x, y = data.batch(step * world + rank, batch_size, device)  # (5)!
            loss = lab02.train_step(ddp, optimizer, x, y, step)  # (6)!
            with marks.phase("check", step):
                total = torch.tensor([loss], device=device)
                dist.all_reduce(total)  # the global loss: the mean of the ranks' means
                losses.append(total.item() / world)
                identical[f"step {step}"] = replicas_identical(ddp.module)
            if step == 0:
                for h in hooks:
                    h.remove()  # the ready order is learned once, in the first backward
    wall = time.perf_counter() - t0
    ledger.track(list(log.buffers.values()), "communication")  # (7)!
    tl = ledger.timeline()
    last = min(s.start for s in tl.spans if s.step == steps - 1)
    return RankRun(ddp, ledger, tl, log.backwards, ready, names, losses, identical, wall,
                   ledger_vs_allocator(tl, allocator_stats(device), last))
# --8<-- [end:train]


# --8<-- [start:reference]
def single_process_reference(build, data, device, world: int, *, seed: int, steps: int, batch_size: int, lr: float,
                             adamw: dict | None = None):
    """The same training in one process on the concatenated batch: ``world`` x ``batch_size``
    sequences a step (``data``'s), from rank 0's initial weights (``build``, seeded with ``seed``).

    Equal up to rounding, not bit for bit: the weight gradient is a sum over the batch's tokens,
    which DDP splits into per-rank GEMMs and then adds across ranks, in another order than one
    GEMM over the whole batch; fp32 addition is not associative."""
    torch.manual_seed(seed)  # rank 0's weights: the ones DDP broadcast
    model = build()
    start = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, **(adamw or {}))
    losses = []
    for step in range(steps):
        shards = [data.batch(step * world + r, batch_size, device) for r in range(world)]
        x, y = (torch.cat(t) for t in zip(*shards))  # (1)!
        optimizer.zero_grad(set_to_none=True)
        loss = model(x, y)[1]
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model, start, losses
# --8<-- [end:reference]


# --8<-- [start:config]
@dataclass
class Config(OneRankOfMany, RealScale, TinyGPTShape, LabConfig):
    """Train a toy GPT (or, with --model, a real one) data parallel with DDP: buckets, identical replicas, memory per rank."""

    seq_len: int = option(32, "tokens per sequence", min=1, max=MAX_TOKENS)
    width: int = option(64, "model width", min=1, max=MAX_WIDTH)
    vocab: int = option(128, "vocabulary size", min=1, max=MAX_VOCAB)
    steps: int = option(3, "training steps (at least 2: DDP rebuilds its buckets after the first backward)",
                        min=2, max=MAX_STEPS)
    batch_size: int = option(4, "sequences per rank per step", min=1, max=MAX_BATCH)
    lr: float = option(3e-3, "AdamW learning rate", above=0, max=MAX_LR)
    bucket_cap_mb: float = option(0.05, "DDP bucket size cap in MiB (PyTorch's default is 25; tiny here to get "
                                        "several)", above=0, max=MAX_BYTES >> 20)
    grad_as_bucket_view: bool = option(False, "gradients become views into the buckets instead of separate tensors")
    backend: Literal["auto", "gloo", "nccl"] = option("auto", "auto: nccl with one GPU per rank, else gloo")
    timeout: int = option(60, "seconds a rank waits for the others before the job fails (PyTorch: 30 min)",
                          min=1, max=MAX_SECONDS)
    ledger_dir: Path | None = option(None, "every rank writes its ledger here as rank<N>.json", path="folder")
    no_reference: bool = option(False, "skip rank 0's single-process replay")
    snapshot: Path | None = option(None, "CUDA only: memory_viz pickles, one per rank (NAME_rank<N>.pickle)",
                                   path="write")
    adamw: Literal["auto", "foreach", "for-loop", "fused"] = option(
        "auto", "AdamW's implementation; auto: PyTorch's choice (foreach on CUDA, for-loop on CPU; with --fake, CUDA's)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.world_size is not None and (self.device == "cuda" or self.snapshot or self.ledger_dir):
            raise UsageError("--world-size runs one rank in this process on the CPU: drop --device cuda, --snapshot "
                             "and --ledger-dir")
        device = cli.pick_device(self.device)  # resolves auto; launches nothing
        labdist.check_backend(device, self.backend)
        if self.snapshot and device.type != "cuda":
            raise UsageError("--snapshot needs a CUDA device (a CUDA allocator feature)")
# --8<-- [end:config]


# --8<-- [start:run]
def run(config: Config) -> Result | TraceResult | None:
    """Every rank trains under its own ledger; rank 0 gathers what they measured, replays the
    training in one process and returns the result. The other ranks return None. (With
    ``--world-size``: one rank, traced in this process.)"""
    if config.world_size:
        return trace(config)  # (5)!
    for flag, folder in (("--ledger-dir", config.ledger_dir), ("--snapshot", config.snapshot and config.snapshot.parent)):
        if folder:
            labdist.writable_dir(folder, flag)  # (1)!
    model_config = config.model_config()  # no --dropout: each rank would draw its own masks
    training = dict(seed=config.seed, steps=config.steps, batch_size=config.batch_size, lr=config.lr,
                    adamw=scale.adamw_options(config.adamw, config.fake))
    scale.require_memory(config, model_config, config.batch_size, cli.pick_device(config.device))  # every rank holds it
    with labdist.joined(config.device, config.backend, config.timeout) as (device, backend):  # (2)!
        rank, world = dist.get_rank(), dist.get_world_size()
        build, data = builder(config, device), scale.token_source(config, model_config)
        trained = train(build, data, device, **training, bucket_cap_mb=config.bucket_cap_mb,
                        grad_as_bucket_view=config.grad_as_bucket_view, snapshot=config.snapshot)
        mine = memory_report(trained.timeline, rank, trained.cuda)
        if config.ledger_dir:
            files.write_text(config.ledger_dir / f"rank{rank}.json",
                             json.dumps(mine | {"timeline": trained.timeline.to_dict()}))
        buckets = bucket_report(trained, int(config.bucket_cap_mb * MIB), derive_buckets)
        per_rank = [None] * world
        dist.all_gather_object(per_rank, mine | {"buckets": buckets["buckets"]})
    if rank != 0:
        return None  # (3)!
    reference = None if config.no_reference else compare(
        trained.ddp.module, trained.losses, *single_process_reference(build, data, device, world, **training),
        TOLERANCE)
    result = Result(config, trained, device, backend, buckets, per_rank, reference)
    check_promises(result)  # (4)!
    return result
# --8<-- [end:run]


def trace(config: Config) -> TraceResult:
    """ONE rank (rank 0) of a ``--world-size`` job, in this process: the same ``train`` under the
    fake process group, and with ``--fake`` on fake tensors. No replay, no replicas to compare."""
    device, t0 = torch.device("cpu"), time.perf_counter()
    scale.require_memory(config, config.model_config(), config.batch_size, device)  # --fake: nothing
    adamw = scale.adamw_options(config.adamw, config.fake)
    with fake_world(config.world_size), config.tensors(), scale.values_read_as_zero(config.fake):
        build, data = builder(config, device), scale.token_source(config, config.model_config())
        trained = train(build, data, device, seed=config.seed, steps=config.steps, batch_size=config.batch_size,
                        lr=config.lr, adamw=adamw, bucket_cap_mb=config.bucket_cap_mb,
                        grad_as_bucket_view=config.grad_as_bucket_view)
        shape = [p.numel() for p in trained.ddp.module.parameters()]
        result = TraceResult(config, memory_report(trained.timeline, 0, None),
                             bucket_report(trained, int(config.bucket_cap_mb * MIB), derive_buckets), sum(shape),
                             len(shape), time.perf_counter() - t0)
        del trained  # its DDP holds the process group: it goes before the group does
    return result


def builder(config: Config, device: torch.device):
    """What ``train`` calls to make the model: the lab's TinyGPT or the zoo's, real or fake."""
    return lambda: scale.build_model(config, lambda: TinyGPT(config.model_config()), device)


# ---------------------------------------------------------------------- what the lab derives and checks
def predicted_model_state(tl: Timeline, params: int, tensors: int) -> list[int]:
    """Derived bytes per timeline row: Lab 02's model state (parameters, gradients while alive,
    AdamW state once it has stepped) plus DDP's buckets, 4 B x P from the ``wrap`` phase on."""
    wrap = next(s.start for s in tl.spans if s.name == "wrap")
    return [state + 4 * params * (i >= wrap)
            for i, state in enumerate(lab02.predicted_model_state(tl, params, tensors))]


def check_promises(result: Result) -> None:
    """The lab's two promises. A broken one is not bad input: CheckFailed (exit code 1, not 2),
    carrying the result, so that its numbers are reported before the one line that says so."""
    identical = result.identical
    differ = [k for k, same in identical.items() if k != "before DDP" and not same]
    if differ:
        raise labdist.CheckFailed(f"the replicas are not bit-identical at: {', '.join(differ)}", result)
    ref = result.reference or {}
    over = [f"{k} {ref[k]['ratio']:.1e} (allowed {ref['tolerance'][k]:.0e})"
            for k in ("loss", "grads", "params") if k in ref and not ref[k]["within"]]
    if over:
        raise labdist.CheckFailed(f"DDP differs from one process beyond the stated tolerance: {'; '.join(over)}",
                                  result)


def _per_rank(path: Path | None, rank: int) -> Path | None:
    return None if path is None else path.with_name(f"{path.stem}_rank{rank}{path.suffix}")


if __name__ == "__main__":
    with labdist.one_voice() as voice:  # rank 0 speaks for every rank
        cli.main(Config, voice.ranked(run), report)
