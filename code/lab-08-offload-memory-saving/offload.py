"""Lab 08 - offload as residency schedules: one toy diffusion pipeline, four ways to place its weights.

    none        every weight resident on the device
    model       whole components move in when they start (text encoder, denoiser, decoder)
    sequential  every module's weights move in for its own forward only
    layerwise   denoiser blocks stream through with a prefetch depth k; encoder/decoder model-level

Each mode runs twice: once under the labkit memory ledger, for peak device bytes, the host bytes
the masters take, how many denoiser blocks were resident at once and the bytes moved each way;
then again without the ledger (its dispatch mode costs time on every op) for the time per
denoising step and the schedule's timings (plus max_memory_allocated on CUDA). Both runs report
the largest difference from the all-resident output.

Run it:
    python code/lab-08-offload-memory-saving/offload.py --mode all --device cpu
    python code/lab-08-offload-memory-saving/offload.py --mode layerwise --prefetch-depth 2 --json
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # makes code/labkit importable
sys.path.insert(0, str(Path(__file__).resolve().parent))  # and the engines next to this file

import torch  # noqa: E402

from labkit import Ledger, UsageError, emit_json, lab_parser, pick_device, progress, provenance, run_lab  # noqa: E402
from labkit.ledger import NullLedger  # noqa: E402
from labkit.cli import non_negative_int, positive_int  # noqa: E402
from labkit.cuda import allocator_stats, record_snapshot, reset_peak  # noqa: E402
from labkit.diffusion import DTYPES, DiffusionConfig, ToyDiffusionPipeline  # noqa: E402
from labkit.plot import format_bytes  # noqa: E402
from labkit.schedule import Recorder  # noqa: E402
from offload_engines import LayerwiseOffload, ModelOffload, Resident, SequentialOffload  # noqa: E402
from pinned_arena import next_pow2  # noqa: E402

LAB = "lab-08-offload-memory-saving"
MODES = ("none", "model", "sequential", "layerwise")
STAGES = ("encode", "denoise", "decode")


def parse_args(argv=None):
    p = lab_parser("Run a toy diffusion pipeline under each offload engine and measure it.")
    p.add_argument("--mode", choices=[*MODES, "all"], default="all")
    p.add_argument("--prefetch-depth", type=non_negative_int, default=1, help="layerwise: blocks copied ahead")
    p.add_argument("--pinned", choices=["auto", "on", "off"], default="auto",
                   help="pinned host masters (auto: on when CUDA is present)")
    p.add_argument("--encoder-offload", choices=["on", "off"], default="on", help="layerwise mode only")
    p.add_argument("--decoder-offload", choices=["on", "off"], default="on", help="layerwise mode only")
    p.add_argument("--width", type=positive_int, default=128)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--denoiser-layers", type=positive_int, default=8)
    p.add_argument("--text-layers", type=positive_int, default=2)
    p.add_argument("--decoder-layers", type=positive_int, default=2)
    p.add_argument("--latent-tokens", type=positive_int, default=64)
    p.add_argument("--text-len", type=positive_int, default=16)
    p.add_argument("--steps", type=positive_int, default=3, help="denoising steps")
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--repeats", type=positive_int, default=2, help="pipeline runs per mode; the first warms up")
    p.add_argument("--snapshot", type=Path, help="CUDA only: dump a memory-history pickle for memory_viz")
    args = p.parse_args(argv)
    if args.width % args.heads:
        raise UsageError(f"--width {args.width} is not divisible by --heads {args.heads}")
    if args.mode in ("layerwise", "all") and args.prefetch_depth >= args.denoiser_layers:
        raise UsageError(f"--prefetch-depth {args.prefetch_depth} is too deep for {args.denoiser_layers} denoiser "
                         f"blocks: at most {args.denoiser_layers - 1} (every other block) can be ahead")
    if args.pinned == "on" and not torch.cuda.is_available():
        raise UsageError("--pinned on needs a CUDA driver (pinned memory is page-locked for DMA)")
    return args


def config(args) -> DiffusionConfig:
    return DiffusionConfig(width=args.width, heads=args.heads, text_len=args.text_len, text_layers=args.text_layers,
                           latent_tokens=args.latent_tokens, denoiser_layers=args.denoiser_layers,
                           decoder_layers=args.decoder_layers, steps=args.steps, batch=args.batch, dtype=args.dtype)


# --8<-- [start:install]
def install(mode: str, pipe: ToyDiffusionPipeline, device, args, tag, recorder, phase=None) -> list:
    """Place the pipeline's weights for ``mode``; returns handles (remove in reverse)."""
    pinned = args.pinned == "on" or (args.pinned == "auto" and device.type == "cuda")
    parts = pipe.components()
    kw = {"tag": tag, "recorder": recorder} | ({"phase": phase} if phase else {})
    if mode == "none":
        return [Resident(parts, device, tag)]
    if mode == "model":
        return [ModelOffload(parts, device, pinned, **kw)]  # (1)!
    if mode == "sequential":
        return [SequentialOffload(pipe, device, pinned, **kw)]  # (2)!
    blocks, k = pipe.denoiser.blocks, args.prefetch_depth
    handles = [LayerwiseOffload(blocks, device, k, pinned, name="denoiser.blocks", **kw)]  # (3)!
    chain = {"denoiser": parts["denoiser"]}  # its few weights outside the blocks
    if args.encoder_offload == "on":
        chain = {"text_encoder": parts["text_encoder"], **chain}
    if args.decoder_offload == "on":
        chain["decoder"] = parts["decoder"]
    handles.append(ModelOffload(chain, device, pinned, skip=[blocks], **kw))  # (4)!
    stay = {name: m for name, m in parts.items() if name not in chain}
    if stay:
        handles.append(Resident(stay, device, tag))
    return handles
