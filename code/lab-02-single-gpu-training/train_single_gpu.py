"""Lab 02 - one training step of a small GPT, phase by phase, with exact resume.

The loop is the one every PyTorch trainer runs:

    zero_grad(set_to_none=True) -> forward -> backward -> optimizer.step()

Each phase is marked (``marks.phase``), so the memory ledger, when one watches, records which
tensors are alive and why: parameters from the start, activations born in forward and freed in
backward, gradients born in backward, AdamW's two moment tensors born at the first ``step()``.

The same step runs a real model at real size on fake tensors (``--model``, ``--fake``: the ledger
counts every byte, nothing is allocated; ``scale_harness.py`` holds what the harness needs for it).

Run it: the commands are in this folder's README.md (and on the lab's page).
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch

from labkit import cli, files, labs, marks, provenance
from labkit.config import MAX_BATCH, MAX_LR, MAX_STEPS, LabConfig, UsageError, option
from labkit.cuda import allocator_stats, ledger_vs_allocator, record_snapshot, reset_peak
from labkit.ledger import Ledger
from labkit.models import GPTConfig, TinyGPT, TinyGPTShape
from labkit.scale import RealScale
from labkit.table import Table, by_category, format_bytes
from labkit.timeline import Timeline
from checkpoint_checks import FORMAT, read_checkpoint, resume
from scale_harness import TRACED, adamw_options, build_model, require_memory, token_source, values_read_as_zero


# --8<-- [start:step]
def train_step(model, optimizer, x, y, step: int, zero_grad: str = "none") -> float:
    with marks.phase("zero_grad", step):
        if zero_grad != "skip":
            optimizer.zero_grad(set_to_none=(zero_grad == "none"))  # (1)!
    with marks.phase("forward", step):
        loss = model(x, y)[1]  # (2)!
    with marks.phase("backward", step):
        loss.backward()  # (3)!
    with marks.phase("optimizer", step):
        optimizer.step()  # (4)!
    return loss.item()
# --8<-- [end:step]


# --8<-- [start:checkpoint]
def save_checkpoint(path: Path, model, optimizer, step: int, settings: dict) -> None:
    state = {"format": FORMAT, "settings": settings, "step": step,  # the next step to run
             "model": model.state_dict(),
             "optimizer": optimizer.state_dict(),  # (1)!
             "rng": {"cpu": torch.get_rng_state(),  # (2)!
                     "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}}
    files.save_checked(state, path)  # (3)!


def load_checkpoint(path: Path, model, optimizer, settings: dict) -> int:
    state = read_checkpoint(path, settings, model, optimizer)  # (4)!
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["cpu"])
    if state["rng"]["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return state["step"]
# --8<-- [end:checkpoint]


# --8<-- [start:config]
@dataclass
class Config(RealScale, TinyGPTShape, LabConfig):
    """Train a toy GPT (or, with --model, a real one) with AdamW and watch memory phase by phase."""

    steps: int = option(6, "steps in this run", min=1, max=MAX_STEPS)
    batch_size: int = option(8, "sequences per step", min=1, max=MAX_BATCH)
    lr: float = option(3e-3, "AdamW learning rate", above=0, max=MAX_LR)
    dropout: float = option(0.1, "dropout probability", min=0, below=1)
    zero_grad: Literal["none", "zeros", "skip"] = option(
        "none", "none: zero_grad(set_to_none=True); zeros: set_to_none=False; skip: no call")
    checkpoint: Path | None = option(None, "write a checkpoint here at the end", path="write")
    resume: bool = option(False, "continue from --checkpoint")
    save_every: int = option(0, "also write the checkpoint every N steps (0: at the end and on Ctrl-C only)",
                             min=0, max=MAX_STEPS)
    snapshot: Path | None = option(None, "CUDA only: write a memory_viz history pickle here", path="write")
    adamw: Literal["auto", "foreach", "for-loop", "fused"] = option(
        "auto", "AdamW's implementation; auto: PyTorch's choice (foreach on CUDA, for-loop on CPU; with --fake, CUDA's)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fake and self.checkpoint is not None:
            raise UsageError("--checkpoint saves real tensors: a --fake run has none")
        if self.resume and self.checkpoint is None:
            raise UsageError("--resume needs --checkpoint PATH")
        if self.save_every and self.checkpoint is None:
            raise UsageError("--save-every needs --checkpoint PATH")
        if self.resume and self.zero_grad == "skip":
            raise UsageError("--resume cannot be exact with --zero-grad skip: the accumulated gradients are not "
                             "in the checkpoint")
# --8<-- [end:config]


# --8<-- [start:train]
def run(config: Config) -> Result:
    device = cli.pick_device(config.device)
    if config.snapshot and device.type != "cuda":
        raise UsageError("--snapshot needs a CUDA device (a CUDA allocator feature)")
    if config.checkpoint:
        files.check_writable(config.checkpoint, "--checkpoint")  # (1)!
    torch.manual_seed(config.seed)
    model_config = config.model_config()
    require_memory(config, model_config, config.batch_size, device)  # sizes the machine cannot hold: refused
    with config.tensors(), values_read_as_zero(config.fake):  # (2)!
        model = build_model(config, lambda: TinyGPT(model_config), device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, **adamw_options(config.adamw, config.fake))
        settings = asdict(model_config) | {k: getattr(config, k) for k in SETTINGS}
        if config.checkpoint and not config.fake:  # its weights and AdamW's two moments, at the least
            files.check_room(config.checkpoint, 3 * sum(p.nbytes for p in model.parameters()), "--checkpoint")
        start = resume(config.checkpoint, load_checkpoint, model, optimizer, settings) if config.resume else 0
        data = token_source(config, model_config)

        ledger = Ledger(device).track_module(model).track_optimizer(optimizer)  # (3)!
        reset_peak(device)
        losses, t0 = [], time.perf_counter()
        with record_snapshot(config.snapshot), ledger, CheckpointSaver(config, model, optimizer, settings) as saver:
            for step in cli.progress(range(start, start + config.steps), total=config.steps, desc="train"):
                x, y = data.batch(step, config.batch_size, device)  # (4)!
                losses.append(train_step(model, optimizer, x, y, step, config.zero_grad))
                saver.finished(step + 1)  # (5)!
    wall = time.perf_counter() - t0
    return Result(config, model_config, device, model, optimizer, ledger, [] if config.fake else losses, start,
                  wall, ledger_vs_allocator(ledger.timeline(), allocator_stats(device)))
# --8<-- [end:train]


# what a checkpoint must have been saved with for a resume to be exact (with the model's shape)
SETTINGS = ("model", "lr", "seed", "batch_size", "zero_grad", "adamw")


# ---------------------------------------------------------------------- what the lab derives
def predicted_model_state(tl: Timeline, params: int, tensors: int) -> list[int]:
    """Derived bytes per timeline row: 4 B x P parameters, + 4 B x P gradients from the end of a
    backward to the next zero_grad, + (8 B x P + 4 B x tensors) AdamW state from the first
    optimizer step on (fp32 AdamW: two moments and one step counter per tensor)."""
    out, grads, adam, cursor = [], False, False, 0
    for span in sorted(tl.spans, key=lambda s: s.start):
        out += [(grads, adam)] * (span.start - cursor)
        grads = grads and span.name != "zero_grad"
        out += [(grads, adam)] * (span.end - span.start)
        grads = grads or span.name == "backward"
        adam = adam or span.name == "optimizer"
        cursor = span.end
    out += [(grads, adam)] * (len(tl) - cursor)
    return [4 * params + 4 * params * g + (8 * params + 4 * tensors) * a for g, a in out]


# ---------------------------------------------------------------------- the result and its report
@dataclass
class Result:
    config: Config
    model_config: GPTConfig
    device: torch.device
    model: torch.nn.Module  # TinyGPT, or the zoo's model
    optimizer: torch.optim.Optimizer
    ledger: Ledger
    losses: list[float]
    start_step: int
    wall_time_s: float
    cuda: dict | None

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def tensors(self) -> int:
        return len(list(self.model.parameters()))

    def summary(self) -> dict:
        tl, spec = self.ledger.timeline(), self.config.model_spec()
        return {"lab": labs.slug(__file__), "device": str(self.device), "model": self.config.model,
                "traced": TRACED if self.config.fake else None,
                "config": asdict(self.model_config) if spec is None else asdict(spec) | {"seq_len": self.config.seq_len},
                "params": self.params, "tensors": self.tensors,
                "start_step": self.start_step, "steps": self.config.steps, "losses": self.losses,
                "peak_bytes_by_phase": tl.peaks_by_phase(), "peak_bytes": tl.peak(),
                "gradients_first_seen": tl.first_seen("gradients"),
                "optimizer_state_first_seen": tl.first_seen("optimizer_state"),
                "optimizer_state_bytes": self.ledger.current()["optimizer_state"], "cuda": self.cuda,
                "provenance": provenance.collect(__file__, self.device, self.wall_time_s)}


def checks(result: Result) -> Table:
    """Each model-state formula against the ledger: equal to the byte on CPU."""
    p, t, now = result.params, result.tensors, result.ledger.current()
    optimizer_phase = result.ledger.timeline().peaks_by_phase()["optimizer"]
    return Table(["quantity", "formula", ("derived", "B"), ("measured", "B")], [
        ["parameters", "4 B x P", 4 * p, now["parameters"]],
        ["gradients (in the optimizer phase)", "4 B x P", 4 * p, optimizer_phase["gradients"]],
        ["AdamW state (end of run)", "2 x 4 B x P + 4 B x tensors", 8 * p + 4 * t, now["optimizer_state"]]])


def report(result: Result) -> None:
    first, config = result.start_step, result.config
    print(f"Lab 02 on {result.device}: {'TinyGPT' if config.model_spec() is None else config.model} with "
          f"{result.params:,} parameters, AdamW, steps {first}..{first + config.steps - 1}"
          f"{f' ({TRACED})' if config.fake else ''}")
    for i, loss in enumerate(result.losses):
        print(f"  step {first + i:4d}  loss {loss:.4f}")
    tl = result.ledger.timeline()
    print(f"\nPeak live device bytes in each phase (ledger, {'traced' if config.fake else 'measured'}):")
    print(by_category(tl.peaks_by_phase()).text())
    seen = tl.first_seen("optimizer_state")
    if seen:
        print(f"\nAdamW state first appeared in phase '{seen['phase']}' of step {seen['step']}: "
              f"{format_bytes(result.ledger.current()['optimizer_state'])} now "
              f"(2 moments x 4 B x {result.params:,} params + one step counter per tensor).")
    if result.cuda:
        c = result.cuda
        print(f"CUDA allocator: max allocated {format_bytes(c['max_memory_allocated'])} ("
              f"{format_bytes(c['unseen_before_window'])} of it unseen by the ledger before the run: cuBLAS "
              f"workspaces), reserved {format_bytes(c['max_memory_reserved'])}; ledger peak / (max allocated - "
              f"unseen) = {c['ledger_over_allocator']:.3f}")
    if result.config.snapshot:
        print(f"memory history written to {result.config.snapshot} (open it at https://pytorch.org/memory_viz)")
    if result.config.checkpoint:
        print(f"checkpoint written to {result.config.checkpoint} (next step {first + len(result.losses)})")


# ---------------------------------------------------------------------- checkpoint files, defensively
class CheckpointSaver:
    """Writes ``--checkpoint`` every ``--save-every`` steps, when the loop ends, and on Ctrl-C (the
    interrupt then goes on: exit 130), always at the last step that finished. Without
    ``--checkpoint`` it writes nothing."""

    def __init__(self, config: Config, model, optimizer, settings: dict) -> None:
        self.config, self.model, self.optimizer, self.settings = config, model, optimizer, settings
        self.step = self.saved = None

    def finished(self, step: int) -> None:
        self.step = step
        if self.config.save_every and step % self.config.save_every == 0:
            self.save()

    def save(self) -> None:
        if self.config.checkpoint and self.step is not None and self.saved != self.step:
            save_checkpoint(self.config.checkpoint, self.model, self.optimizer, self.step, self.settings)
            self.saved = self.step

    def __enter__(self) -> CheckpointSaver:
        return self

    def __exit__(self, kind, err, tb) -> None:
        try:
            if kind is None or kind is KeyboardInterrupt:
                self.save()  # Ctrl-C inside this write is held until the file is whole (labkit.files.atomic)
        except KeyboardInterrupt:
            kind = KeyboardInterrupt
            raise
        finally:
            if kind is KeyboardInterrupt and self.saved is not None:
                print(f"interrupted: checkpoint written at step {self.saved} ({self.config.checkpoint})",
                      file=sys.stderr)


if __name__ == "__main__":
    cli.main(Config, run, report)
