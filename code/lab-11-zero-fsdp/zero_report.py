"""Lab 11's training harness: what one rank measured at one stage, the result and its JSON
summary, the tables the console and the page show, the human report; the same for a trace of one
rank of N in one process (``--world-size``, with ``--fake`` at real size).

Bookkeeping only; the lesson is in ``zero_fsdp.py``. The tables read a summary (the JSON object
rank 0 prints under ``--json``), so a notebook that launched torchrun builds the same tables as the
console.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from labkit import labs, provenance
from labkit.cuda import ledger_vs_allocator
from labkit.ledger import COMMUNICATION, Ledger
from labkit.models import GPTConfig
from labkit.table import Table
from labkit.timeline import CATEGORIES, Timeline

scale = labs.load(2, "scale_harness")

STAGES = {0: "DDP", 1: "DDP + ZeroRedundancyOptimizer", 2: "FSDP2 reshard_after_forward=False",
          3: "FSDP2 reshard_after_forward=True"}
MODEL_STATE = ("parameters", "gradients", "optimizer_state")


@dataclass
class StageRun:
    """What one rank's training at one stage left: its wrapped model, its ledger and timeline, the
    bytes of its collectives (``labkit.traffic``), its losses, the CUDA allocator's counters, and
    the model's P parameters in T tensors."""

    stage: int
    model: torch.nn.Module
    ledger: Ledger
    timeline: Timeline
    traffic: dict
    losses: list[float]
    wall_time_s: float
    cuda: dict | None  # labkit.cuda.allocator_stats after the run; None on CPU
    params: int
    tensors: int


def rank_measurement(trained: StageRun, backend: str) -> dict:
    """One rank's numbers at one stage, for rank 0: the bytes at the end of the run, the peak of the
    last step (by then AdamW has its state, DDP has rebuilt its buckets, FSDP has initialised) and
    of each of its phases, the collectives, and on CUDA the ledger against the allocator over the
    last step. With gloo on a GPU, gloo copies each reduce-scatter input inside the backend, where
    the ledger cannot see it: the largest is reported as hidden beside the ratio."""
    tl, last = trained.timeline, len(trained.losses) - 1
    steady = tl.step_window(last)
    first_row = min(s.start for s in tl.spans if s.step == last)
    scatter = trained.traffic["collectives"].get("_reduce_scatter_base_", {}).get("largest_in_bytes", 0)
    return {"losses": trained.losses, "at_end": tl.at_end(), "peak_last_step": steady.peak(),
            "peaks_by_phase_last_step": steady.peaks_by_phase(), "traffic": trained.traffic,
            "cuda": ledger_vs_allocator(tl, trained.cuda, first_row, scatter if backend == "gloo" else 0),
            "wall_time_s": trained.wall_time_s}


@dataclass
class Result:
    """Rank 0's view of the run: every stage, with every rank's measurements in it."""

    config: object  # zero_fsdp.Config
    model_config: GPTConfig
    device: torch.device
    backend: str
    world_size: int
    params: int  # P
    tensors: int  # T
    loss_rtol: float
    stages: list[dict]  # zero_fsdp.against_lab01_and_ddp of each stage
    timelines: dict[str, dict] | None  # stage -> rank 0's timeline of the last step (Timeline.to_dict)
    wall_time_s: float

    def summary(self) -> dict:
        c = self.config
        return {"lab": labs.slug(__file__), "device": str(self.device), "backend": self.backend,
                "world_size": self.world_size,
                "config": self.model_config.to_dict() | {"batch_size": c.batch_size, "steps": c.steps, "lr": c.lr},
                "params": self.params, "tensors": self.tensors, "loss_rtol": self.loss_rtol, "stages": self.stages,
                **({"timelines": self.timelines} if self.timelines is not None else {}),
                "provenance": provenance.collect(__file__, self.device, self.wall_time_s)}


# ---------------------------------------------------------------------- tables, from a summary
def _name(stage: dict) -> str:
    return f"{stage['stage']} · {stage['name']}"


def model_state_table(summary: dict) -> Table:
    """Every stage, rank and model-state category at the end of the run: the ledger (measured)
    against Lab 01's ``zero_model_state`` (derived)."""
    table = Table(["stage", ("rank", "int"), "category", ("measured", "B"), ("Lab 01 (derived)", "B"),
                   ("measured - derived", "+B")])
    for s in summary["stages"]:
        for r, rank in enumerate(s["ranks"]):
            for c in MODEL_STATE:
                table.add(_name(s), r, c.replace("_", " "), rank["at_end"][c], s["lab01"][c],
                          rank["at_end"][c] - s["lab01"][c])
    return table


