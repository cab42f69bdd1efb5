"""Lab 08 - offload as residency schedules: one toy diffusion pipeline, four ways to place its weights.

    none        every weight resident on the device
    model       whole components move in when they start (text encoder, denoiser, decoder)
    sequential  every module's weights move in for its own forward only
    layerwise   denoiser blocks stream through with a prefetch depth k; encoder/decoder model-level

The engines are in ``offload_engines.py``; here ``install`` places them and ``run_pipeline`` runs the
pipeline. Each mode is then measured twice: once under the memory ledger (the bytes), once without
it, whose dispatch mode costs time on every op (the time per denoising step, the schedule).

``--model flux-dev --fake`` puts the Flux.1-dev transformer (``flux_pipeline.py``) in the denoiser's
place and traces every mode on fake tensors: the bytes a GPU would hold and move, nothing allocated,
no values and no time.

Run it: the commands are in this folder's README.md (and on the lab's page).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn as nn
from flux_pipeline import build_pipeline
from offload_report import report
from offload_engines import LayerwiseOffload, ModelOffload, Resident, SequentialOffload
from pinned_arena import next_pow2

from labkit import budget, cli, fake, labs, marks, provenance, zoo
from labkit.config import MAX_BATCH, MAX_LAYERS, MAX_STEPS, LabConfig, UsageError, option, summary_of
from labkit.cuda import allocator_stats, record_snapshot, reset_peak
from labkit.diffusion import DTYPES, DiffusionShape, ToyDiffusionPipeline
from labkit.ledger import Ledger
from labkit.schedule import Copies, Recorder

MODES = ("none", "model", "sequential", "layerwise")
STAGES = ("encode", "denoise", "decode")


# --8<-- [start:install]
def install(mode: str, pipe: ToyDiffusionPipeline, device, *, prefetch_depth: int = 1, pinned: bool = True,
            encoder_offload: bool = True, decoder_offload: bool = True) -> list:
    """Place the pipeline's weights for ``mode``; returns the handles (remove them in reverse).

    ``mode``: none, model, sequential or layerwise; ``pipe``: the pipeline, built on the host;
    ``device``: where it computes; ``prefetch_depth``: layerwise, blocks copied ahead; ``pinned``:
    host masters in pinned memory; ``encoder_offload``, ``decoder_offload``: layerwise, whether the
    text encoder and the decoder move too (otherwise they stay resident).
    """
    parts = pipe.components()
    if mode == "none":
        return [Resident(parts, device)]
    if mode == "model":
        return [ModelOffload(parts, device, pinned)]  # (1)!
    if mode == "sequential":
        return [SequentialOffload(pipe, device, pinned)]  # (2)!
    blocks = denoiser_blocks(pipe.denoiser)
    handles = [LayerwiseOffload(blocks, device, prefetch_depth, pinned, name="denoiser.blocks")]  # (3)!
    moves = {"text_encoder": encoder_offload, "denoiser": True, "decoder": decoder_offload}
    chain = {name: m for name, m in parts.items() if moves[name]}  # the denoiser: its weights outside the blocks
    handles.append(ModelOffload(chain, device, pinned, skip=[blocks]))  # (4)!
    stay = {name: m for name, m in parts.items() if name not in chain}
    if stay:
        handles.append(Resident(stay, device))
    return handles


def denoiser_blocks(denoiser: nn.Module) -> nn.ModuleList:
    """Every block of every ``ModuleList`` the denoiser holds, in the order they were registered:
    the toy's ``blocks``; Flux's 19 double-stream blocks, then its 38 single-stream ones (as they run)."""
    lists = [child for child in denoiser.children() if isinstance(child, nn.ModuleList)]
    return nn.ModuleList(block for blocks in lists for block in blocks)
# --8<-- [end:install]


# --8<-- [start:run]
def run_pipeline(pipe: ToyDiffusionPipeline, handles: list, prompt, noise) -> torch.Tensor:
    """encode -> T denoising steps -> decode, with the weights wherever ``handles`` put them."""
    with marks.phase("encode"):
        text = pipe.encode(prompt)
    latents = noise
    for step in range(pipe.cfg.steps):
        with marks.phase("denoise", step):
            latents = pipe.denoise_step(latents, text, step)
    for handle in handles:
        handle.drop_prefetched()  # (1)!
    with marks.phase("decode"):
        return pipe.decode(latents)
# --8<-- [end:run]


@dataclass
class Config(DiffusionShape, LabConfig):
    """Run a toy diffusion pipeline under each offload engine and measure it."""

    mode: Literal["none", "model", "sequential", "layerwise", "all"] = option(
        "all", "the placement to measure against all-resident (all: every one)")
    prefetch_depth: int = option(1, "layerwise: blocks copied ahead", min=0, max=MAX_LAYERS)
    pinned: Literal["auto", "on", "off"] = option("auto", "pinned host masters (auto: on when CUDA is present)")
    encoder_offload: Literal["on", "off"] = option("on", "layerwise: the text encoder moves too (off: resident)")
    decoder_offload: Literal["on", "off"] = option("on", "layerwise: the decoder moves too (off: resident)")
    batch: int = option(1, "prompts per pipeline run", min=1, max=MAX_BATCH)
    repeats: int = option(4, "timed pipeline runs per mode; the first warms up", min=1, max=MAX_STEPS)
    threads: int = option(1, "CPU threads for the timed runs (0: PyTorch's default, one per core). One: with more "
                          "threads than free cores, a step can stall for about a second", min=0, max=4096)
    snapshot: Path | None = option(None, "CUDA only: write a memory_viz history pickle here", path="write")
    model: Literal["toy", "flux-dev", "small-flux"] = option(
        "toy", "the denoiser: toy (this lab's pipeline, from the shape flags) or a zoo Flux transformer "
        "(flux-dev: Flux.1-dev, 11.9 B; small-flux: its toy twin), whose shape replaces --width, --heads, "
        "--denoiser-layers, --text-layers and --decoder-layers")
    fake: bool = option(False, "trace on fake tensors: every byte held and moved is counted (rounded like "
                        "the CUDA allocator), nothing is allocated; no values, no time, no pinning")

    def __post_init__(self) -> None:
        super().__post_init__()
        blocks = self.denoiser_blocks()
        if self.mode in ("layerwise", "all") and self.prefetch_depth >= blocks:
            raise UsageError(f"--prefetch-depth {self.prefetch_depth} is too deep for {blocks} denoiser "
                             f"blocks: at most {blocks - 1} (every other block) can be ahead")
        if self.pinned == "on" and (self.fake or not torch.cuda.is_available()):
            raise UsageError("--pinned on needs a CUDA driver (pinned memory is page-locked for DMA), "
                             "and a trace on fake tensors pins nothing")
        if self.fake and self.device == "cuda":
            raise UsageError("--fake traces on this machine's CPU dispatch; leave --device at cpu or auto")

    def model_spec(self) -> zoo.ModelSpec | None:
        """The zoo's Flux ``--model`` names; None for the toy pipeline."""
        return None if self.model == "toy" else zoo.get(self.model)

    def denoiser_blocks(self) -> int:
        """Blocks in the denoiser: ``--denoiser-layers``, or the Flux's double- and single-stream blocks."""
        spec = self.model_spec()
        return self.denoiser_layers if spec is None else spec.layers + spec.single_layers

    def tensors(self):
        """Where the run happens: ``fake.tensors()`` with ``--fake``, else nothing special."""
        return fake.tensors() if self.fake else contextlib.nullcontext()


