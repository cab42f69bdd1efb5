"""Offload benchmark: Lab 08's engines side by side in one run, with the public baselines.

    .venv/bin/python bench/offload_bench.py --device cuda                    # writes results/offload_bench.json
    .venv/bin/python bench/offload_bench.py --device cpu --out /tmp/b.json   # a smoke run; CPU times only

One process measures, on the same pipeline and the same inputs:
1. host-to-device and device-to-host copy bandwidth, pinned and pageable (CUDA only): the physical
   limit every transfer below is compared with;
2. the denoising step time and peak memory of every mode (none, model, sequential, layerwise at
   several prefetch depths), and of accelerate's ``cpu_offload`` and diffusers' group offloading
   on the same denoiser when those packages are installed (skipped with a note otherwise);
3. a sweep of the denoiser's width, so the report shows where the per-block transfer time
   (one block's bytes over the measured pinned bandwidth) overtakes the per-block compute time and
   prefetching can no longer hide the copy: the ``crossover`` field names that width.

Everything is reported as ratios against the all-resident run of the same process, with the
provenance record. Each mode is Lab 08's ``run_mode``: its bytes from a run under the memory ledger,
its times from runs without it (the ledger's dispatch mode costs time per op); the sweep takes only
the timed runs (``measure_time``). Peak memory comes from ``torch.cuda.max_memory_allocated`` on CUDA.
"""

import importlib.util
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from labkit import files, cli, labs, provenance
from labkit.config import (
    MAX_BYTES, MAX_HEADS, MAX_LAYERS, MAX_STEPS, MAX_TOKENS, MAX_WIDTH, LabConfig, UsageError, option, summary_of,
)
from labkit.cuda import allocator_stats, reset_peak
from labkit.diffusion import DTYPES, DenoiserBlock, ToyDiffusionPipeline
from labkit.provenance import REPO_ROOT
from labkit.table import format_bytes

lab08 = labs.load(8)
HostMaster = labs.load(8, "offload_engines").HostMaster

BENCH = "offload"
RESULT_FILE = "results/offload_bench.json"  # the GPU run; a CPU run writes results/offload_bench.cpu.json


@dataclass
class Config(LabConfig):
    """Benchmark Lab 08's offload engines against resident, accelerate and diffusers."""

    width: int | None = option(None, "default: 1024 on CUDA, 64 on CPU", min=1, max=MAX_WIDTH)
    heads: int | None = option(None, "default: 16 on CUDA, 4 on CPU", min=1, max=MAX_HEADS)
    denoiser_layers: int | None = option(None, "default: 16 on CUDA, 6 on CPU", min=1, max=MAX_LAYERS)
    latent_tokens: int | None = option(None, "default: 4096 on CUDA, 64 on CPU", min=1, max=MAX_TOKENS)
    steps: int | None = option(None, "denoising steps (default: 4 on CUDA, 2 on CPU)", min=1, max=MAX_STEPS)
    dtype: Literal["float32", "bfloat16", "float16"] | None = option(None, "default: bfloat16 on CUDA, float32 on CPU")
    depths: tuple[int, ...] = option((0, 1, 2), "layerwise prefetch depths, comma separated", min=0, max=MAX_LAYERS)
    sweep_widths: tuple[int, ...] | None = option(None, "widths for the crossover sweep (default: 512,1024,2048,4096 "
                                                        "on CUDA, 32,64 on CPU)", min=1, max=MAX_WIDTH)
    copy_mib: int = option(256, "bytes per copy in the bandwidth test (MiB)", min=1, max=MAX_BYTES >> 20)
    repeats: int = option(3, "timed pipeline runs per mode; the first warms up", min=1, max=MAX_STEPS)
    out: Path | None = option(None, "default: results/offload_bench.json on CUDA, results/offload_bench.cpu.json "
                                    "on CPU", path="write")

    def __post_init__(self) -> None:
        super().__post_init__()
        device = cli.pick_device(self.device)
        lab_config(self, device)  # Lab 08's rules on these sizes, before anything runs
        for w in self.sweep_widths or ():
            try:
                lab_config(self, device, width=w, heads=sweep_heads(w))
            except UsageError as err:
                raise UsageError(f"--sweep-widths {w}: the sweep gives it {sweep_heads(w)} heads (width / 64), "
                                 f"and Lab 08 says: {err}") from None