def peak_table(summary: dict) -> Table:
    """Rank 0 at the highest moment of each stage's last step, by category (each cell in its unit)."""
    peaks = {_name(s): s["ranks"][0]["peak_last_step"] for s in summary["stages"]}
    present = [c for c in CATEGORIES if any(p[c] for p in peaks.values())]
    return Table(["stage", *((c.replace("_", " "), "size") for c in present), ("total", "size")],
                 [[name, *(p[c] for c in present), p["total"]] for name, p in peaks.items()], strong=("total",))


def traffic_table(summary: dict) -> Table:
    """Every collective rank 0 ran, per stage: calls over the run, bytes per step."""
    steps = summary["config"]["steps"]
    table = Table(["stage", ("collective", "code"), (f"calls in {steps} steps", "int"),
                   ("output bytes per step", "size"), ("input bytes per step", "size")])
    for s in summary["stages"]:
        for op, v in s["ranks"][0]["traffic"]["collectives"].items():
            table.add(_name(s), op, v["calls"], v["out_bytes"] / steps, v["in_bytes"] / steps)
    return table


def losses_table(summary: dict) -> Table:
    """The losses of every stage (the mean over ranks) and the largest differences from DDP's."""
    return Table(["stage", "losses (mean over ranks)", ("largest relative loss difference vs DDP", "sci:1"),
                  ("largest parameter difference vs DDP", "sci:1")],
                 [[_name(s), ", ".join(f"{v:.6f}" for v in s["losses"]), s["max_loss_rel_diff_vs_ddp"],
                   s["max_param_abs_diff_vs_ddp"]] for s in summary["stages"]])


# ---------------------------------------------------------------------- the report
def report(result: Result | TraceResult) -> None:
    """The human report of a torchrun run, or of one rank traced in this process."""
    (print_trace if isinstance(result, TraceResult) else print_summary)(result.summary())


def print_summary(s: dict) -> None:
    """The human report of a summary (what ``--json`` prints)."""
    print(f"Lab 11 on {s['device']} ({s['backend']}, {s['world_size']} ranks): TinyGPT with {s['params']:,} "
          f"parameters in {s['tensors']} tensors, AdamW fp32, {s['config']['steps']} steps per stage")
    print("\nModel state per rank at the end of the run: each rank's ledger (measured) against Lab 01's "
          "zero_model_state (derived)")
    print(model_state_table(s).text())
    print("\nThe peak of the last step on rank 0, by category (measured):")
    print(peak_table(s).text())
    print("\nBytes through the collectives on rank 0 (measured):")
    print(traffic_table(s).text())
    print("\nLosses; stages 1 to 3 against DDP (stage 0):")
    print(losses_table(s).text())
    for stage in s["stages"]:
        for r, rank in enumerate(stage["ranks"]):
            if rank["cuda"]:
                c = rank["cuda"]
                print(f"stage {stage['stage']} rank {r} CUDA, last step: ledger peak / allocator "
                      f"{c['ledger_over_allocator']:.3f} (with {c['hidden_in_backend']:,} B hidden in the "
                      f"backend: {c['ledger_and_hidden_over_allocator']:.3f})")


# ---------------------------------------------------------------------- one rank of N, traced
def communication_at(ledger: Ledger, event: int) -> dict[str, int]:
    """The ``communication`` bytes alive after ledger event ``event``, in two parts:
    ``gathered_weights``, the storages FSDP resizes (each parameter's unsharded copy: full while its
    unit is gathered, empty once resharded), and ``buffers``, all the others (all-gather outputs,
    reduce-scatter inputs, DDP's buckets)."""
    comm = {r.sid for r in ledger.records if ledger.category_of(r) == COMMUNICATION}
    resized = {ev[1] for ev in ledger.events if ev[0] == "resize"}
    alive: dict[int, int] = {}
    for ev in ledger.events[:event + 1]:
        if ev[1] in comm:
            if ev[0] == "free":
                alive.pop(ev[1], None)
            else:
                alive[ev[1]] = ev[2] if ev[0] == "alloc" else ev[3]
    return {"gathered_weights": sum(b for sid, b in alive.items() if sid in resized),
            "buffers": sum(b for sid, b in alive.items() if sid not in resized)}


