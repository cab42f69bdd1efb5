"""Lab 11 - FSDP for inference: weights sharded across ranks, gathered block by block, shards on the host.

Every rank (torchrun) runs Lab 08's toy diffusion pipeline on its own prompt. FSDP2's fully_shard
splits every weight into N shards, one unit per denoiser block (and one each for the text encoder,
the rest of the denoiser and the decoder). Before a unit runs, each rank sends its shard and
receives the others' (all-gather); after it ran, the gathered weights are freed. With
``CPUOffloadPolicy`` the shards live in host memory and each rank copies only its own shard to the
device for the all-gather.

Measured per rank: peak device bytes, host bytes, bytes through the all-gathers, host-to-device
bytes (a GPU run; on CPU they are derived), and the output against the unsharded pipeline. Rank 0
also runs Lab 08's single-device engines on the same pipeline (``offload.py``: all resident, and
layerwise offload with prefetch) for the comparison.

Run it (gloo on CPU; on CUDA, NCCL with one GPU per rank, gloo when ranks share a GPU):
    torchrun --nproc_per_node=2 code/lab-11-zero-fsdp/fsdp_inference.py --device cpu
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE), str(HERE.parent / "lab-08-offload-memory-saving")]  # labkit, bench, Lab 08

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard, register_fsdp_forward_method  # noqa: E402

import offload as lab08  # noqa: E402  (Lab 08's starter: run_mode, the single-device engines)
from labkit import Ledger, UsageError, emit_json, lab_parser, provenance, run_lab  # noqa: E402
from labkit.cli import non_negative_int, positive_int  # noqa: E402
from labkit.cuda import allocator_stats, reset_peak  # noqa: E402
from labkit.diffusion import DTYPES, DiffusionConfig, ToyDiffusionPipeline, param_bytes  # noqa: E402
from labkit.dist import CheckFailed, ranked, start  # noqa: E402
from labkit.plot import format_bytes  # noqa: E402
from ranks import Traffic, gather, local  # noqa: E402

LAB = "lab-11-zero-fsdp"
PLACEMENTS = ("sharded", "sharded+offload")
SHAPE = ("width", "heads", "denoiser_layers", "text_layers", "decoder_layers", "latent_tokens", "text_len", "steps")
OUTPUT_ATOL = 1e-5  # gathered weights are bit-identical; only reduction order could differ (float32)


# --8<-- [start:config]
def parse_args(argv=None):
    p = lab_parser("Sharded inference with FSDP2 (and CPU offload of the shards) against Lab 08's single device.")
    p.add_argument("--placement", choices=[*PLACEMENTS, "both"], default="both",
                   help="sharded: shards on the device; sharded+offload: shards in host memory")
    p.add_argument("--width", type=positive_int, default=64)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--denoiser-layers", type=positive_int, default=6)
    p.add_argument("--text-layers", type=positive_int, default=2)
    p.add_argument("--decoder-layers", type=positive_int, default=2)
    p.add_argument("--latent-tokens", type=positive_int, default=64)
    p.add_argument("--text-len", type=positive_int, default=16)
    p.add_argument("--steps", type=positive_int, default=2, help="denoising steps")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--prefetch-depth", type=non_negative_int, default=1, help="Lab 08's layerwise offload")
    p.add_argument("--timelines", action="store_true", help="--json: add rank 0's ledger timelines")
    args = p.parse_args(argv)
    if args.width % args.heads:
        raise UsageError(f"--width {args.width} is not divisible by --heads {args.heads}")
    args.placements = PLACEMENTS if args.placement == "both" else (args.placement,)
    return args
# --8<-- [end:config]


def config(args) -> DiffusionConfig:
    return DiffusionConfig(**{k: getattr(args, k) for k in SHAPE}, dtype=args.dtype)


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
def generate(pipe, prompt, noise, ledger: Ledger) -> torch.Tensor:
    """encode -> T denoising steps -> decode, each unit gathered just before it runs."""
    with torch.no_grad():
        with ledger.phase("encode"):
            text = pipe.encode(prompt)  # (1)!
        latents = noise
        for step in range(pipe.cfg.steps):
            with ledger.phase("denoise", step):
                latents = pipe.denoise_step(latents, text, step)  # (2)!
        with ledger.phase("decode"):
            return pipe.decode(latents)
# --8<-- [end:generate]


# --8<-- [start:run]
def run_placement(placement: str, args, device, mesh, rank: int) -> dict:
    cfg = config(args)
    plain = ToyDiffusionPipeline(cfg, seed=args.seed)
    prompt, noise = plain.inputs(args.seed + rank, device)  # (1)!
    with torch.no_grad():
        reference = plain.to(device)(prompt, noise)  # the same pipeline unsharded, all resident
    del plain
    pipe = shard(ToyDiffusionPipeline(cfg, seed=args.seed), mesh, offload=placement == "sharded+offload")
    shards = [local(p) for p in pipe.parameters()]
    ledger = Ledger(device)
    ledger.track(shards, "host_copies" if placement == "sharded+offload" else "parameters")  # (2)!
    ledger.track([prompt, noise], "other")
    traffic = Traffic(ledger)
    reset_peak(device)
    t0 = time.perf_counter()
    with ledger, traffic:
        image = generate(pipe, prompt, noise, ledger)
    gathers = traffic.summary()["collectives"].get("_allgather_base_", {"calls": 0, "in_bytes": 0, "out_bytes": 0})
    tl = ledger.timeline()
    return {"placement": placement, "peak_device": ledger.peak(tl), "peak_host": max(tl.host_total(), default=0),
            "shard_bytes": sum({id(s.untyped_storage()): s.untyped_storage().nbytes() for s in shards}.values()),
            "all_gathers": gathers["calls"], "sent_bytes": gathers["in_bytes"],  # (3)!
            "gathered_bytes": gathers["out_bytes"], "h2d_bytes_measured": traffic.h2d_bytes,
            "max_abs_diff": (image.float() - reference.float()).abs().max().item(),
            "cuda": allocator_stats(device), "wall_time_s": time.perf_counter() - t0,
            "timeline": tl.to_dict() if rank == 0 and args.timelines else None}
# --8<-- [end:run]


def single_device(args, device) -> dict:
    """Rank 0 only: Lab 08's engines on one device, the same pipeline and the same (rank 0) inputs."""
    shape = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in SHAPE]
    a08 = lab08.parse_args([*shape, f"--dtype={args.dtype}", f"--seed={args.seed}", "--repeats=1",
                            f"--prefetch-depth={args.prefetch_depth}", f"--device={device.type}"])
    none = lab08.run_mode("none", a08, device)
    layerwise = lab08.run_mode("layerwise", a08, device, none.output)
    keep = ("mode", "prefetch_depth", "peak_device_bytes", "peak_host_copy_bytes", "h2d_bytes", "max_resident_blocks",
            "max_abs_diff")
    out = {r.mode: {k: r.summary[k] for k in keep} for r in (none, layerwise)}
    if args.timelines:
        out["layerwise"]["timeline"] = layerwise.ledger.timeline().window("encode", "denoise", "decode").to_dict()
    return out