def sweep_heads(width: int) -> int:
    """The crossover sweep's attention heads at ``width``: one per 64 dimensions, as at GPU size."""
    return max(1, width // 64)


def lab_config(config: Config, device: torch.device, **over) -> lab08.Config:
    """Lab 08's Config for this benchmark's sizes (GPU-sized on CUDA, tiny on CPU), the denoiser alone
    offloaded (the text encoder and decoder stay resident)."""
    gpu = device.type == "cuda"
    size = {"width": config.width or (1024 if gpu else 64), "heads": config.heads or (16 if gpu else 4),
            "denoiser_layers": config.denoiser_layers or (16 if gpu else 6),
            "latent_tokens": config.latent_tokens or (4096 if gpu else 64), "steps": config.steps or (4 if gpu else 2),
            "dtype": config.dtype or ("bfloat16" if gpu else "float32")} | over
    return lab08.Config(device=device.type, repeats=config.repeats, seed=config.seed, mode="layerwise",
                        encoder_offload="off", decoder_offload="off", **size)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------ 1. the physical limit
def copy_bandwidth(device: torch.device, mib: int, repeats: int) -> dict | None:
    """GB/s of host-to-device and device-to-host copies, pinned and pageable (CUDA only)."""
    if device.type != "cuda":
        return None
    n = mib << 20
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    out = {"bytes": n}
    for kind in ("pinned", "pageable"):
        host = torch.empty(n, dtype=torch.uint8, pin_memory=kind == "pinned")
        for direction in ("h2d", "d2h"):
            src, dst = (host, dev) if direction == "h2d" else (dev, host)
            dst.copy_(src, non_blocking=kind == "pinned")  # warm up
            torch.cuda.synchronize(device)
            times = []
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src, non_blocking=kind == "pinned")
                end.record()
                torch.cuda.synchronize(device)
                times.append(start.elapsed_time(end) / 1e3)
            out[f"{direction}_{kind}_gbps"] = n / min(times) / 1e9
    return out


# ------------------------------------------------------------------ 2. modes and baselines
def time_external(kind: str, config, device: torch.device) -> dict:
    """accelerate's cpu_offload or diffusers' group offloading on the denoiser, same pipeline."""
    if importlib.util.find_spec(kind) is None:
        return {"mode": kind, "skipped": f"{kind} is not installed (optional dependency)"}
    pipe = ToyDiffusionPipeline(config.pipeline(), seed=config.seed)
    pipe.text_encoder.to(device)
    pipe.decoder.to(device)
    try:
        if kind == "accelerate":
            from accelerate import cpu_offload

            cpu_offload(pipe.denoiser, execution_device=device)
            label = "accelerate cpu_offload (sequential, synchronous)"
        else:
            from diffusers.hooks import apply_group_offloading

            for p in pipe.denoiser.parameters():  # group offloading expects the module on the offload device
                p.data = p.data.to("cpu")
            apply_group_offloading(pipe.denoiser, onload_device=device, offload_device=torch.device("cpu"),
                                   offload_type="block_level", num_blocks_per_group=1, use_stream=device.type == "cuda")
            label = "diffusers group offloading (block level" + (", stream)" if device.type == "cuda" else ")")
    except Exception as err:  # an API that moved between versions is a note, not a crash
        return {"mode": kind, "skipped": f"{kind} could not be applied: {type(err).__name__}: {err}"}
    prompt, noise = pipe.inputs(config.seed, device)
    timed = time_denoise(pipe, prompt, noise, device, config.repeats)
    with torch.no_grad():
        timed["output"] = pipe.decode(timed["output"])  # the pipeline's output, as the modes report it
    return {"mode": kind, "label": label, **timed}


def time_denoise(pipe, prompt, noise, device, repeats: int) -> dict:
    with torch.no_grad():
        text = pipe.encode(prompt)
        reset_peak(device)
        times, out = [], None
        for r in range(repeats + 1):  # the first run warms up
            latents = noise
            sync(device)
            t0 = time.perf_counter()
            for step in range(pipe.cfg.steps):
                latents = pipe.denoise_step(latents, text, step)
            sync(device)
            if r:
                times.append(time.perf_counter() - t0)
            out = latents
    stats = allocator_stats(device)
    return {"step_ms": 1e3 * min(times) / pipe.cfg.steps, "max_memory_allocated": stats and stats["max_memory_allocated"],
            "output": out}