def run(config: Config) -> Result:
    device = torch.device("cpu") if config.fake else cli.pick_device(config.device)
    if config.snapshot and device.type != "cuda":
        raise UsageError("--snapshot needs a CUDA device (memory history is a CUDA allocator feature)")
    modes = MODES if config.mode == "all" else dict.fromkeys(("none", config.mode))  # none: the reference
    e, spec = torch.finfo(DTYPES[config.dtype]).bits // 8, config.model_spec()
    weights, what = ((spec.param_count(), f"{spec.name}: {spec.param_count():,}") if spec else  # 16 w^2 per block
                     (16 * config.width**2 * config.denoiser_layers, f"16 x {config.width}^2 x {config.denoiser_layers} blocks"))
    if not config.fake:  # every denoiser weight, at least once (a trace allocates nothing)
        budget.require(weights * e, device, f"{what} weights x {e} B")
    runs, t0 = [], time.perf_counter()
    with record_snapshot(config.snapshot), config.tensors():
        for mode in cli.progress(modes, total=len(modes), desc="modes"):
            runs.append(run_mode(mode, config, device, runs[0].output if runs else None))
    shown = [r for r in runs if config.mode in ("all", r.mode)]
    return Result(config, device, shown, time.perf_counter() - t0)


# ---------------------------------------------------------------------- measuring one mode
@dataclass
class ModeRun:
    mode: str
    output: torch.Tensor  # the pipeline's output
    ledger: Ledger  # the run under the ledger: phases install, encode, denoise, decode, remove
    schedule: Recorder  # the last timed run's transfers and computes
    summary: dict


