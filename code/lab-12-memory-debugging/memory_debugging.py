"""Lab 12 - memory debugging: leaks through held references, fragmentation, an OOM message read.

    leak-losses       the loop keeps every loss as a tensor; the monitoring loss, computed with
                      autograd on, pins its whole graph (fix: torch.no_grad(), then loss.item())
    leak-activations  a forward hook keeps each block's output "for debugging" (fix: keep a number)
    fixed             all the fixes: flat from step to step, and no graph outlives its step
    fragmentation     allocated against reserved, with and without expandable_segments (on a CPU,
                      simulated by Lab 16's model of the caching allocator)
    oom               torch.OutOfMemoryError caught and its message read line by line (on a CPU, the
                      message Lab 16's model gives)

The loop pauses after every step; the memory ledger (stacks=True) then says what is alive, by the
line that allocated it and the line of this file that called the model, and, from its record,
what was alive at the run's peak. The CUDA scenarios live in cuda_scenarios.py, the OOM reader in
oom_reader.py. ``--model llama-3-8b --fake`` runs the loops on the zoo's Llama-3-8B, traced on fake
tensors (bytes, no values, no time). Run it:
    .venv/bin/python code/lab-12-memory-debugging/memory_debugging.py --device cpu --scenario leak-losses --top 10
    .venv/bin/python code/lab-12-memory-debugging/memory_debugging.py --device cuda --scenario oom
    .venv/bin/python code/lab-12-memory-debugging/memory_debugging.py --model llama-3-8b --fake --seq-len 4096 \
        --batch-size 1 --precision bf16 --scenario fixed --steps 2
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

import cuda_scenarios
from labkit import cli, labs, marks, provenance, stacks
from leak_report import report
from real_scale import live_at_peak, numbers, shape_of, tensors, training_setup
from labkit.config import MAX_BATCH, MAX_BYTES, MAX_COUNT, MAX_LAYERS, MAX_LR, MAX_STEPS, LabConfig, UsageError, option
from labkit.cuda import allocator_stats, record_snapshot, reset_peak
from labkit.ledger import Ledger
from labkit.models import GPTConfig, TinyGPTShape
from labkit.scale import RealScale
from labkit.timeline import Timeline

toy_gpt = labs.load(1, "toy_gpt")  # Lab 01: every tensor TinyGPT saves for backward, counted

LEAKS = {"leak-losses": "losses", "leak-activations": "activations", "fixed": None}
ALLOCATOR = ("fragmentation", "oom")  # measured on a GPU, simulated on a CPU


# --8<-- [start:loop]
def training_loop(model, optimizer, data, val, steps: int, batch_size: int, leak: str | None = None,
                  bf16: bool = False):
    """Train ``steps`` steps of ``batch_size`` sequences from ``data`` (a SyntheticTokens), each
    followed by a monitoring loss on the held-out batch ``val``; yield what the loop keeps after each.

    ``leak``: ``"losses"`` keeps both losses as tensors, the monitoring one computed with autograd
    on; ``"activations"`` keeps every block's output from a forward hook; None keeps numbers only.
    ``bf16``: each forward under ``torch.autocast`` to bfloat16 (weights and optimizer stay fp32).
    """
    losses, debug = [], []  # what the loop keeps from one step to the next
    autocast = functools.partial(torch.autocast, val[0].device.type, dtype=torch.bfloat16, enabled=bf16)

    def capture(block, inputs, output):  # a forward hook, "for debugging"
        if block.training:
            debug.append(output if leak == "activations" else output.detach().abs().mean().item())  # (1)!

    hooks = [block.register_forward_hook(capture) for block in model.blocks]
    try:
        for step in range(steps):
            x, y = data.batch(step, batch_size, val[0].device)
            with marks.phase("forward", step), autocast():
                loss = model(x, y)[1]
            with marks.phase("backward", step):
                loss.backward()  # (2)!
            with marks.phase("optimizer", step):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            with marks.phase("forward", step):  # monitoring: the loss on a held-out batch
                model.eval()  # (3)!
                with torch.set_grad_enabled(leak == "losses"), autocast():  # (4)!
                    val_loss = model(*val)[1]
                model.train()
            if leak == "losses":
                losses.append((loss, val_loss))  # (5)!
            else:
                losses.append((loss.item(), val_loss.item()))  # (6)!
            yield losses, debug  # (7)!
    finally:
        for hook in hooks:
            hook.remove()
# --8<-- [end:loop]


# --8<-- [start:tool]
def live_total(rows: list[dict]) -> int:
    """Device bytes in one reading of ``stacks.live_by_origin``."""
    return sum(r["bytes"] for r in rows if r["scope"] == "device")


def origin(row: dict) -> tuple:
    """A group's origin: its category, the line that allocated it and, when that line is in the
    model (labkit's models.py), the lab line that called the model."""
    return row["category"], row["where"], row.get("called_from")


def what_grew(before: list[dict], after: list[dict]) -> list[dict]:
    """The groups (by origin) whose live bytes grew between two readings, largest first."""
    old = {origin(r): r for r in before}
    grew = []
    for r in after:
        o = old.get(origin(r), {"bytes": 0, "tensors": 0})
        if r["bytes"] > o["bytes"]:  # (1)!
            grew.append(r | {"bytes": r["bytes"] - o["bytes"], "tensors": r["tensors"] - o["tensors"]})
    return sorted(grew, key=lambda r: -r["bytes"])
# --8<-- [end:tool]


# --8<-- [start:expected]
def expected_growth(scenario: str, model_config: GPTConfig, batch: int, device: torch.device) -> int | None:
    """Bytes the loop ``scenario`` gains per step with a ``model_config`` model and ``batch``
    sequences per step, derived from the shapes (CPU kernels: exact on ``device`` cpu)."""
    if scenario == "leak-losses":  # one monitoring graph + one 4-byte training loss
        if device.type != "cpu":
            return None  # (1)!
        return toy_gpt.tinygpt_activation_bytes(model_config, batch)["total"] + 4  # (2)!
    if scenario == "leak-activations":  # one fp32 block output per layer
        return model_config.layers * batch * model_config.seq_len * model_config.width * 4
    return 0
# --8<-- [end:expected]


# --8<-- [start:config]
@dataclass
class Config(RealScale, TinyGPTShape, LabConfig):
    """Reproduce memory leaks, fragmentation and an out-of-memory error, and diagnose each."""

    scenario: Literal["leak-losses", "leak-activations", "fixed", "fragmentation", "oom", "all"] = option(
        "all", "all: every scenario this device can run")
    steps: int = option(6, "training steps per leak scenario (growth is read from one step to the next)",
                        min=2, max=MAX_STEPS)
    top: int = option(12, "rows of each live-tensor table", min=1, max=MAX_COUNT)
    batch_size: int = option(8, "sequences per step", min=1, max=MAX_BATCH)
    lr: float = option(1e-3, "AdamW learning rate", above=0, max=MAX_LR)
    precision: Literal["fp32", "bf16"] = option("fp32", "bf16: each forward under bfloat16 autocast")
    frag_iters: int = option(12, "fragmentation: batch sizes tried", min=1, max=MAX_STEPS)
    frag_layers: int = option(8, "fragmentation: buffer pairs kept", min=1, max=MAX_LAYERS)
    cap_mb: int = option(1024, "oom: the memory cap in MiB (the patterns need at least 128)",
                         min=128, max=MAX_BYTES >> 20)
    snapshot: Path | None = option(None, "CUDA only: write a memory_viz history of the leak loops here", path="write")

    def __post_init__(self) -> None:
        super().__post_init__()
# --8<-- [end:config]


# --8<-- [start:run]
def run_leak(config: Config, scenario: str, device: torch.device) -> Leak:
    """Loop ``scenario`` with ``config``'s sizes on ``device``, under a ledger with stacks, read
    after every step; what it kept dies on return."""
    model, optimizer, data, val = training_setup(config, device)  # TinyGPT, AdamW, SyntheticTokens
    ledger = Ledger(device, stacks=True)  # (1)!
    ledger.track_module(model).track_optimizer(optimizer)
    reset_peak(device)
    after_step, t0 = [], time.perf_counter()
    with ledger:
        for losses, debug in training_loop(model, optimizer, data, val, config.steps, config.batch_size,
                                           LEAKS[scenario], bf16=config.precision == "bf16"):
            after_step.append(stacks.live_by_origin(ledger))  # (2)!
            held = [*debug, *(v for pair in losses for v in pair)]  # what the loop holds now
    timeline = ledger.timeline()
    return Leak(scenario, shape_of(config), timeline, after_step, live_at_peak(ledger, timeline),  # (3)!
                numbers(losses, config), sum(isinstance(v, torch.Tensor) for v in held),
                derived_growth(config, scenario, device), time.perf_counter() - t0, allocator_stats(device))
# --8<-- [end:run]


def run(config: Config) -> Result:
    device = torch.device("cpu") if config.fake else cli.pick_device(config.device)
    wanted = [*LEAKS, *ALLOCATOR] if config.scenario == "all" else [config.scenario]
    if device.type != "cuda":
        if config.snapshot:
            raise UsageError("--snapshot needs a CUDA device (a CUDA allocator feature)")
    elif "oom" in wanted:
        cuda_scenarios.check_cap(config.cap_mb, device, "--scenario oom")
    result, t0 = Result(config, device), time.perf_counter()
    leaks = [s for s in wanted if s in LEAKS]
    for name in leaks:
        path = config.snapshot
        if path and len(leaks) > 1:  # one history per loop, named after it
            path = path.with_name(f"{path.stem}-{name}{path.suffix}")
        with record_snapshot(path) as written, tensors(config):
            result.leaks[name] = run_leak(config, name, device)
        if written:
            result.snapshots.append(written.name)
    if device.type == "cuda" and "fragmentation" in wanted:
        result.fragmentation = cuda_scenarios.fragmentation(config.frag_iters, config.frag_layers)
    if device.type == "cuda" and "oom" in wanted:
        result.oom = cuda_scenarios.oom_experiments(config.cap_mb)
    if device.type != "cuda" and any(s in wanted for s in ALLOCATOR):  # a CPU: Lab 16 simulates the allocator
        batch, oom = cuda_scenarios.simulated(config.frag_iters, config.frag_layers, config.cap_mb)
        result.fragmentation = batch if "fragmentation" in wanted else None
        result.oom = oom if "oom" in wanted else None
        result.simulated = True
    result.wall_time_s = time.perf_counter() - t0
    return result


# ---------------------------------------------------------------------- what run_leak needs
def derived_growth(config: Config, scenario: str, device: torch.device) -> int | None:
    """``expected_growth`` where its count holds: Lab 01's count of a kept graph is TinyGPT's, in
    exact bytes (a trace rounds each storage to 512); the block outputs' count holds for any model
    whose residual stream is fp32."""
    if scenario == "leak-losses" and (config.model_spec() is not None or config.fake):
        return None
    return expected_growth(scenario, shape_of(config), config.batch_size, device)


# ---------------------------------------------------------------------- the result and its report
@dataclass
class Leak:
    """One loop's readings: live tensors by origin after each step, and its ledger timeline."""

    scenario: str
    model_config: GPTConfig
    timeline: Timeline
    after_step: list[list[dict]]  # stacks.live_by_origin after each step
    at_peak: list[dict]  # stacks.live_by_origin at the run's highest device total
    losses: list[tuple[float, float]]  # (training, monitoring) per step, as numbers (none when traced)
    tensors_kept: int  # tensors the loop still held at its end (in its losses and debug lists)
    expected_growth: int | None
    wall_time_s: float
    cuda: dict | None

    @property
    def live_after_step(self) -> list[int]:
        return [live_total(rows) for rows in self.after_step]

    @property
    def growth_per_step(self) -> list[int]:
        live = self.live_after_step
        return [b - a for a, b in zip(live, live[1:])]

    def derived_after_step(self) -> list[int] | None:
        """The live bytes the derived growth predicts: the first step's, plus the growth per step."""
        if self.expected_growth is None:
            return None
        return [self.live_after_step[0] + k * self.expected_growth for k in range(len(self.after_step))]

    def summary(self, top: int) -> dict:
        out = {"live_bytes_after_step": self.live_after_step, "growth_per_step_bytes": self.growth_per_step,
               "expected_growth_per_step_bytes": self.expected_growth,
               "grew_in_last_step": self.grew(top),
               "live_at_end": self.after_step[-1][:top], "live_at_peak": self.at_peak[:top],
               "peak_bytes": self.timeline.peak(),
               "wall_time_s": round(self.wall_time_s, 3), "cuda": self.cuda}
        if self.cuda:  # the allocator's own count at the end of each step, next to the ledger's
            tl = self.timeline
            last = {s: i for i, s in enumerate(tl.step) if s is not None}
            out["cuda"] = self.cuda | {"allocated_after_step": [tl.cuda_allocated[last[s]] for s in sorted(last)]}
        return out

    def grew(self, top: int) -> list[dict]:
        """What grew in the last step, by origin, largest first (a flat loop: nothing)."""
        return what_grew(self.after_step[-2], self.after_step[-1])[:top]


@dataclass
class Result:
    config: Config
    device: torch.device
    leaks: dict[str, Leak] = field(default_factory=dict)
    fragmentation: list[dict] | None = None  # cuda_scenarios.fragmentation(), on a GPU
    oom: list[dict] | None = None  # cuda_scenarios.oom_experiments(), on a GPU
    simulated: bool = False  # fragmentation and oom replayed through Lab 16's model (a CPU run), not measured
    snapshots: list[str] = field(default_factory=list)
    wall_time_s: float = 0.0

    def summary(self) -> dict:
        return {"lab": labs.slug(__file__), "device": str(self.device), "steps": self.config.steps,
                "scenarios": {name: leak.summary(self.config.top) for name, leak in self.leaks.items()},
                "fragmentation": self.fragmentation, "oom": self.oom, "allocator_simulated": self.simulated,
                "snapshots": self.snapshots or None,
                "provenance": provenance.collect(__file__, self.device, self.wall_time_s)}


if __name__ == "__main__":
    cli.main(Config, run, report)
