"""Lab 02 - one training step of a small GPT, phase by phase, with exact resume.

The loop is the one every PyTorch trainer runs:

    zero_grad(set_to_none=True) -> forward -> backward -> optimizer.step()

Each phase runs inside ``ledger.phase(...)`` so the memory ledger (labkit) records which tensors
are alive and why: parameters from the start, activations born in forward and freed in backward,
gradients born in backward, AdamW's two moment tensors born at the first ``step()``.

Run it:
    python code/lab-02-single-gpu-training/train_single_gpu.py --device cpu
    python code/lab-02-single-gpu-training/train_single_gpu.py --steps 4 --checkpoint ckpt.pt
    python code/lab-02-single-gpu-training/train_single_gpu.py --steps 4 --checkpoint ckpt.pt --resume
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # makes code/labkit importable

import torch  # noqa: E402

from labkit import GPTConfig, Ledger, SyntheticTokens, TinyGPT, UsageError, emit_json  # noqa: E402
from labkit import lab_parser, pick_device, progress, provenance, run_lab  # noqa: E402
from labkit.cli import positive_float, positive_int, probability  # noqa: E402
from labkit.cuda import allocator_stats, ledger_vs_allocator, record_snapshot, reset_peak  # noqa: E402
from labkit.plot import format_bytes, peak_table  # noqa: E402

LAB = "lab-02-single-gpu-training"
CUDA = torch.cuda.is_available()
CHECKPOINT_FORMAT = "infralab/lab-02/v1"


# --8<-- [start:config]
def parse_args(argv=None):
    p = lab_parser("Train a toy GPT with AdamW and watch memory phase by phase.")
    p.add_argument("--steps", type=positive_int, default=6, help="steps in this run")
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--seq-len", type=positive_int, default=64)
    p.add_argument("--lr", type=positive_float, default=3e-3)
    p.add_argument("--width", type=positive_int, default=128)
    p.add_argument("--layers", type=positive_int, default=2)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--vocab", type=positive_int, default=256)
    p.add_argument("--dropout", type=probability, default=0.1)
    p.add_argument("--zero-grad", choices=["none", "zeros", "skip"], default="none",
                   help="none: set_to_none=True; zeros: set_to_none=False; skip: no call")
    p.add_argument("--checkpoint", type=Path, help="write a checkpoint here at the end")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument("--snapshot", type=Path, help="CUDA only: a memory_viz history pickle")
    args = p.parse_args(argv)
    if args.width % args.heads:
        raise UsageError(f"--width {args.width} is not divisible by --heads {args.heads}")
    if args.resume and args.checkpoint is None:
        raise UsageError("--resume needs --checkpoint PATH")
    return args
# --8<-- [end:config]


# --8<-- [start:checkpoint]
def save_checkpoint(path: Path, model, optimizer, step: int, cfg: GPTConfig) -> None:
    state = {
        "format": CHECKPOINT_FORMAT,
        "model_config": cfg.to_dict(),
        "step": step,  # the next step to run
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),  # (1)!
        "rng": {"cpu": torch.get_rng_state(),  # (2)!
                "cuda": torch.cuda.get_rng_state_all() if CUDA else []},
    }
    tmp = path.with_name(path.name + ".tmp")
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)  # (3)!
    except (OSError, RuntimeError) as err:  # a full disk, a folder removed during the run
        raise UsageError(f"cannot write checkpoint {path}: {reason(err)}") from None


def check_writable(path: Path) -> None:
    """Fail before training, not after it, when the checkpoint could not be written."""
    if path.is_dir():
        raise UsageError(f"--checkpoint {path} is a directory; give a file name inside it")
    folder = next(p for p in path.resolve().parents if p.exists())  # the nearest one that exists
    if not folder.is_dir():
        raise UsageError(f"cannot write checkpoint {path}: {folder} is a file, not a folder")
    probe = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe.touch()  # (4)!
        probe.unlink()
    except OSError as err:
        raise UsageError(f"cannot write checkpoint {path}: {reason(err)}") from None


def load_checkpoint(path: Path, model, optimizer, cfg: GPTConfig) -> int:
    if not path.is_file():
        raise UsageError(f"checkpoint not found: {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)  # (5)!
    except Exception as err:  # a truncated or foreign file fails in many ways
        why = reason(err)
        if "Weights only load failed" in why:
            why = "not a weights-only PyTorch checkpoint (corrupt, truncated, pickled)"
        raise UsageError(f"cannot read checkpoint {path}: {why}") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise UsageError(f"{path} is not a Lab 02 checkpoint")
    if missing := [k for k in ("model_config", "step", "model", "optimizer", "rng") if k not in state]:
        raise UsageError(f"checkpoint {path} is incomplete: no {', '.join(missing)}")
    if (saved := state["model_config"]) != cfg.to_dict():
        diff = [f"{k} {v} (file) vs {cfg.to_dict().get(k)} (now)" for k, v in saved.items()
                if cfg.to_dict().get(k) != v] if isinstance(saved, dict) else [f"{saved!r:.40}"]
        raise UsageError(f"checkpoint {path} is for another model: {', '.join(diff)}")
    try:  # (6)!
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["cpu"])
        if state["rng"]["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        return int(state["step"])
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as err:
        raise UsageError(f"checkpoint {path} does not fit this run: {reason(err)}") from None


def reason(err: Exception) -> str:
    """An exception's message on one line (PyTorch's state_dict errors span several)."""
    if isinstance(err, KeyError):
        return f"no entry {err}"
    return " ".join(str(err).split())[:200] or type(err).__name__
# --8<-- [end:checkpoint]


# --8<-- [start:step]
def train_step(model, optimizer, x, y, ledger: Ledger, step: int, zero_grad="none"):
    with ledger.phase("zero_grad", step):
        if zero_grad != "skip":
            optimizer.zero_grad(set_to_none=(zero_grad == "none"))  # (1)!
    with ledger.phase("forward", step):
        loss = model(x, y)[1]  # (2)!
    with ledger.phase("backward", step):
        loss.backward()  # (3)!
    with ledger.phase("optimizer", step):
        optimizer.step()  # (4)!
    return loss.item()
# --8<-- [end:step]


@dataclass
class Run:
    losses: list[float]
    start_step: int
    ledger: Ledger
    model: TinyGPT
    optimizer: torch.optim.Optimizer
    cfg: GPTConfig
    device: torch.device
    wall_time_s: float
    cuda: dict | None


# --8<-- [start:train]
def train(args) -> Run:
    device = pick_device(args.device)
    if args.snapshot and device.type != "cuda":
        raise UsageError("--snapshot needs a CUDA device (a CUDA allocator feature)")
    torch.manual_seed(args.seed)
    cfg = GPTConfig(vocab=args.vocab, seq_len=args.seq_len, width=args.width,
                    layers=args.layers, heads=args.heads, dropout=args.dropout)
    model = TinyGPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if args.checkpoint:
        check_writable(args.checkpoint)  # (1)!
    start = load_checkpoint(args.checkpoint, model, optimizer, cfg) if args.resume else 0
    data = SyntheticTokens(cfg.vocab, cfg.seq_len, seed=args.seed)

    ledger = Ledger(device)
    ledger.track_module(model)
    ledger.track_optimizer(optimizer)  # (2)!
    reset_peak(device)
    losses, t0 = [], time.perf_counter()
    with record_snapshot(args.snapshot), ledger:
        steps = range(start, start + args.steps)
        for step in progress(steps, total=args.steps, desc="train", quiet=args.json):
            x, y = data.batch(step, args.batch_size, device)  # (3)!
            loss = train_step(model, optimizer, x, y, ledger, step, args.zero_grad)
            losses.append(loss)
    wall, cuda = time.perf_counter() - t0, ledger_vs_allocator(ledger.timeline(), allocator_stats(device))
    if args.checkpoint:
        save_checkpoint(args.checkpoint, model, optimizer, start + args.steps, cfg)
    return Run(losses, start, ledger, model, optimizer, cfg, device, wall, cuda)
# --8<-- [end:train]


def first_seen(ledger: Ledger, category: str) -> dict | None:
    """The phase and step in which a category first held bytes."""
    tl = ledger.timeline()
    for i, value in enumerate(tl.device[category]):
        if value:
            return {"phase": tl.phase[i], "step": tl.step[i], "event": i}
    return None


def summary(run: Run) -> dict:
    n_params = sum(p.numel() for p in run.model.parameters())
    peaks = run.ledger.peaks_by_phase()
    peak = run.ledger.peak()
    out = {
        "lab": LAB,
        "device": str(run.device),
        "config": run.cfg.to_dict(),
        "params": n_params,
        "start_step": run.start_step,
        "steps": len(run.losses),
        "losses": run.losses,
        "peak_bytes_by_phase": peaks,
        "peak_bytes": peak,
        "gradients_first_seen": first_seen(run.ledger, "gradients"),
        "optimizer_state_first_seen": first_seen(run.ledger, "optimizer_state"),
        "optimizer_state_bytes": run.ledger.current()["optimizer_state"],
        "cuda": run.cuda,
        "provenance": provenance.collect(LAB, run.device, run.wall_time_s),
    }
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    run = train(args)
    result = summary(run)
    if args.json:
        emit_json(result)
        return
    print(f"Lab 02 on {run.device}: TinyGPT with {result['params']:,} parameters, AdamW, "
          f"steps {run.start_step}..{run.start_step + len(run.losses) - 1}")
    for i, loss in enumerate(run.losses):
        print(f"  step {run.start_step + i:4d}  loss {loss:.4f}")
    print("\nPeak live device bytes in each phase (ledger, measured):")
    print(peak_table(result["peak_bytes_by_phase"]))
    seen = result["optimizer_state_first_seen"]
    if seen:
        print(f"\nAdamW state first appeared in phase '{seen['phase']}' of step {seen['step']}: "
              f"{format_bytes(result['optimizer_state_bytes'])} now "
              f"(2 moments x 4 B x {result['params']:,} params + one step counter per tensor).")
    if run.cuda:
        c = run.cuda
        print(f"CUDA allocator: max allocated {format_bytes(c['max_memory_allocated'])} ("
              f"{format_bytes(c['unseen_before_window'])} of it unseen by the ledger before the run: cuBLAS workspaces), "
              f"reserved {format_bytes(c['max_memory_reserved'])}; ledger peak / (max allocated - unseen) = "
              f"{c['ledger_over_allocator']:.3f}")
    if args.snapshot:
        print(f"memory history written to {args.snapshot} (open it at https://pytorch.org/memory_viz)")
    if args.checkpoint:
        print(f"checkpoint written to {args.checkpoint} (next step {run.start_step + len(run.losses)})")


if __name__ == "__main__":
    run_lab(main)