def infer(args) -> dict:
    device, _ = start("code/lab-11-zero-fsdp/fsdp_inference.py", args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    t0 = time.perf_counter()
    placements = {}
    for placement in args.placements:
        placements[placement] = gather(run_placement(placement, args, device, mesh, rank))  # (collective)
    lab08_runs = single_device(args, device) if rank == 0 else None
    dist.barrier()
    pipe = ToyDiffusionPipeline(config(args), seed=args.seed)
    weights = {name: param_bytes(m) for name, m in pipe.components().items()}
    weights["denoiser_block"] = param_bytes(pipe.denoiser.blocks[0])
    return {"lab": LAB, "device": str(device), "backend": dist.get_backend(), "world_size": world, "rank": rank,
            "config": config(args).__dict__, "weight_bytes": weights, "output_atol": OUTPUT_ATOL,
            "placements": placements, "lab08": lab08_runs,
            "provenance": provenance.collect(LAB, device, time.perf_counter() - t0)}


def print_report(result: dict) -> None:
    w, n = result["weight_bytes"], result["world_size"]
    total = sum(v for k, v in w.items() if k != "denoiser_block")
    print(f"Lab 11 inference on {result['device']} ({result['backend']}, {n} ranks): weights "
          f"{format_bytes(total)}, one denoiser block {format_bytes(w['denoiser_block'])}, "
          f"{result['config']['steps']} denoising steps, one prompt per rank")
    print(f"{'placement':<26}{'rank':>5}{'peak device':>13}{'host':>11}{'own shard':>11}{'sent':>11}"
          f"{'received':>11}{'H2D':>11}{'max |diff|':>12}")
    for placement, ranks in result["placements"].items():
        for r, m in enumerate(ranks):
            offload = placement == "sharded+offload"
            h2d = m["h2d_bytes_measured"] if result["device"] != "cpu" else (m["sent_bytes"] if offload else 0)
            print(f"{placement:<26}{r:>5}{format_bytes(m['peak_device']['total']):>13}{format_bytes(m['peak_host']):>11}"
                  f"{format_bytes(m['shard_bytes']):>11}{format_bytes(m['sent_bytes']):>11}"
                  f"{format_bytes(m['gathered_bytes'] - m['sent_bytes']):>11}{format_bytes(h2d):>11}"
                  f"{m['max_abs_diff']:>12.1e}")
    for mode, s in result["lab08"].items():
        name = f"Lab 08 {mode}" + (f" (k={s['prefetch_depth']})" if s["prefetch_depth"] is not None else "")
        print(f"{name:<26}{0:>5}{format_bytes(s['peak_device_bytes']):>13}{format_bytes(s['peak_host_copy_bytes']):>11}"
              f"{'-':>11}{'-':>11}{'-':>11}{format_bytes(s['h2d_bytes']):>11}{s['max_abs_diff']:>12.1e}")
    if result["device"] == "cpu":
        print("(CPU: the device is host RAM, so no byte crosses a bus; H2D of sharded+offload is derived: "
              "each rank's shard goes to the device before it is sent)")


def check(result: dict) -> None:
    """Sharding must not change the image beyond the stated tolerance. Checked after the report, so
    the numbers are on screen; a broken tolerance is not bad input: one line and exit code 1, not 2."""
    for placement, ranks in result["placements"].items():
        worst = max(m["max_abs_diff"] for m in ranks)
        if not worst <= OUTPUT_ATOL:  # also catches NaN
            raise CheckFailed(f"{placement}: the output differs from the unsharded pipeline by {worst:.1e} "
                              f"(allowed {OUTPUT_ATOL:.0e})")


def main(argv=None) -> None:
    args = parse_args(argv)
    result = infer(args)
    if result["rank"] == 0:
        emit_json(result) if args.json else print_report(result)
        check(result)


if __name__ == "__main__":
    run_lab(ranked(main))
