"""Lab 11 - FSDP for inference: weights sharded across ranks, gathered block by block, shards on the host.

Every rank (torchrun) runs Lab 08's toy diffusion pipeline on its own prompt. FSDP2's fully_shard
splits every weight into N shards, one unit per denoiser block (and one each for the text encoder,
the rest of the denoiser and the decoder). Before a unit runs, each rank sends its shard and
receives the others' (all-gather); after it ran, the gathered weights are freed. With
``CPUOffloadPolicy`` the shards live in host memory and each rank copies only its own shard to the
device for the all-gather.

Measured per rank: peak device bytes, host bytes, bytes through the all-gathers, host-to-device
bytes (a GPU run; on CPU they are derived), and the output against the unsharded pipeline. Rank 0
then runs Lab 08's single-device engines on the same pipeline (all resident, and layerwise offload
with prefetch) for the comparison. The tables and the report are in ``inference_report.py``.

Run it (it starts two ranks itself, --nproc-per-node N for more, or runs under torchrun; gloo on
CPU; on CUDA, NCCL with one GPU per rank, gloo when ranks share a GPU):
    .venv/bin/python code/lab-11-zero-fsdp/fsdp_inference.py --device cpu
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard, register_fsdp_forward_method

from inference_report import Result, report
from labkit import cli, labs, marks
from labkit import dist as labdist
from labkit.config import MAX_LAYERS, MAX_SECONDS, MAX_STEPS, MAX_WIDTH, LabConfig, option
from labkit.cuda import allocator_stats, reset_peak
from labkit.diffusion import DiffusionConfig, DiffusionShape, ToyDiffusionPipeline, param_bytes
from labkit.ledger import Ledger
from labkit.traffic import Traffic

lab08 = labs.load(8)  # run_mode: Lab 08's single-device engines, measured on the same pipeline

PLACEMENTS = ("sharded", "sharded+offload")
OUTPUT_ATOL = 1e-5  # gathered weights are bit-identical; only reduction order could differ (float32)


# --8<-- [start:shard]
def shard(pipe: ToyDiffusionPipeline, mesh, offload: bool) -> ToyDiffusionPipeline:
    """One FSDP unit per denoiser block, one per component for the rest; the pipeline is the root."""
    policy = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload else OffloadPolicy()  # (1)!
    for block in pipe.denoiser.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True, offload_policy=policy)  # (2)!
    for part in pipe.components().values():
        fully_shard(part, mesh=mesh, reshard_after_forward=True, offload_policy=policy)  # (3)!
    fully_shard(pipe, mesh=mesh, offload_policy=policy)  # (4)!
    for method in ("encode", "denoise_step", "decode"):
        register_fsdp_forward_method(pipe, method)  # (5)!
    return pipe
# --8<-- [end:shard]


# --8<-- [start:generate]
def generate(pipe, prompt, noise) -> torch.Tensor:
    """encode -> T denoising steps -> decode, each unit gathered just before it runs."""
    with torch.no_grad():
        with marks.phase("encode"):
            text = pipe.encode(prompt)  # (1)!
        latents = noise
        for step in range(pipe.cfg.steps):
            with marks.phase("denoise", step):
                latents = pipe.denoise_step(latents, text, step)  # (2)!
        with marks.phase("decode"):
            return pipe.decode(latents)
# --8<-- [end:generate]


# --8<-- [start:run]
def run_placement(placement: str, pipeline: DiffusionConfig, device: torch.device, mesh, *, seed: int):
    """This rank's image with the weights sharded (``placement``: sharded, or sharded+offload),
    under its own ledger and traffic counter; returns what it measured and the ledger's timeline.

    ``pipeline``: the pipeline's shape; ``device``: this rank's; ``mesh``: every rank;
    ``seed``: the weights' (the same on every rank), and ``seed + rank`` this rank's prompt."""
    plain = ToyDiffusionPipeline(pipeline, seed=seed)
    prompt, noise = plain.inputs(seed + dist.get_rank(), device)  # (1)!
    with torch.no_grad():
        reference = plain.to(device)(prompt, noise)  # the same pipeline unsharded, all resident
    del plain
    offload = placement == "sharded+offload"
    pipe = shard(ToyDiffusionPipeline(pipeline, seed=seed), mesh, offload)
    shards = [p.to_local() for p in pipe.parameters()]  # this rank's part of every weight
    ledger = Ledger(device)
    ledger.track(shards, "host_copies" if offload else "parameters")  # (2)!
    ledger.track([prompt, noise], "other")
    reset_peak(device)
    t0 = time.perf_counter()
    with ledger, Traffic() as traffic:
        image = generate(pipe, prompt, noise)
    gathers = traffic.summary()["collectives"].get("_allgather_base_", {"calls": 0, "in_bytes": 0, "out_bytes": 0})
    tl = ledger.timeline()
    return {"placement": placement, "peak_device": tl.peak(), "peak_host": max(tl.host_total(), default=0),
            "shard_bytes": sum({id(s.untyped_storage()): s.untyped_storage().nbytes() for s in shards}.values()),
            "all_gathers": gathers["calls"], "sent_bytes": gathers["in_bytes"],  # (3)!
            "gathered_bytes": gathers["out_bytes"], "h2d_bytes_measured": traffic.h2d_bytes,
            "max_abs_diff": (image.float() - reference.float()).abs().max().item(),
            "cuda": allocator_stats(device), "wall_time_s": time.perf_counter() - t0}, tl
# --8<-- [end:run]


@dataclass
class Config(labdist.Ranks, DiffusionShape, LabConfig):
    """Sharded inference with FSDP2 (and CPU offload of the shards) against Lab 08's single device."""

    timeout: int = option(60, "seconds a rank waits for the others before the job fails (PyTorch: 30 min)",
                          min=1, max=MAX_SECONDS)
    placement: Literal["sharded", "sharded+offload", "both"] = option(
        "both", "sharded: shards on the device; sharded+offload: shards in host memory; both: each")
    width: int = option(64, "model width", min=1, max=MAX_WIDTH)
    denoiser_layers: int = option(6, "denoiser blocks", min=1, max=MAX_LAYERS)
    steps: int = option(2, "denoising steps", min=1, max=MAX_STEPS)
    prefetch_depth: int = option(1, "Lab 08's layerwise offload: blocks copied ahead", min=0, max=MAX_LAYERS)
    timelines: bool = option(False, "add rank 0's ledger timelines (each placement, Lab 08 layerwise) to the result")

    def __post_init__(self) -> None:
        super().__post_init__()
        cli.pick_device(self.device)  # refuses cuda without a GPU; launches nothing
        self.lab08_config()  # Lab 08's rules too (--prefetch-depth), before any rank joins

    @property
    def placements(self) -> tuple[str, ...]:
        return PLACEMENTS if self.placement == "both" else (self.placement,)

    def lab08_config(self):
        """Lab 08's Config for the same pipeline, inputs and prefetch depth (one timed run)."""
        return lab08.Config(mode="layerwise", repeats=1, prefetch_depth=self.prefetch_depth, device=self.device,
                            seed=self.seed, **self.shape())


