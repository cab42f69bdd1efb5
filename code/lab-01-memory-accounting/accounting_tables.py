"""Lab 01's result and the tables it prints and publishes: the derived ledger, and the measured step
set against it.

``run(Config(...))`` returns a :class:`Result`; the tables read it, so the console (``report``), the
notebook and the page show one set of numbers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from labkit import labs, provenance
from labkit.table import Table
from model_parallel import layout_text, params_per_rank, total_params
from toy_gpt import Measurement, Shape, param_tensors

if TYPE_CHECKING:
    from memory_accounting import Config, Recipe

STATE = ("parameters", "gradients", "master_weights", "optimizer_state")
DTYPE = {4: "fp32", 2: "bf16"}  # bytes per element -> the dtype the recipes use


@dataclass
class Result:
    """What ``run`` derived (and, with ``--measure``, measured) for one configuration."""

    config: Config
    shape: Shape | None
    derived: dict[str, int]  # bytes per category on one GPU, from the formulas
    formulas: dict[str, str]  # the formula of each category, with this run's numbers in it
    recipe: Recipe  # the precision's bytes per parameter, gradient, master copy, moment, activation
    bytes_per_parameter: int  # model-state bytes per parameter of the recipe and optimizer (step counters aside)
    measurement: Measurement | None
    device: torch.device
    wall_time_s: float

    @property
    def params(self) -> int:
        return self.config.params if self.shape is None else total_params(self.shape, self.config.layout.experts)

    @property
    def params_per_gpu(self) -> dict[str, int] | None:
        """Parameters this GPU holds under the layout (``dense``, ``experts``, ``tensors``); None with --params."""
        return None if self.shape is None else params_per_rank(self.shape, self.config.layout)

    def summary(self) -> dict:
        c, m = self.config, self.measurement
        out = {"lab": labs.slug(__file__), "device": str(self.device), "params": self.params,
               "shape": asdict(self.shape) if self.shape else None, "precision": c.precision,
               "optimizer": None if c.inference else c.optimizer, "zero_stage": c.zero_stage, "dp": c.dp,
               "recompute": c.recompute if self.shape else None, "dropout": c.dropout, "inference": c.inference,
               "layout": asdict(c.layout), "params_per_gpu": self.params_per_gpu,
               "derived": self.derived, "total_bytes": sum(self.derived.values()),
               "formulas": self.formulas}
        if m:
            out |= {"loss": m.loss, "measured": m.measured, "tinygpt_activations": m.tinygpt_activations,
                    "gap_to_paper": m.gap_to_paper, "peak_bytes": m.ledger.peak()["total"], "exact": m.exact,
                    "cuda": m.cuda}
        return out | {"provenance": provenance.collect(__file__, self.device, self.wall_time_s)}


def derived_table(result: Result) -> Table:
    """The derived ledger: each category, its formula, its bytes on one rank."""
    rows = [[k.replace("_", " "), result.formulas[k], v, v / 1e9, v / 2**30]
            for k, v in result.derived.items()]
    total = sum(result.derived.values())
    return Table(["category", "formula", ("bytes", "B"), ("GB", "float:3"), ("GiB", "float:3")],
                 [*rows, ["total", "", total, total / 1e9, total / 2**30]])


def measured_table(result: Result) -> Table:
    """Measured against derived, category by category (the ledger's bytes and the formulas')."""
    m, d, c = result.measurement, result.derived, result.config
    host = m.host_counters  # on a GPU AdamW's step counters are not on the device: a row of their own
    rows = [[cat, m.measured[cat], d[cat] - (host if cat == "optimizer_state" else 0),
             result.formulas[cat] + (", less the step counters" if host and cat == "optimizer_state" else "")]
            for cat in STATE if d[cat] or m.measured[cat]]
    if host:
        rows.append(["optimizer_state_on_host", host, host,
                     f"4 B x {param_tensors(result.shape)} step counters, on the host"])
    masks = "m=1" if c.dropout else "no dropout"
    rows += [["activations", m.measured["activations"], d["activations"],
              f"the paper's formula, layers only, e={result.recipe.act}, {masks}"],
             ["activations", m.measured["activations"], m.tinygpt_activations["total"],
              "TinyGPT's saved tensors, op by op"]]
    return Table(["category", ("measured", "B"), ("derived", "B"), ("gap", "+B"), "derived by"],
                 [[cat.replace("_", " "), meas, want, meas - want, how] for cat, meas, want, how in rows])


def model_state_table(result: Result) -> Table:
    """Model state measured against derived, with bytes per parameter and their sum."""
    m, d, r, p = result.measurement.measured, result.derived, result.recipe, result.params
    notes = {"parameters": DTYPE[r.param] + (" working copy" if r.master else ""), "gradients": DTYPE[r.grad],
             "master_weights": DTYPE[r.master or 4], "optimizer_state": DTYPE[r.moment]}
    cats = [cat for cat in STATE if d[cat] or m[cat]]
    rows = [[cat.replace("_", " "), m[cat], d[cat], m[cat] / p, f"{result.formulas[cat]} ({notes[cat]})"]
            for cat in cats]
    counters = f" + 4 B x {param_tensors(result.shape)}" if result.config.optimizer == "adamw" else ""
    rows.append(["model state", sum(m[c] for c in cats), sum(d[c] for c in cats), sum(m[c] for c in cats) / p,
                 f"{result.bytes_per_parameter} B x P{counters}"])
    return Table(["category", ("measured", "B"), ("derived", "B"), ("bytes per parameter", "float:2"), "derived by"],
                 rows)


def gap_table(result: Result) -> Table:
    """The paper's formula, plus each term by which TinyGPT differs, is TinyGPT's list and the measurement."""
    m, layers = result.measurement, result.shape.layers
    e, masks = result.recipe.act, "m=1" if result.config.dropout else "no dropout"
    paper = result.derived["activations"]
    return Table(["term", ("bytes", "B")], [
        [f"paper's formula for the {layers} layers (e={e}, {masks})", paper],
        *([f"+ {why}", nbytes] for why, nbytes in m.gap_to_paper),
        ["= TinyGPT's saved tensors", paper + sum(n for _, n in m.gap_to_paper)],
        ["measured by the ledger at the end of forward", m.measured["activations"]]])


def derived_levels(result: Result) -> dict[str, int]:
    """Two derived levels of the step's timeline: where it stands when forward ends, and after the step."""
    d = result.derived
    return {"derived: parameters + saved tensors": d["parameters"] + result.measurement.tinygpt_activations["total"],
            "derived: model state after the step": sum(d[c] for c in STATE)}