def run_mode(mode: str, config: Config, device, reference: torch.Tensor | None = None) -> ModeRun:
    """Measure ``mode`` twice over: bytes under the memory ledger, time without it.

    ``mode``: one of MODES; ``config``: the pipeline's size and the engines' options; ``device``: a
    torch.device; ``reference``: the all-resident output to compare with (default: this output).
    One pipeline run under the ledger gives the bytes; then a fresh install runs ``config.repeats``
    times (the first warms up) with no ledger, for the step time and the schedule's timings.
    """
    ledger = Ledger(device)
    output, counted = measure_bytes(mode, config, device, ledger)
    if config.fake:  # traced on fake tensors: bytes, no values, no time
        timed_output, schedule, step_ms, cuda = output, None, None, None
    else:
        timed_output, schedule, step_ms, cuda = measure_time(mode, config, device)
    reference = output if reference is None else reference
    tl = ledger.timeline()
    stage_peak = {s: sum(peak.values()) for s, peak in tl.peaks_by_phase().items() if s in STAGES}
    every_component = mode in ("model", "sequential")  # the text encoder and the decoder move too
    summary = {"mode": mode, "prefetch_depth": config.prefetch_depth if mode == "layerwise" else None,
               "encoder_offload": every_component or mode == "layerwise" and config.encoder_offload == "on",
               "decoder_offload": every_component or mode == "layerwise" and config.decoder_offload == "on",
               "peak_device_bytes": max(stage_peak.values()), "peak_device_bytes_by_stage": stage_peak,
               "peak_host_copy_bytes": max(tl.host["host_copies"], default=0),  # the ledger's count
               **counted, "denoiser_blocks": config.denoiser_blocks(),
               "max_memory_allocated": cuda["max_memory_allocated"] if cuda else None,
               "step_ms": step_ms and statistics.median(step_ms),  # from the runs without the ledger
               "step_ms_range": step_ms and [min(step_ms), max(step_ms)],
               "max_abs_diff": None if config.fake else max((out.float() - reference.float()).abs().max().item()
                                                            for out in (output, timed_output))}
    return ModeRun(mode, output, ledger, schedule, summary)


def measure_bytes(mode: str, config: Config, device, ledger: Ledger) -> tuple[torch.Tensor, dict]:
    """One pipeline run under ``ledger``; also counted from outside: the denoiser blocks on the
    device whenever a block module starts, the bytes copied out of and into the host masters, and
    the bytes the engines mark as moved in, per denoising step.

    With ``config.fake`` (inside ``config.tensors()``) the copies are not counted: ``Copies`` knows
    the host buffers by address, and a fake storage has none. The engines' marks count what moved in.
    """
    pipe = build_pipeline(config)  # built on the host, as from a checkpoint
    prompt, noise = pipe.inputs(config.seed, device)
    ledger.track_module(pipe).track([prompt, noise], "other")
    with torch.no_grad(), ledger, installed(mode, pipe, device, config) as handles:
        host = [chunk for h in handles for chunk in h.host_buffers()]
        ledger.track(host, "host_copies")  # the arenas' chunks: host memory, labelled from outside
        copies = None if config.fake else Copies(host)
        with (BlockCount(denoiser_blocks(pipe.denoiser), handles) as blocks, Recorder(device) as marked,
              copies or contextlib.nullcontext()):
            output = run_pipeline(pipe, handles, prompt, noise)
        by_step = h2d_by_step(marked)
        arenas = [h.arena for h in handles if h.arena is not None]
        return output, {
            "pinned": any(h.pinned for h in handles),
            "always_resident": sorted(name for h in handles if isinstance(h, Resident) for name in h.names),
            "host_bytes": sum(a.nbytes for a in arenas),  # the arenas' chunks: pinned on a GPU
            "host_weight_bytes": sum(a.unit_bytes for a in arenas),  # what the masters hold
            "host_bytes_one_buffer_per_unit": sum(next_pow2(size) for a in arenas for size in a.sizes),
            "max_resident_blocks": blocks.most, "h2d_bytes_by_step": by_step,
            "h2d_bytes": copies.out_of if copies else sum(s["h2d_bytes"] for s in marked.stage_summary().values()),
            "d2h_bytes": copies.into if copies else None}