def traced_measurement(trained: StageRun, lab01: dict) -> dict:
    """One stage of a trace, rank 0: the peak of the last step by category and by phase, the phase
    it is in and what ``communication`` holds there, the model state at the end, Lab 01's
    ``zero_model_state`` for it (``lab01``: parameters, gradients, optimizer state), the
    collectives of one step."""
    steps, steady = len(trained.losses), trained.timeline.step_window(len(trained.losses) - 1)
    total = steady.device_total()
    top = max(range(len(total)), key=total.__getitem__)
    ops = trained.traffic["collectives"]
    at_end = trained.timeline.at_end()
    return {"stage": trained.stage, "name": STAGES[trained.stage], "lab01": lab01,
            "lab01_model_state": sum(lab01.values()), "model_state_at_rest": sum(at_end[c] for c in MODEL_STATE),
            "peak_last_step": steady.peak(), "peaks_by_phase_last_step": steady.peaks_by_phase(),
            "peak_phase": steady.phase[top], "communication_at_peak": communication_at(trained.ledger, steady.index[top]),
            "at_end": at_end, "params": trained.params, "tensors": trained.tensors,
            "collectives_per_step": {op: {k: v[k] // steps for k in ("calls", "out_bytes", "in_bytes")}
                                     for op, v in ops.items()}}


@dataclass
class TraceResult:
    """ONE rank of a ``--world-size`` job, traced in one process: every stage's measurement."""

    config: object  # zero_fsdp.Config
    stages: list[dict]  # traced_measurement of each stage
    timelines: dict[str, dict] | None  # stage -> rank 0's timeline of the last step
    wall_time_s: float

    def summary(self) -> dict:
        c = self.config
        return {"lab": labs.slug(__file__), "device": "cpu", "traced": scale.TRACED if c.fake else None,
                "model": c.model, "world_size": c.world_size, "rank": 0, "seq_len": c.seq_len,
                "batch_size": c.batch_size, "steps": c.steps, "adamw": c.adamw,
                "params": self.stages[0]["params"], "tensors": self.stages[0]["tensors"], "stages": self.stages,
                **({"timelines": self.timelines} if self.timelines is not None else {}),
                "provenance": provenance.collect(__file__, torch.device("cpu"), self.wall_time_s)}


def trace_rows(summaries: dict[str, dict]) -> list[tuple[str, dict, dict]]:
    """(``model, N ranks``, trace summary, stage) for every stage of every trace (``summaries``: any
    key -> a trace's summary)."""
    return [(f"{s['model']}, {s['world_size']} ranks", s, stage) for s in summaries.values() for stage in s["stages"]]


def real_scale_table(summaries: dict[str, dict]) -> Table:
    """Rank 0's peak of the last step, by category, for every traced configuration (``summaries``:
    any key -> a trace's summary)."""
    present = [c for c in CATEGORIES if any(st["peak_last_step"][c] for _, _, st in trace_rows(summaries))]
    return Table(["model, ranks", "stage", ("peak", "size"), *((c.replace("_", " "), "size") for c in present)],
                 [[name, _name(st), st["peak_last_step"]["total"], *(st["peak_last_step"][c] for c in present)]
                  for name, _, st in trace_rows(summaries)], strong=("peak",))


def gap_table(summaries: dict[str, dict]) -> Table:
    """Rank 0's peak against Lab 01's model state for every traced configuration, and what fills
    the gap: activations and temporaries, gathered weights, communication buffers (or buckets)."""
    rows = []
    for name, _, st in trace_rows(summaries):
        peak, comm = st["peak_last_step"], st["communication_at_peak"]
        rows.append([name, _name(st), peak["total"], st["lab01_model_state"], st["model_state_at_rest"],
                     peak["total"] - st["lab01_model_state"], st["peak_phase"],
                     peak["activations"] + peak["temporaries"], comm["gathered_weights"], comm["buffers"]])
    return Table(["model, ranks", "stage", ("peak (traced)", "size"), ("Lab 01 model state (derived)", "size"),
                  ("model state at rest (traced)", "size"), ("peak − Lab 01", "size"), "peak in",
                  ("activations + temporaries", "size"), ("gathered weights", "size"),
                  ("communication buffers", "size")], rows, strong=("peak (traced)",))


def print_trace(s: dict) -> None:
    """The human report of a trace's summary."""
    print(f"Lab 11, rank 0 of {s['world_size']} in one process (fake process group): {s['model']} with "
          f"{s['params']:,} parameters in {s['tensors']} tensors, {s['batch_size']} x {s['seq_len']} tokens per "
          f"rank, AdamW fp32 ({s['adamw']}), {s['steps']} steps per stage"
          + (f"; {s['traced']}" if s["traced"] else "; real tensors: the collectives move no data"))
    print("\nThe peak of the last step on rank 0, by category:")
    print(real_scale_table({"trace": s}).text())
    print("\nThat peak against Lab 01's zero_model_state, and what fills the difference:")
    print(gap_table({"trace": s}).text())
