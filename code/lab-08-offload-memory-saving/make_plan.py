"""Lab 08 - the offload plan: the toy pipeline's residency schedule, written from a real run.

    .venv/bin/python code/lab-08-offload-memory-saving/make_plan.py --device cpu --repeats 1
    .venv/bin/python code/lab-08-offload-memory-saving/make_plan.py --prefetch-depth 2 --out /tmp/plan.md

It runs every mode of offload.py on the default pipeline and writes ``offload_plan.md``: per mode
and per pipeline stage, who was on the device, what stayed on the host, the bytes moved in and the
time that took, and the peak device bytes. Never edit the plan by hand: run this.

Also here, the plan's arithmetic: what the engines hold (``flat_bytes``) and the peak a layerwise
placement should reach at a prefetch depth (``predicted_denoise_peak``), which the notebook draws
against the measurement.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import offload
import torch
from offload_engines import HostMaster

from labkit import cli, files
from labkit.config import MAX_LAYERS, MAX_STEPS, LabConfig, option
from labkit.diffusion import ToyDiffusionPipeline
from labkit.provenance import describe
from labkit.table import Table, format_bytes

HERE = Path(__file__).resolve().parent
BLOCK = "denoiser.blocks."


def schedule_table(run: offload.ModeRun, steps: int) -> Table:
    """One row per pipeline stage: who was on the device, what stayed on the host, what moved."""
    s = run.summary
    residency = run.schedule.residency(lambda unit: "blocks" if unit.startswith(BLOCK) else "modules")
    moved = run.schedule.stage_summary()
    rows = []
    for stage in offload.STAGES:
        seen = residency.get(stage, {"seen": [], "most_at_once": {}})
        m = moved.get(stage, {"h2d_bytes": 0, "transfer_ms": 0.0})
        rows.append([f"denoise ({steps} steps)" if stage == "denoise" else stage, on_device(seen, s), on_host(seen, s),
                     m["h2d_bytes"], m["transfer_ms"], s["peak_device_bytes_by_stage"][stage]])
    return Table(["stage", "on the device", "only on the host", ("host to device", "bytes"),
                  ("transfer time (ms)", "float:2"), ("peak device bytes", "bytes")], rows)


def on_device(stage: dict, s: dict) -> str:
    """Who was on the device during a stage, in the order they arrived."""
    mode, n = s["mode"], s["denoiser_blocks"]
    if mode == "none":
        return "everything, resident"
    seen, most = stage["seen"], stage["most_at_once"]
    if mode == "sequential":
        return f"{len(seen)} modules pass through, at most {most.get('modules', 0)} at once" if seen else "nothing"
    parts = [("denoiser (outside the blocks)" if u == "denoiser" and mode == "layerwise" else u)
             for u in seen if not u.startswith(BLOCK)]
    text = " then ".join(parts)
    blocks = sum(u.startswith(BLOCK) for u in seen)
    if blocks:
        text += f"{'; ' if text else ''}{blocks} of {n} blocks pass through, at most {most['blocks']} at once"
    resident = ", ".join(s["always_resident"])
    return text + (f"; resident: {resident}" if resident else "") if text else (resident or "nothing")


def on_host(stage: dict, s: dict) -> str:
    """The components whose weights never reached the device during the stage."""
    if s["mode"] == "none":
        return "nothing"
    if s["mode"] == "sequential":
        return "all weights, except the module running"
    here = set(stage["seen"]) | set(s["always_resident"])
    parts = [("denoiser (outside the blocks)" if c == "denoiser" and s["mode"] == "layerwise" else c)
             for c in ("text_encoder", "denoiser", "decoder") if c not in here]
    blocks = sum(u.startswith(BLOCK) for u in stage["seen"])
    if s["mode"] == "layerwise" and blocks < s["denoiser_blocks"]:
        parts.append(f"{s['denoiser_blocks'] - blocks} of {s['denoiser_blocks']} blocks")
    return ", ".join(parts) or "nothing"


def flat_bytes(config: offload.Config) -> dict[str, int]:
    """The pipeline's weights as the engines hold them: one denoiser block's flat buffer, the
    denoiser's weights outside its blocks in one flat buffer, the text encoder and decoder as they
    are (resident). Built on the meta device: no memory."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):  # the pipeline seeds itself
        pipe = ToyDiffusionPipeline(config.pipeline())
    in_blocks = {id(p) for p in pipe.denoiser.blocks.parameters()}
    return {"block": HostMaster.plan(list(pipe.denoiser.blocks[0].parameters()))[1],
            "shell": HostMaster.plan([p for p in pipe.denoiser.parameters() if id(p) not in in_blocks])[1],
            "encoder_decoder": sum(p.numel() * p.element_size() for m in (pipe.text_encoder, pipe.decoder)
                                   for p in m.parameters())}