# --8<-- [end:install]


# --8<-- [start:run]
def run_pipeline(pipe, handles, prompt, noise, ledger: Ledger, recorder: Recorder):
    """encode -> T denoising steps -> decode; returns the output, the loop's seconds."""
    with ledger.phase("encode"), recorder.stage("encode"):
        text = pipe.encode(prompt)
    sync(noise.device)
    t0 = time.perf_counter()
    latents = noise
    with recorder.stage("denoise"):
        for step in range(pipe.cfg.steps):
            with ledger.phase("denoise", step):
                latents = pipe.denoise_step(latents, text, step)
        sync(noise.device)
        denoise_s = time.perf_counter() - t0
        for handle in handles:
            handle.settle()  # (1)!
    with ledger.phase("decode"), recorder.stage("decode"):
        image = pipe.decode(latents)
    return image, denoise_s
# --8<-- [end:run]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def resident_blocks(blocks, handles) -> int:
    """Denoiser blocks with weights on the device right now (prefetched ones included)."""
    for h in handles:
        if isinstance(h, LayerwiseOffload):
            return h.resident()
    return sum(any(p.numel() for p in b.parameters()) for b in blocks)


@dataclass
class ModeRun:
    mode: str
    output: torch.Tensor
    ledger: Ledger
    recorder: Recorder
    summary: dict


def session(mode: str, args, device: torch.device, ledger, repeats: int, probe: bool = True) -> dict:
    """Install ``mode``, run the pipeline ``repeats`` times, remove; what one session saw."""
    pipe = ToyDiffusionPipeline(config(args), seed=args.seed)  # built on the host, as from a checkpoint
    prompt, noise = pipe.inputs(args.seed, device)
    ledger.track_module(pipe).track([prompt, noise], "other")
    blocks = pipe.denoiser.blocks
    with torch.no_grad(), ledger:
        with ledger.phase("install"):
            handles = install(mode, pipe, device, args, ledger.category, None, ledger.phase)
        most = [0]
        probes = [m.register_forward_pre_hook(lambda *_: most.__setitem__(0, max(most[0], resident_blocks(blocks, handles))))
                  for m in (blocks.modules() if probe else ())]
        reset_peak(device)
        runs = []
        for _ in range(repeats):
            recorder = Recorder(device)  # keep the last (warm) run's schedule
            for h in handles:
                h.recorder = recorder
            h2d_before = sum(h.h2d_bytes for h in handles)
            output, denoise_s = run_pipeline(pipe, handles, prompt, noise, ledger, recorder)
            sync(device)
            runs.append((denoise_s, sum(h.h2d_bytes for h in handles) - h2d_before))
        cuda = allocator_stats(device)
        arenas = [h.arena for h in handles if h.arena is not None]
        facts = {"prefetch_depth": handles[0].k if mode == "layerwise" else None,
                 "pinned": any(h.pinned for h in handles),
                 "always_resident": sorted(name for h in handles if isinstance(h, Resident) for name in h.names),
                 "host_bytes": sum(a.nbytes for a in arenas), "host_weight_bytes": sum(a.unit_bytes for a in arenas),
                 "host_bytes_one_buffer_per_unit": sum(next_pow2(s) for a in arenas for s in a.sizes),
                 "d2h_bytes": sum(h.d2h_bytes for h in handles)}
        for p in probes:
            p.remove()
        with ledger.phase("remove"):
            for h in reversed(handles):
                h.remove()
    recorder.finish()
    warm = runs[1:] or runs
    return facts | {"output": output, "recorder": recorder, "most": most[0], "cuda": cuda, "blocks": len(blocks),
                    "h2d_bytes": runs[-1][1], "step_ms": 1e3 * sum(r[0] for r in warm) / len(warm) / args.steps}


