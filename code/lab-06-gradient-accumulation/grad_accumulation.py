"""Lab 06 - gradient accumulation, and a trainer that fits a memory budget.

k forward/backward passes on micro-batches, each loss divided by k, then one optimizer step: the
gradients are those of the whole effective batch (up to floating-point summation order), yet only
one micro-batch's activations are ever alive. Given ``--budget 10MiB``, the trainer measures short
runs of candidate micro-batch sizes with the memory ledger, without and then with checkpointing of
the blocks, and trains with the largest that fits, or says in one line (exit 2) that none does.

With ``--model llama-3-8b --fake`` the same trainer runs the zoo's Llama at real size on fake tensors
(the ledger counts every byte; nothing is allocated; Lab 02's ``scale_harness.py`` holds the harness).

Run it: the commands are in this folder's README.md (and on the lab's page).
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from labkit import cli, labs, marks, provenance
from labkit.config import MAX_BATCH, MAX_BYTES, MAX_LR, MAX_STEPS, LabConfig, UsageError, option
from labkit.cuda import allocator_stats, ledger_vs_allocator, record_snapshot, reset_peak
from labkit.ledger import Ledger
from labkit.models import GPTConfig, SyntheticTokens, TinyGPT, TinyGPTShape
from labkit.scale import RealScale
from accumulation_report import report
from labkit.table import format_bytes

scale_harness = labs.load(2, "scale_harness")  # Lab 02's harness for --model/--fake: batches, the model, AdamW


# --8<-- [start:step]
def accumulate(model, batches, k: int, step: int | None = None) -> float:
    """Clear the gradients, then add into them the gradient of each micro-batch ``(x, y)`` of
    ``batches``, its loss divided by ``k``; ``step`` labels the phases. Returns the mean loss."""
    with marks.phase("zero_grad", step):
        model.zero_grad(set_to_none=True)
    total = 0.0
    for x, y in batches:
        with marks.phase("forward", step):
            loss = model(x, y)[1] / k  # (1)!
        with marks.phase("backward", step):
            loss.backward()  # (2)!
        total += loss.item()
    return total


def train_step(model, optimizer, batches, k: int, step: int) -> float:
    """One optimizer step over the ``k`` micro-batches of ``batches``."""
    loss = accumulate(model, batches, k, step)
    with marks.phase("optimizer", step):
        optimizer.step()  # (3)!
    return loss
# --8<-- [end:step]


# --8<-- [start:data]
def samples(data: SyntheticTokens, first: int, n: int, device):
    """Samples ``first`` .. ``first + n - 1`` of ``data`` as one batch on ``device``; sample j is
    ``data.batch(j, 1)`` whatever the split."""
    xs, ys = zip(*(data.batch(j, 1) for j in range(first, first + n)))
    return torch.cat(xs).to(device), torch.cat(ys).to(device)


def micro_batches(data: SyntheticTokens, step: int, batch: int, micro: int, device):
    """Step ``step``'s effective batch of ``batch`` samples, ``micro`` at a time, on ``device``."""
    for start in range(0, batch, micro):
        yield samples(data, step * batch + start, micro, device)  # (1)!
# --8<-- [end:data]


# --8<-- [start:model]
class CheckpointedBlock(nn.Module):
    """A block that keeps only its input for backward and recomputes its inside there."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)  # (1)!


def build_model(cfg: GPTConfig, checkpoint_blocks: bool, device, seed: int, make=None) -> nn.Module:
    """A TinyGPT of ``cfg`` on ``device`` with weights drawn from ``seed`` (or ``make()``: the model
    ``--model`` names, already where it runs); ``checkpoint_blocks`` wraps every block in
    :class:`CheckpointedBlock`."""
    torch.manual_seed(seed)  # (2)!
    model = make() if make else TinyGPT(cfg).to(device)
    if checkpoint_blocks:
        model.blocks = nn.ModuleList(CheckpointedBlock(b) for b in model.blocks)  # (3)!
    return model
# --8<-- [end:model]


# --8<-- [start:equivalence]
# max |g_accumulated - g_large| / max |g_large|, asserted by the tests
TOLERANCE = 1e-5  # (1)!


def gradient_gap(cfg: GPTConfig, batch: int, k: int, seed: int = 0, ckpt: bool = False, scale: bool = True) -> dict:
    """Gradients of k accumulated micro-batches against one large batch of the same samples, on the
    CPU: ``cfg`` the model, ``batch`` the samples, ``scale`` divides each loss by k."""
    model = build_model(cfg, ckpt, "cpu", seed)
    x, y = samples(SyntheticTokens(cfg.vocab, cfg.seq_len, seed=seed), 0, batch, "cpu")
    accumulate(model, [(x, y)], 1)
    large = [p.grad.clone() for p in model.parameters()]
    accumulate(model, zip(x.chunk(k), y.chunk(k)), k if scale else 1)  # (2)!
    accumulated = [p.grad for p in model.parameters()]
    norm = torch.stack([g.norm() for g in accumulated]).norm() / torch.stack([g.norm() for g in large]).norm()
    return {"k": k, "max_abs_diff": max((a - g).abs().max().item() for a, g in zip(accumulated, large)),
            "max_abs_grad": max(g.abs().max().item() for g in large), "norm_ratio": norm.item(),
            "bit_exact": all(torch.equal(a, g) for a, g in zip(accumulated, large))}
# --8<-- [end:equivalence]


UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}


def parse_bytes(text: str) -> int:
    """'64MiB' -> 67108864. Plain bytes or KiB/MiB/GiB (powers of 1024), any letter case."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in UNITS or float(m.group(1)) * UNITS[unit] < 1:
        hint = "; KB/MB/GB are ambiguous, write KiB/MiB/GiB" if unit in ("K", "KB", "M", "MB", "G", "GB") else ""
        raise ValueError(f"expected bytes such as 500000, 512KiB, 64MiB or 1.5GiB, got {text!r}{hint}")
    return int(float(m.group(1)) * UNITS[unit])