def mode_rows(config: Config, device) -> list[dict]:
    rows = []
    reference = None
    plan = [("none", None), ("model", None), ("sequential", None)] + [("layerwise", k) for k in config.depths]
    for mode, depth in cli.progress(plan, total=len(plan), desc="modes"):
        a = lab_config(config, device, **({"prefetch_depth": depth} if depth is not None else {}))
        run = lab08.run_mode(mode, a, device, reference)
        reference = run.output if reference is None else reference
        s = run.summary
        rows.append({"mode": mode if depth is None else f"layerwise k={depth}", "step_ms": s["step_ms"],
                     "max_memory_allocated": s["max_memory_allocated"], "max_resident_blocks": s["max_resident_blocks"],
                     "h2d_bytes": s["h2d_bytes"], "max_abs_diff": s["max_abs_diff"],
                     "transfer_ms": run.schedule.bar_ms(kind="transfer"), "overlap_ms": run.schedule.overlap_ms()})
    base = lab_config(config, device)
    for kind in ("accelerate", "diffusers"):
        r = time_external(kind, base, device)
        if "output" in r:
            r["max_abs_diff"] = (r.pop("output").float() - reference.float()).abs().max().item()
        rows.append(r)
    return rows


# ------------------------------------------------------------------ 3. the crossover sweep
def block_bytes(config: lab08.Config) -> int:
    """One denoiser block's flat host buffer, from the block itself (built on the meta device: no memory)."""
    with torch.device("meta"):
        block = DenoiserBlock(config.width, config.heads).to(DTYPES[config.dtype])
    return HostMaster.plan(list(block.parameters()))[1]


def crossover(config: Config, device, bandwidth: dict | None) -> tuple[list[dict], dict]:
    """Per width: per-block compute time (resident) against per-block copy time, and the overhead.
    Times only: Lab 08's timed runs, no ledger run."""
    widths = config.sweep_widths or ((512, 1024, 2048, 4096) if device.type == "cuda" else (32, 64))
    rows = []
    for w in cli.progress(widths, total=len(widths), desc="sweep"):
        a = lab_config(config, device, width=w, heads=sweep_heads(w))
        resident_ms = statistics.median(lab08.measure_time("none", a, device)[2])  # median warm step
        layerwise_ms = statistics.median(lab08.measure_time("layerwise", a, device)[2])
        blocks = a.denoiser_layers
        rows.append({"width": w, "block_bytes": block_bytes(a), "compute_ms_per_block": resident_ms / blocks,
                     "step_ms_resident": resident_ms, "step_ms_layerwise": layerwise_ms,
                     "overhead": layerwise_ms / resident_ms - 1})
    return rows, find_crossover(rows, bandwidth)


def find_crossover(rows: list[dict], bandwidth: dict | None) -> dict:
    """The first width whose block takes longer to copy (at the measured pinned bandwidth) than to
    compute: from there on prefetching cannot hide the copy. Adds each row's copy time."""
    found = {"width": None, "copy_ms_per_block": None, "compute_ms_per_block": None,
             "rule": "the first width whose block copy (block bytes / measured pinned H2D bandwidth) takes "
                     "longer than its compute (resident step time / blocks)"}
    if not bandwidth:
        return found | {"note": "no host-device link measured (CPU run): no crossover"}
    for r in rows:
        r["copy_ms_per_block"] = r["block_bytes"] / (bandwidth["h2d_pinned_gbps"] * 1e9) * 1e3
        r["copy_bound"] = r["copy_ms_per_block"] > r["compute_ms_per_block"]
        if r["copy_bound"] and found["width"] is None:
            found |= {k: r[k] for k in ("width", "copy_ms_per_block", "compute_ms_per_block")}
    if found["width"] is None:
        found["note"] = "every width swept was compute-bound: the crossover lies above the widest"
    return found


def summary_rows(modes: list[dict], bandwidth: dict | None) -> list[dict]:
    """The headline ratios for the performance page, each with the target it is held to."""
    by = {r["mode"]: r for r in modes if "step_ms" in r}
    rows = []

    def add(metric, value, unit, target=None):
        rows.append({"metric": metric, "value": value, "unit": unit, "target": target, "lab": labs.slug(8)})

    best = min((m for m in by if m.startswith("layerwise")), key=lambda m: by[m]["step_ms"], default=None)
    if best:
        add(f"{best}: step time against all-resident", by[best]["step_ms"] / by["none"]["step_ms"], "x", "<= 1.03")
        add(f"sequential step time against {best}", by["sequential"]["step_ms"] / by[best]["step_ms"], "x", ">= 5")
        if "diffusers" in by:
            add(f"{best} step time against diffusers group offloading", by[best]["step_ms"] / by["diffusers"]["step_ms"],
                "x", "< 1")
        if by[best].get("peak_vs_resident"):
            add(f"{best}: peak memory against all-resident", by[best]["peak_vs_resident"], "x", None)
        if by[best].get("fraction_of_pinned_bandwidth"):
            add(f"{best}: transfer bandwidth / measured pinned bandwidth", by[best]["fraction_of_pinned_bandwidth"],
                "fraction", ">= 0.90")
    if bandwidth:
        add("pinned host-to-device bandwidth", bandwidth["h2d_pinned_gbps"], "GB/s")
        add("pageable host-to-device bandwidth", bandwidth["h2d_pageable_gbps"], "GB/s")
    return rows


