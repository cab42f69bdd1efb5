"""Lab 07 - the harness around the lesson: what a run of ``optimizer_offload.py`` needs besides the technique.

* the batches: TinyGPT's learnable ``SyntheticTokens``, or random ids for a zoo model or a trace
  (``token_source``);
* the memory floor a real run checks first (``require_memory``; a ``--fake`` run allocates nothing);
* the ``Result`` of a run (one summary per mode, what ``--json`` prints) and the console ``report``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
from offload_accounting import (MODEL_STATE, TRACED, BusCopies, after_step, bytes_per_param, checks,
                                largest_difference)

from labkit import budget, labs, provenance
from labkit.config import summary_of
from labkit.ledger import Ledger
from labkit.models import RandomTokens, SyntheticTokens
from labkit.table import Table


def token_source(config):
    """TinyGPT's learnable ``SyntheticTokens`` on real tensors; random ids for a zoo model or a trace."""
    spec = config.model_spec()
    if spec is None and not config.fake:
        return SyntheticTokens(config.vocab, config.seq_len, seed=config.seed)
    return RandomTokens(config.vocab if spec is None else spec.vocab, config.seq_len, config.seed)


def require_memory(config, device) -> None:
    """Refuse a real run the machine cannot hold: labkit.budget's floor (12 B per parameter, 4 B per
    logit) with a zoo model's own parameter count. A ``--fake`` run allocates nothing."""
    spec = config.model_spec()
    if config.fake:
        return
    if spec is None:
        budget.require_gpt_training(config.model_config(), config.batch_size, device)
        return
    params = spec.param_count()
    budget.require(12 * params + 4 * config.batch_size * config.seq_len * spec.vocab, device,
                   f"12 B x {params:,} parameters of {spec.name} + 4 B x {config.batch_size} x {config.seq_len} "
                   f"tokens x {spec.vocab:,} logits")


@dataclass
class Run:
    mode: str
    model: torch.nn.Module
    optimizer: object | None  # the OptimizerOffload engine (host side), None for device AdamW
    ledger: Ledger | None  # None: a plain run, for time
    copies: BusCopies | None  # bytes copied between the device and the host buffers (under the ledger)
    losses: list[float]  # none when traced on fake tensors
    step_s: list[float]
    cuda: dict | None
    wall_time_s: float


@dataclass
class Result:
    config: object  # the starter's Config
    device: torch.device
    runs: list[Run]

    def mode_summary(self, run: Run) -> dict:
        reference = next(r for r in self.runs if r.mode == "none")
        n, tensors = sum(p.numel() for p in run.model.parameters()), len(list(run.model.parameters()))
        state, tl = after_step(run.ledger), run.ledger.timeline()
        saved = sum(after_step(reference.ledger)[c] - state[c] for c in MODEL_STATE)
        timed = run.step_s[1:] or run.step_s  # the first step allocates AdamW state: left out
        steps, traced = self.config.steps, self.config.fake  # traced: bytes, no values, no time
        return {"mode": run.mode, "params": n, "tensors": tensors, "losses": run.losses,
                "max_abs_diff_vs_device_adamw": None if traced else largest_difference(run.model, reference.model)[0],
                "device_after_step": state, "device_saved_bytes": saved, "device_saved_per_param": saved / n,
                "peak_device_bytes": tl.peak()["total"], "device_at_peak": tl.peak(),
                "peak_phase": max(tl.peaks_by_phase().items(), key=lambda kv: sum(kv[1].values()))[0],
                "host_bytes": tl.host["host_copies"][-1],  # master, gradients, AdamW state: labelled host_copies
                "d2h_bytes_per_step": run.copies.into // steps if run.copies else 0,
                "h2d_bytes_per_step": run.copies.out_of // steps if run.copies else 0,
                "step_ms": None if traced else 1e3 * statistics.median(timed), "cuda": run.cuda}

    def modes(self) -> dict[str, dict]:
        """The summary of each mode asked for (device AdamW, the reference, always runs)."""
        return {r.mode: self.mode_summary(r) for r in self.runs if self.config.offload in ("all", r.mode)}

    def summary(self) -> dict:
        return {"lab": labs.slug(__file__), "device": str(self.device), "config": summary_of(self.config),
                "traced": TRACED if self.config.fake else None, "modes": list(self.modes().values()),
                "provenance": provenance.collect(__file__, self.device, sum(r.wall_time_s for r in self.runs))}


def report(result: Result) -> None:
    modes, config = result.modes(), result.config
    first, name = next(iter(modes.values())), "TinyGPT" if config.model_spec() is None else config.model
    print(f"Lab 07 on {result.device}: {name} with {first['params']:,} parameters in {first['tensors']} tensors, "
          f"{config.precision} weights, {config.steps} steps, AdamW impl '{config.impl}'"
          + (f" ({TRACED})" if config.fake else " (CPU: the device and the host are the same RAM; the ledger "
             "keeps them apart)" if result.device.type == "cpu" else ""))
    print(Table(["mode", ("device bytes saved", "bytes"), ("per parameter", "float:2"), ("peak device bytes", "bytes"),
                 ("host bytes", "bytes"), ("device to host per step", "bytes"), ("host to device per step", "bytes"),
                 ("max abs diff vs device AdamW", "sci:2"), ("ms per step", "float:2")],
                [[m, s["device_saved_bytes"], s["device_saved_per_param"], s["peak_device_bytes"], s["host_bytes"],
                  s["d2h_bytes_per_step"], s["h2d_bytes_per_step"], s["max_abs_diff_vs_device_adamw"], s["step_ms"]]
                 for m, s in modes.items()]).text())
    print(f"\nBytes per parameter between steps, derived against {'traced' if config.fake else 'measured'} (ledger):")
    print(bytes_per_param(modes, config.precision).text())
    if config.offload == "all" and not config.fake:  # to the byte on real tensors; a trace rounds to 512-byte blocks
        engine = next(r.optimizer for r in result.runs if r.optimizer)
        print("\n" + checks(modes, engine, config.precision).text())
    if config.snapshot:
        print(f"memory history written to {config.snapshot} (open it at https://pytorch.org/memory_viz)")