# --8<-- [start:config]
@dataclass
class Config(RealScale, TinyGPTShape, LabConfig):  # (2)!
    """Gradient accumulation, and a trainer that picks micro-batch and checkpointing to fit a budget."""

    batch: int | None = option(None, "effective batch per optimizer step", min=1, max=MAX_BATCH)
    micro_batch: int | None = option(None, "samples per forward/backward pass", min=1, max=MAX_BATCH)
    accum_steps: int | None = option(None, "micro-batches per optimizer step", min=1, max=MAX_STEPS)
    budget: int | None = option(None, "peak bytes allowed, e.g. 24MiB; the trainer picks the split",
                                min=1, max=MAX_BYTES,
                                parse=parse_bytes, metavar="BYTES")
    checkpoint: Literal["auto", "on", "off"] = option(
        "auto", "checkpoint every block; auto: only if the budget needs it (off without --budget)")
    steps: int = option(4, "optimizer steps", min=1, max=MAX_STEPS)
    lr: float = option(3e-3, "AdamW learning rate", above=0, max=MAX_LR)
    snapshot: Path | None = option(None, "CUDA only: write a memory_viz history pickle here", path="write")
    adamw: Literal["auto", "foreach", "for-loop", "fused"] = option(
        "auto", "AdamW's implementation; auto: PyTorch's choice (foreach on CUDA, for-loop on CPU; with --fake, CUDA's)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.budget is not None and (self.micro_batch or self.accum_steps):
            raise UsageError("--budget chooses the micro-batch: give --batch, not --micro-batch/--accum-steps")
        self.split()

    def split(self) -> tuple[int, int]:
        """(micro-batch, accumulation steps) from any two of the three flags, or one."""
        m, k, b = self.micro_batch, self.accum_steps, self.batch
        if self.budget is not None:
            return b or 16, 1  # one batch of 16 by default; the trainer splits it
        if b is None:  # (1)!
            return m or 4, k or 4
        if m is None and k is None:
            return b, 1  # --batch alone: one large batch
        if m and k and m * k != b:
            raise UsageError(f"--micro-batch {m} x --accum-steps {k} = {m * k}, but --batch is {b}")
        given, name = (m, "--micro-batch") if m else (k, "--accum-steps")
        if b % given:
            raise UsageError(f"--batch {b} is not a multiple of {name} {given}")
        return (m, b // m) if m else (b // k, k)
# --8<-- [end:config]


# --8<-- [start:run]
def run(config: Config) -> Result:
    device = cli.pick_device(config.device)
    if config.snapshot and device.type != "cuda":
        raise UsageError("--snapshot needs a CUDA device (memory history is a CUDA allocator feature)")
    micro, k = config.split()
    scale_harness.require_memory(config, config.model_config(), micro, device)  # one micro-batch too big: refused
    ckpt, candidates = config.checkpoint == "on", []
    with config.tensors(), scale_harness.values_read_as_zero(config.fake):  # --fake: traced, nothing allocated
        if config.budget is not None:  # (1)!
            batch = micro * k
            micro, ckpt, candidates = plan(config, device, batch, config.budget, config.checkpoint)
            k = batch // micro
        result = train(config, device, micro, k, ckpt, config.steps, config.snapshot)
    peak = result.ledger.timeline().peak()["total"]
    if config.budget is not None and peak > config.budget:  # (2)!
        raise RuntimeError(f"run peak {peak:,} B exceeds the budget of {config.budget:,} B: its candidate run "
                           f"measured less")
    return replace(result, config=config, candidates=candidates)
# --8<-- [end:run]


# ---------------------------------------------------------------------- the trainer under the ledger
def train(config: Config, device, micro: int, k: int, ckpt: bool, steps: int, snapshot: Path | None = None,
          quiet: bool = False) -> Result:
    """``steps`` optimizer steps of ``k`` micro-batches of ``micro`` samples under a fresh ledger:
    ``config`` the model, seed and learning rate, ``ckpt`` checkpoints every block, ``snapshot`` a
    CUDA memory history file, ``quiet`` no progress bar."""
    cfg = config.model_config()
    model = build_model(cfg, ckpt, device, config.seed,
                        make=lambda: scale_harness.build_model(config, lambda: TinyGPT(cfg), device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr,
                                  **scale_harness.adamw_options(config.adamw, config.fake))
    data = scale_harness.token_source(config, cfg)
    ledger = Ledger(device).track_module(model).track_optimizer(optimizer)
    reset_peak(device)
    losses, t0 = [], time.perf_counter()
    with record_snapshot(snapshot), ledger:
        for step in cli.progress(range(steps), total=steps, desc=f"train {k} x {micro}", quiet=quiet):
            losses.append(train_step(model, optimizer, micro_batches(data, step, k * micro, micro, device), k, step))
    wall = time.perf_counter() - t0
    return Result(None, micro, k, ckpt, [] if config.fake else losses, ledger, model, device, wall,
                  allocator_stats(device))


# --8<-- [start:plan]
def measure_peak(config: Config, device, batch: int, micro: int, ckpt: bool) -> int | None:
    """Measured peak bytes of steady-state training at this micro-batch size (None: out of memory):
    ``config`` the model, ``batch`` the effective batch, ``ckpt`` checkpointing of the blocks."""
    k = min(batch // micro, 2)  # (1)!
    try:
        return train(config, device, micro, k, ckpt, steps=2, quiet=True).ledger.peak()["total"]  # (2)!
    except torch.cuda.OutOfMemoryError:
        return None


def plan(config: Config, device, batch: int, budget: int, mode: str = "auto"):
    """(micro_batch, checkpoint, candidates) that fits ``budget`` bytes for an effective ``batch``
    of the model ``config`` describes; ``mode``: checkpointing auto, on or off. Every candidate is a
    measurement."""
    sizes = [m for m in range(1, batch + 1) if batch % m == 0]
    modes = {"off": [False], "on": [True], "auto": [False, True]}[mode]  # (3)!
    candidates: dict[tuple[int, bool], dict] = {}  # in the order they were measured

    def measured(micro, ckpt):
        if (micro, ckpt) not in candidates:
            peak = measure_peak(config, device, batch, micro, ckpt)
            candidates[micro, ckpt] = {"micro_batch": micro, "accum_steps": batch // micro, "checkpoint": ckpt,
                                       "peak_bytes": peak, "fits": peak is not None and peak <= budget}
        return candidates[micro, ckpt]

    smallest = measured(1, modes[-1])  # (4)!
    if not smallest["fits"]:
        peak = smallest["peak_bytes"]
        how = "traced" if config.fake else "measured"
        said = "ran out of device memory" if peak is None else f"peaks at {format_bytes(peak)} ({peak:,} B, {how})"
        raise UsageError(f"budget {format_bytes(budget)} ({budget:,} B) cannot be met: the smallest configuration "
                         f"(micro-batch 1, checkpointing {'on' if modes[-1] else 'off'}) {said}")
    for ckpt in modes:
        best = None
        for micro in cli.progress(sizes, desc=f"measure checkpoint={ckpt}", quiet=True):
            if not measured(micro, ckpt)["fits"]:
                break  # (5)!
            best = micro
        if best:
            return best, ckpt, list(candidates.values())  # (6)!
    raise AssertionError("unreachable: the smallest configuration fits")
# --8<-- [end:plan]


# ---------------------------------------------------------------------- the result and its report
@dataclass
class Result:
    config: Config | None  # None for a run made by the planner
    micro_batch: int
    accum_steps: int
    checkpoint: bool
    losses: list[float]
    ledger: Ledger
    model: nn.Module  # TinyGPT, or the zoo's model
    device: torch.device
    wall_time_s: float
    cuda: dict | None
    candidates: list[dict] = field(default_factory=list)  # what the budget trainer measured, in order

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def summary(self) -> dict:
        tl, budget = self.ledger.timeline(), self.config.budget if self.config else None
        peak, spec = tl.peak(), self.config.model_spec() if self.config else None
        traced = self.config is not None and self.config.fake
        return {"lab": labs.slug(__file__), "device": str(self.device),
                "model": self.config.model if self.config else None,
                "traced": scale_harness.TRACED if traced else None,
                "config": self.model.cfg.to_dict() if spec is None else asdict(spec) | {"seq_len": self.config.seq_len},
                "params": self.params, "param_tensors": len(list(self.model.parameters())),
                "batch": self.micro_batch * self.accum_steps, "micro_batch": self.micro_batch,
                "accum_steps": self.accum_steps, "checkpoint": self.checkpoint,
                "steps": len(self.losses), "losses": self.losses, "budget_bytes": budget,
                "candidates": self.candidates, "peak_bytes": peak, "peak_bytes_by_phase": tl.peaks_by_phase(),
                "within_budget": None if budget is None else peak["total"] <= budget,
                "cuda": ledger_vs_allocator(tl, self.cuda),  # cuBLAS workspaces unseen by the ledger set aside
                "provenance": provenance.collect(__file__, self.device, self.wall_time_s)}


if __name__ == "__main__":
    cli.main(Config, run, report)