def run(config: Config) -> Result | None:
    """Every rank generates its image in each placement; rank 0 gathers what every rank measured,
    then runs Lab 08's engines on one device. The other ranks return None."""
    t0, timelines = time.perf_counter(), {}
    with labdist.joined(config.device, timeout_s=config.timeout) as (device, backend):
        rank, world = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh(device.type, (world,))
        placements = {}
        for placement in config.placements:
            measured, tl = run_placement(placement, config.pipeline(), device, mesh, seed=config.seed)
            placements[placement] = [None] * world
            dist.all_gather_object(placements[placement], measured)  # every rank's numbers, in rank order
            timelines[placement] = tl
    if rank != 0:
        return None
    lab08_runs, layerwise = single_device(config, device)
    timelines["lab08 layerwise"] = layerwise.window("encode", "denoise", "decode")
    pipe = ToyDiffusionPipeline(config.pipeline(), seed=config.seed)
    weights = {name: param_bytes(m) for name, m in pipe.components().items()}
    weights["denoiser_block"] = param_bytes(pipe.denoiser.blocks[0])
    result = Result(config, device, backend, world, weights, OUTPUT_ATOL, placements, lab08_runs,
                    {k: tl.to_dict() for k, tl in timelines.items()} if config.timelines else None,
                    time.perf_counter() - t0)
    check_promises(result)
    return result


def single_device(config: Config, device: torch.device):
    """Lab 08's engines on one device, the same pipeline and rank 0's inputs: all resident, then
    layerwise offload against it. Returns each mode's numbers and the layerwise ledger's timeline."""
    c08 = config.lab08_config()
    resident = lab08.run_mode("none", c08, device)
    layerwise = lab08.run_mode("layerwise", c08, device, resident.output)
    keep = ("mode", "prefetch_depth", "peak_device_bytes", "peak_host_copy_bytes", "h2d_bytes", "max_resident_blocks",
            "max_abs_diff")
    return {r.summary["mode"]: {k: r.summary[k] for k in keep} for r in (resident, layerwise)}, layerwise.ledger.timeline()


def check_promises(result: Result) -> None:
    """Sharding must not change the image beyond ``OUTPUT_ATOL``. A broken promise is not bad input:
    ``CheckFailed`` (exit code 1, not 2), carrying the result, reported before the one line."""
    for placement, ranks in result.placements.items():
        worst = max(m["max_abs_diff"] for m in ranks)
        if not worst <= OUTPUT_ATOL:  # also catches NaN
            raise labdist.CheckFailed(f"{placement}: the output differs from the unsharded pipeline by {worst:.1e} "
                                      f"(allowed {OUTPUT_ATOL:.0e})", result)


if __name__ == "__main__":
    with labdist.one_voice() as voice:  # rank 0 speaks for every rank
        cli.main(Config, voice.ranked(run), report)