def h2d_by_step(schedule: Recorder, stage: str = "denoise") -> list[int]:
    """Bytes the engines marked as moved in during each span of ``stage`` (one span per denoising step)."""
    steps, inside = [], False
    for m in schedule.marks:
        if m.unit == stage and m.kind in ("stage_start", "stage_end"):
            inside = m.kind == "stage_start"
            steps += [0] if inside else []
        elif inside and m.kind in ("prefetch_start", "transfer_start"):
            steps[-1] += m.nbytes
    return steps


def measure_time(mode: str, config: Config, device) -> tuple[torch.Tensor, Recorder, list[float], dict | None]:
    """``config.repeats`` pipeline runs with no ledger: the output, the last run's schedule, the
    milliseconds of every denoising step of the warm runs, the allocator's counters (CUDA)."""
    pipe = build_pipeline(config)
    prompt, noise = pipe.inputs(config.seed, device)
    step_ms, threads = [], torch.get_num_threads()
    if device.type == "cpu":
        cli.cpu_threads(config.threads)  # 0: PyTorch's own count, one per core
    try:
        with torch.no_grad(), installed(mode, pipe, device, config) as handles:
            reset_peak(device)
            for run_index in range(config.repeats):
                with Recorder(device) as schedule:  # its exit waits for the device
                    output = run_pipeline(pipe, handles, prompt, noise)
                if run_index or config.repeats == 1:  # the first run warms up
                    step_ms += schedule.stage_spans("denoise")
            cuda = allocator_stats(device)
    finally:
        torch.set_num_threads(threads)
    return output, schedule, step_ms, cuda


@contextlib.contextmanager
def installed(mode: str, pipe, device, config: Config):
    """``install`` in the phase ``install``; removed, in reverse, in the phase ``remove``."""
    with marks.phase("install"):
        handles = install(mode, pipe, device, prefetch_depth=config.prefetch_depth,
                          pinned=config.pinned == "on" or (config.pinned == "auto" and device.type == "cuda"),
                          encoder_offload=config.encoder_offload == "on", decoder_offload=config.decoder_offload == "on")
    try:
        yield handles
    finally:
        with marks.phase("remove"):
            for handle in reversed(handles):
                handle.remove()


class BlockCount:
    """The most denoiser blocks on the device (prefetched ones too) when a block module starts."""

    def __init__(self, blocks, handles: list) -> None:
        streaming = next((h for h in handles if isinstance(h, LayerwiseOffload)), None)
        self.now = streaming.resident if streaming else lambda: sum(any(p.numel() for p in b.parameters())
                                                                    for b in blocks)
        self.most, self.hooks = 0, [m.register_forward_pre_hook(self.seen) for m in blocks.modules()]

    def seen(self, *_) -> None:
        self.most = max(self.most, self.now())

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for hook in self.hooks:
            hook.remove()


# ---------------------------------------------------------------------- the result and its report
@dataclass
class Result:
    config: Config
    device: torch.device
    runs: list[ModeRun]
    wall_time_s: float

    def summary(self) -> dict:
        return {"lab": labs.slug(__file__), "device": str(self.device), "config": summary_of(self.config),
                "modes": [r.summary for r in self.runs],
                "provenance": provenance.collect(__file__, self.device, self.wall_time_s)}


if __name__ == "__main__":
    cli.main(Config, run, report)