def report(result: Result) -> None:
    """The derived ledger and, with ``--measure``, the measured step beside it, for a terminal."""
    c = result.config
    print(f"Lab 01 · derived ledger, bytes per rank: {result.params:,} parameters, {c.precision}, "
          f"{'inference' if c.inference else c.optimizer}, ZeRO stage {c.zero_stage}, {c.dp} rank(s)")
    if result.shape:
        print("shape: " + ", ".join(f"{k} {v}" for k, v in asdict(result.shape).items() if v is not None))
    if layout_text(c.layout):
        mine = result.params_per_gpu
        experts = f" ({mine['dense']:,} dense + {mine['experts']:,} of experts)" if c.layout.experts else ""
        print(f"split: {layout_text(c.layout)}; this GPU holds P_gpu = {mine['dense'] + mine['experts']:,} "
              f"parameters{experts}")
    print(derived_table(result).text())
    m = result.measurement
    if m is None:
        return
    print(f"\nMeasured on {m.device}: one step of TinyGPT of this shape under the ledger")
    print(measured_table(result).text())
    print("\nTinyGPT's saved tensors against the paper's formula, term by term (derived"
          + (")" if m.exact else ", for CPU kernels)") + ":")
    print(gap_table(result).text())
    print(f"Peak of the step {m.ledger.peak()['total']:,} B: activations die in backward as gradients are born, "
          "and temporaries sit on top, so the peak is not the sum of the categories.")
    if m.cuda:
        print(f"CUDA max allocated {m.cuda['max_memory_allocated']:,} B. The ledger rounds every tensor up to 512-byte "
              "blocks, as the caching allocator does: the small device gaps above are that rounding." + (" AdamW keeps "
              "its step counters on the host for CUDA parameters (torch/optim/adam.py): their own row."
              if m.host_counters else ""))
    if c.snapshot:
        print(f"memory history written to {c.snapshot} (open it at https://pytorch.org/memory_viz)")