@dataclass
class Result:
    path: Path  # where the run was written
    record: dict  # its provenance
    config: dict  # Lab 08's Config at this benchmark's sizes
    bandwidth: dict | None  # the link (CUDA)
    modes: list[dict]  # every mode and baseline, against all-resident
    sweep: list[dict]  # per width: compute and copy time per block
    crossover: dict

    def summary(self) -> dict:
        """What the results file holds, and what --json prints."""
        return {"provenance": self.record, "bench": BENCH, "config": self.config, "bandwidth": self.bandwidth,
                "modes": self.modes, "sweep": self.sweep, "crossover": self.crossover,
                "summary_rows": summary_rows(self.modes, self.bandwidth),
                "note": None if self.record["device_type"] == "cuda" else "CPU run: times are CPU times and "
                "transfers are memcpy; no GPU speed or bandwidth claim comes from it"}


def run(config: Config) -> Result:
    device = cli.pick_device(config.device)
    layers = lab_config(config, device).denoiser_layers
    if max(config.depths) >= layers:
        raise UsageError(f"--depths: a prefetch depth must be below the {layers} denoiser blocks")
    path = config.out or REPO_ROOT / (RESULT_FILE if device.type == "cuda" else RESULT_FILE.replace(".json", ".cpu.json"))
    files.check_writable(path, "--out")  # before the run, not after it
    t0 = time.perf_counter()
    bandwidth = copy_bandwidth(device, config.copy_mib, config.repeats)
    modes = mode_rows(config, device)
    base = next(r for r in modes if r["mode"] == "none")
    for r in modes:
        if "step_ms" in r:
            r["step_time_vs_resident"] = r["step_ms"] / base["step_ms"]
            if r.get("max_memory_allocated") and base.get("max_memory_allocated"):
                r["peak_vs_resident"] = r["max_memory_allocated"] / base["max_memory_allocated"]
            if bandwidth and r.get("transfer_ms"):
                achieved = r["h2d_bytes"] / (r["transfer_ms"] / 1e3) / 1e9
                r["achieved_h2d_gbps"] = achieved
                r["fraction_of_pinned_bandwidth"] = achieved / bandwidth["h2d_pinned_gbps"]
    sweep, found = crossover(config, device, bandwidth)
    result = Result(path, provenance.collect(8, device, time.perf_counter() - t0),
                    summary_of(lab_config(config, device)), bandwidth, modes, sweep, found)
    provenance.write_results(path, {k: v for k, v in result.summary().items() if k != "provenance"}, result.record)
    return result


def report(result: Result) -> None:
    print(f"offload benchmark on {result.record['device_name']} -> {result.path}")
    if result.bandwidth:
        print("copy bandwidth (GB/s): " + ", ".join(f"{k[:-5]} {v:.1f}" for k, v in result.bandwidth.items()
                                                    if k.endswith("gbps")))
    for r in result.modes:
        if "skipped" in r:
            print(f"  {r['mode']:<16} skipped: {r['skipped']}")
            continue
        mem = format_bytes(r["max_memory_allocated"]) if r.get("max_memory_allocated") else "-"
        print(f"  {r['mode']:<16} {r['step_ms']:9.2f} ms/step  x{r['step_time_vs_resident']:.2f}  peak {mem}")
    for r in result.sweep:
        extra = f", copy {r['copy_ms_per_block']:.3f} ms/block" if "copy_ms_per_block" in r else ""
        print(f"  width {r['width']:>5}: compute {r['compute_ms_per_block']:.3f} ms/block{extra}, "
              f"layerwise overhead {100 * r['overhead']:+.1f}%")
    found = result.crossover
    print(f"  crossover: width {found['width']}" if found["width"] else f"  crossover: none ({found['note']})")


if __name__ == "__main__":
    cli.main(Config, run, report)
