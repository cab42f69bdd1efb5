"""Lab 10's harness for one rank traced in one process (``--world-size``, with ``--fake`` at real
size): the result and its JSON summary, the real-scale tables, the human report of either kind of
run.

Bookkeeping only; the lesson is in ``train_ddp.py``, the torchrun run's harness in ``ddp_report.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddp_report import TOTAL, Result, model_settings, print_summary
from labkit import labs, provenance
from labkit.table import Table, by_category

scale = labs.load(2, "scale_harness")


@dataclass
class TraceResult:
    """ONE rank of a ``--world-size`` job, traced in this process: its memory and its buckets."""

    config: object  # train_ddp.Config
    memory: dict  # memory_report of rank 0
    buckets: dict  # bucket_report
    params: int  # P
    tensors: int  # T
    wall_time_s: float

    def summary(self) -> dict:
        c, b = self.config, self.buckets
        sizes = [x["bytes"] for x in b["buckets"]]
        return {"lab": labs.slug(__file__), "device": "cpu", "traced": scale.TRACED if c.fake else None,
                "model": c.model, "config": model_settings(c), "world_size": c.world_size, "rank": 0,
                "batch_per_rank": c.batch_size, "steps": c.steps, "adamw": c.adamw, "params": self.params,
                "param_tensors": self.tensors, "bucket_cap_mb": c.bucket_cap_mb,
                "grad_as_bucket_view": c.grad_as_bucket_view, "memory": self.memory,
                "buckets": {"count": len(sizes), "bytes": sizes, "total_bytes": sum(sizes), "largest_bytes": max(sizes),
                            "cap_bytes": b["cap_bytes"], "count_first_backward": len(b["first_backward"]),
                            **{k: b[k] for k in ("bytes_match_reverse_order", "params_match_ready_order",
                                                 "ddp_reported_matches")}},
                "provenance": provenance.collect(__file__, torch.device("cpu"), self.wall_time_s)}


def trace_name(summary: dict) -> str:
    return (f"{summary['model']}, {summary['world_size']} ranks"
            + (", gradient_as_bucket_view" if summary["grad_as_bucket_view"] else ""))


def real_scale_table(traces: dict[str, dict]) -> Table:
    """Rank 0's peak of each traced run, by category (``traces``: any key -> a trace's summary)."""
    return by_category({trace_name(s): s["memory"]["peak"] for s in traces.values()}, label="model, ranks")


def real_scale_buckets_table(traces: dict[str, dict]) -> Table:
    """Each traced run's buckets in its last step, against the model and the derived layout."""
    return Table(["model, ranks", ("buckets", "int"), ("their bytes", "size"), ("4 B x P", "size"),
                  ("largest bucket", "size"), ("cap", "size"), ("bytes as derived", "yes"), ("peak in", "text")],
                 [[trace_name(s), b["count"], b["total_bytes"], 4 * s["params"], b["largest_bytes"], b["cap_bytes"],
                   b["bytes_match_reverse_order"], peak_phase(s["memory"])] for s in traces.values() for b in [s["buckets"]]])


def peak_phase(memory: dict) -> str:
    """The phase whose peak is the run's peak."""
    total = memory["peak"]["total"]
    return next(p for p, row in memory["peaks_by_phase"].items() if sum(v for k, v in row.items() if k in TOTAL)
                == total)


def report(result: Result | TraceResult) -> None:
    """The human report of a torchrun run, or of one rank traced in this process."""
    (print_trace if isinstance(result, TraceResult) else print_summary)(result.summary())


def print_trace(s: dict) -> None:
    """The human report of a trace's summary."""
    print(f"Lab 10, rank 0 of {s['world_size']} in one process (fake process group): {s['model']} with "
          f"{s['params']:,} parameters in {s['param_tensors']} tensors, {s['batch_per_rank']} x "
          f"{s['config']['seq_len']} tokens per rank, AdamW fp32 ({s['adamw']}), {s['steps']} steps"
          + (f"; {s['traced']}" if s["traced"] else "; real tensors: the collectives move no data"))
    for title, table in (("The peak of the run on rank 0, by category (communication: DDP's gradient buckets)",
                          real_scale_table), ("The buckets of the last step", real_scale_buckets_table)):
        print(f"\n{title}:\n{table({'trace': s}).text()}")