def predicted_denoise_peak(config: offload.Config, depth: int, resident_run: offload.ModeRun) -> int:
    """Derived peak device bytes while denoising, layerwise at prefetch depth ``depth`` with the text
    encoder and decoder resident: their weights, the denoiser's weights outside the blocks, ``depth +
    1`` block buffers, and what ``resident_run`` (mode none) measured besides weights while denoising."""
    size, tl = flat_bytes(config), resident_run.ledger.timeline().window("denoise")
    rest = max(sum(tl.device[c][i] for c in ("activations", "temporaries", "other")) for i in range(len(tl)))
    return size["encoder_decoder"] + size["shell"] + (depth + 1) * size["block"] + rest


@dataclass
class Config(LabConfig):
    """Write the offload plan: every mode's residency schedule, from a run of offload.py."""

    out: Path | None = option(None, "where to write the plan (default: offload_plan.md next to this script)",
                              path="write")
    prefetch_depth: int = option(1, "layerwise: blocks copied ahead", min=0, max=MAX_LAYERS)
    repeats: int = option(2, "timed pipeline runs per mode; the first warms up", min=1, max=MAX_STEPS)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.lab_config()  # offload.py's own rules (a prefetch depth below the denoiser's blocks)

    def lab_config(self) -> offload.Config:
        return offload.Config(mode="all", prefetch_depth=self.prefetch_depth, repeats=self.repeats,
                              device=self.device, seed=self.seed)


@dataclass
class Plan:
    path: Path
    result: offload.Result

    def summary(self) -> dict:
        return self.result.summary() | {"plan": str(self.path)}


def run(config: Config) -> Plan:
    path = files.check_writable(config.out or HERE / "offload_plan.md", "--out")  # before the run, not after it
    result = offload.run(config.lab_config())
    files.write_text(path, plan_text(result) + "\n")
    return Plan(path, result)


def plan_text(result: offload.Result) -> str:
    c = result.config
    out = ["# Offload plan: the toy pipeline as a residency schedule", "",
           "<!-- Generated by make_plan.py from a real run. Do not edit by hand: run the script. -->", "",
           f"Pipeline: text encoder ({c.text_layers} blocks) -> denoiser ({c.denoiser_layers} blocks, {c.steps} steps) "
           f"-> decoder; width {c.width}, {c.dtype}, layerwise prefetch depth {c.prefetch_depth}. "
           f"Measured: {describe(result.summary()['provenance'])}.", "",
           "Bytes come from a run under the memory ledger; transfer times from a second run without it "
           "(the ledger's dispatch mode costs time on every op).", ""]
    if result.device.type != "cuda":
        out += ["On a CPU-only machine the \"device\" and the host are the same RAM: the bytes are exact "
                "(the ledger tells the two sides apart), the transfer times are memcpy times, not PCIe.", ""]
    for run in result.runs:
        s = run.summary
        title = s["mode"] + (f" (prefetch depth {s['prefetch_depth']})" if s["prefetch_depth"] is not None else "")
        out += [f"## {title}", "", schedule_table(run, c.steps).markdown(), "",
                f"Peak device bytes {format_bytes(s['peak_device_bytes'])}; at most {s['max_resident_blocks']} of "
                f"{s['denoiser_blocks']} denoiser blocks resident; {format_bytes(s['h2d_bytes'])} host to device "
                f"and {s['d2h_bytes']} B device to host per pipeline run"
                + (f"; host masters {format_bytes(s['host_bytes'])} (power-of-two arena chunks) for "
                   f"{format_bytes(s['host_weight_bytes'])} of weights." if s["host_weight_bytes"] else "."), ""]
    return "\n".join(out).rstrip("\n")


def report(plan: Plan) -> None:
    print(f"wrote {plan.path}")


if __name__ == "__main__":
    cli.main(Config, run, report)