def run_mode(mode: str, args, device: torch.device, reference: torch.Tensor | None = None,
             ledger_on: bool = True) -> ModeRun:
    """Measure ``mode`` twice over: bytes under the memory ledger, time without it.

    The ledger's dispatch mode costs time on every op, so no time is taken while it runs: one
    pipeline run under the ledger gives the bytes, then a fresh install runs ``args.repeats``
    times (the first warms up) without it for the step time, the schedule's timings and, on CUDA,
    ``max_memory_allocated``. ``ledger_on=False`` (the benchmark) skips the ledger run.
    """
    t_start = time.perf_counter()
    ledger = Ledger(device) if ledger_on else NullLedger(device)
    mem = session(mode, args, device, ledger, repeats=1) if ledger_on else None
    timed = session(mode, args, device, NullLedger(device), args.repeats, probe=not ledger_on)
    bytes_run = mem or timed
    reference = bytes_run["output"] if reference is None else reference
    if ledger_on:
        peaks = ledger.peaks_by_phase()
        stage_peak = {s: sum(peaks[s].values()) for s in STAGES}
        host_peak = max(ledger.timeline().host["host_copies"], default=0)
    else:
        stage_peak, host_peak = {s: None for s in STAGES}, None
    summary = {
        "mode": mode,
        "prefetch_depth": bytes_run["prefetch_depth"],
        "pinned": bytes_run["pinned"],
        "encoder_offload": mode in ("model", "sequential") or (mode == "layerwise" and args.encoder_offload == "on"),
        "decoder_offload": mode in ("model", "sequential") or (mode == "layerwise" and args.decoder_offload == "on"),
        "always_resident": bytes_run["always_resident"],
        "peak_device_bytes": max(stage_peak.values()) if ledger_on else None,
        "peak_device_bytes_by_stage": stage_peak,
        "peak_host_copy_bytes": host_peak,  # the ledger's count of the host masters' memory
        "host_bytes": bytes_run["host_bytes"],  # the arenas' chunks: pinned on a GPU machine
        "host_weight_bytes": bytes_run["host_weight_bytes"],  # what the host masters hold
        "host_bytes_one_buffer_per_unit": bytes_run["host_bytes_one_buffer_per_unit"],  # pinned one by one
        "max_memory_allocated": timed["cuda"]["max_memory_allocated"] if timed["cuda"] else None,
        "max_resident_blocks": bytes_run["most"],
        "denoiser_blocks": bytes_run["blocks"],
        "h2d_bytes": bytes_run["h2d_bytes"],
        "d2h_bytes": bytes_run["d2h_bytes"],
        "step_ms": timed["step_ms"],  # from the run without the ledger
        "max_abs_diff": max((r["output"].float() - reference.float()).abs().max().item() for r in (bytes_run, timed)),
        "provenance": provenance.collect(LAB, device, time.perf_counter() - t_start),
    }
    return ModeRun(mode, bytes_run["output"], ledger, timed["recorder"], summary)


def run_all(args) -> list[ModeRun]:
    device = pick_device(args.device)
    if args.snapshot and device.type != "cuda":
        raise UsageError("--snapshot needs a CUDA device (memory history is a CUDA allocator feature)")
    modes = MODES if args.mode == "all" else ("none", args.mode) if args.mode != "none" else ("none",)
    runs: list[ModeRun] = []
    with record_snapshot(args.snapshot):
        for mode in progress(modes, total=len(modes), desc="modes", quiet=args.json):
            runs.append(run_mode(mode, args, device, runs[0].output if runs else None))
    return runs if args.mode in ("all", "none") else runs[1:]


def report(runs: list[ModeRun], args) -> dict:
    return {"lab": LAB, "config": config(args).__dict__, "modes": [r.summary for r in runs]}


def main(argv=None) -> None:
    args = parse_args(argv)
    runs = run_all(args)
    if args.json:
        emit_json(report(runs, args))
        return
    device = runs[0].summary["provenance"]["device_type"]
    print(f"Lab 08 on {device}: {args.denoiser_layers}-block denoiser, {args.steps} steps, width {args.width}, "
          f"{args.dtype}{' (CPU: times are CPU times, transfers are memcpy)' if device == 'cpu' else ''}")
    print(f"{'mode':<11}{'peak device':>13}{'host masters':>14}{'resident blocks':>17}{'H2D / run':>12}{'D2H':>6}"
          f"{'ms / step':>11}{'max |diff|':>12}")
    for r in runs:
        s = r.summary
        name = s["mode"] + (f" k={s['prefetch_depth']}" if s["prefetch_depth"] is not None else "")
        print(f"{name:<11}{format_bytes(s['peak_device_bytes']):>13}{format_bytes(s['host_bytes']):>14}"
              f"{s['max_resident_blocks']:>11} of {s['denoiser_blocks']:<3}{format_bytes(s['h2d_bytes']):>12}"
              f"{s['d2h_bytes']:>6}{s['step_ms']:>11.2f}{s['max_abs_diff']:>12.2e}")
    print("host masters: the arenas' power-of-two chunks (pinned on a GPU); ms / step: a second run, "
          "without the memory ledger")
    if args.snapshot:
        print(f"memory history written to {args.snapshot} (open it at https://pytorch.org/memory_viz)")


if __name__ == "__main__":
    run_lab(main)
