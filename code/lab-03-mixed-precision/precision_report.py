"""Lab 03's harness: what the lab derives from a run's ledger, and the tables the command line,
the notebook and the page share.

Every table is a :class:`labkit.table.Table` of raw values: ``report`` prints it, the notebook shows
and publishes it, the page renders it from ``results/lab-03-mixed-precision/summary.json``. The
functions take the lab's ``Result`` (or one ``RecipeRun`` of it) and read nothing else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from labkit import labs
from labkit.ledger import Ledger
from labkit.table import Table
from labkit.timeline import CATEGORIES, Timeline

scale_harness = labs.load(2, "scale_harness")  # peaks by step and phase, the phase of a peak

if TYPE_CHECKING:  # the starter imports this file; the types are named for the reader only
    from mixed_precision import RecipeRun, Result

LOSS_RTOL = 0.02  # every step's loss within 2 % of the fp32 loss at that step
ACTIVATION_BAND = (0.55, 0.80)  # 16-bit activations / fp32 activations, default CPU model


def loss_differences(losses: list[float], fp32_losses: list[float]) -> list[float]:
    """|loss - fp32 loss| / fp32 loss, step by step."""
    return [abs(a - b) / abs(b) for a, b in zip(losses, fp32_losses)]


def compare(base: dict, other: dict) -> dict:
    """A 16-bit recipe's summary against fp32's: loss differences, activation ratio, speed-up."""
    # An injected inf loses that step's update on purpose: from the next step on, fp16 trains another run.
    n = other["inject"]["step"] + 1 if other["inject"] else len(other["losses"])
    rel = max(loss_differences(other["losses"][:n], base["losses"][:n]))
    ratio = other["activation_bytes"] / base["activation_bytes"] if base["activation_bytes"] else None
    speed = base["step_time_s"] / other["step_time_s"] if base["step_time_s"] and other["step_time_s"] else None
    return {"max_rel_loss_diff": rel, "losses_within_tolerance": rel <= LOSS_RTOL, "compared_steps": n,
            "activation_ratio": ratio, "in_band": ratio is not None and ACTIVATION_BAND[0] <= ratio <= ACTIVATION_BAND[1],
            "speedup_vs_fp32": speed}


def forward_end(tl: Timeline, step: int = 0) -> int:
    """The last row of ``step``'s forward: everything forward saved for backward is alive there."""
    return next(s.end for s in tl.spans if s.name == "forward" and s.step == step) - 1


def activations_by_op(ledger: Ledger, step: int = 0) -> dict[str, int]:
    """Bytes of the activations born in ``step``'s forward, by the aten op that allocated them."""
    fwd = next(s for s in ledger.timeline().spans if s.name == "forward" and s.step == step)
    out: dict[str, int] = {}
    for rec in ledger.records:
        if fwd.start <= rec.born < fwd.end and ledger.category_of(rec) == "activations":
            out[rec.op] = out.get(rec.op, 0) + rec.nbytes
    return out


# ---------------------------------------------------------------------- the tables and the report
SAVED_KINDS = ("float32", "float16", "bfloat16", "16-bit weight copies", "int64")


def recipes_table(result: Result) -> Table:
    """What each recipe keeps: model state in the optimizer phase, the most activation bytes at once,
    the comparison with fp32, and the median step time of the steps run without the ledger."""
    vs, timing = result.vs_fp32(), "CPU timing" if result.device.type == "cpu" else "CUDA"
    rows = []
    for name, run in result.runs.items():
        r, c = run.summary(), vs.get(name, {})
        opt = r["peak_bytes_by_phase"]["optimizer"]
        rows.append([name, opt["parameters"], "/".join(r["parameter_dtypes"]), opt["gradients"], opt["optimizer_state"],
                     r["activation_bytes"], 1.0 if name == "fp32" else c.get("activation_ratio"),
                     c.get("max_rel_loss_diff"), len(r["skipped_steps"]),
                     r["step_time_s"] * 1e3 if r["step_time_s"] else None])
    return Table(["recipe", ("parameters", "bytes"), "dtype", ("gradients", "bytes"), ("AdamW state", "bytes"),
                  ("activations", "bytes"), ("vs fp32", "x:3"), ("largest loss difference", "pct:3"),
                  ("skipped steps", "int"), (f"step time, ms ({timing})", "float:1")], rows, strong=("recipe",))


def saved_table(result: Result) -> Table:
    """What one forward saved for backward, by kind, next to the ledger's activations after step 0's forward."""
    saved = {n: r.saved for n, r in result.runs.items()}
    found = {k for s in saved.values() for k in s}
    kinds = [k for k in SAVED_KINDS if k in found] + sorted(found - set(SAVED_KINDS))
    rows = [[k, *(s.get(k, 0) for s in saved.values())] for k in kinds]
    rows.append(["total", *(sum(s.values()) for s in saved.values())])
    rows.append(["ledger: activations at the end of step 0's forward", *(r.forward_activations() for r in result.runs.values())])
    return Table(["saved for backward", *((n, "B") for n in saved)], rows)


def checks(result: Result) -> Table:
    """Each identity the ledger and the census must satisfy: equal to the byte on CPU."""
    runs = result.runs
    first = next(iter(runs.values()))
    rows = [["parameters, every recipe", "4 B × P", 4 * first.params,
             first.summary()["peak_bytes_by_phase"]["optimizer"]["parameters"]]]
    for name, dtype in (("fp16", "float16"), ("bf16", "bfloat16")):
        if name in runs:
            saved = runs[name].saved
            rows.append([f"{name}: 16-bit weight copies", "2 B × (elements of every Linear weight)",
                         2 * runs[name].linear_weights, saved.get("16-bit weight copies", 0)])
            if "fp32" in runs:
                rows.append([f"{name}: what autocast moved to 16 bits", "(fp32 run's float32 − this run's float32) / 2",
                             (runs["fp32"].saved["float32"] - saved["float32"]) // 2, saved[dtype]])
    for name, run in runs.items():
        rows.append([f"{name}: ledger activations at the end of forward", "saved for backward + the 4-byte loss",
                     sum(run.saved.values()) + 4, run.forward_activations()])
    return Table(["quantity", "formula", ("derived", "B"), ("measured", "B")], rows)


def ops_table(result: Result) -> Table:
    """Step 0's activations by the op that made them: autocast's ``_to_copy`` holds the 16-bit casts."""
    by_op = {n: activations_by_op(r.ledger) for n, r in result.runs.items()}
    base = by_op.get("fp32", {})
    ops = sorted({op for c in by_op.values() for op in c}, key=lambda op: (-base.get(op, 0), op))
    return Table([("op that made the activation", "code"), *((n, "bytes") for n in by_op)],
                 [[op, *(c.get(op, 0) for c in by_op.values())] for op in ops])


def scaler_table(run: RecipeRun) -> Table:
    """The fp16 scaler's ``state_dict()`` and the two device tensors that hold it."""
    r = run.summary()
    rows = [[f"state_dict()['{k}']", f"{v:g}"] for k, v in (r["scaler_state"] or {}).items()]
    rows += [[f"scaler.{k}", f"one {t['dtype']} element on {t['device']}, value {t['value']:g}"]
             for k, t in r["scaler_tensors"].items()]
    return Table([("what", "code"), "value"], rows)


def inject_table(run: RecipeRun, without: list[float]) -> Table:
    """The fp16 run step by step, next to ``without``: the losses of the same run without the inf."""
    at = run.inject["step"] if run.inject else None
    return Table([("step", "int"), ("inf injected", "yes"), ("loss", "float:4"), ("scale before", "float:0"),
                  ("scale after", "float:0"), ("step skipped?", "yes"), ("growth tracker after", "int"),
                  ("loss without the inf", "float:4")],
                 [[s["step"], s["step"] == at, s["loss"], s["scale_before"], s["scale_after"], s["skipped"],
                   s["growth_tracker"], without[s["step"]] if s["step"] < len(without) else None] for s in run.steps])


def allocator_table(result: Result) -> Table:
    """CUDA only: the allocator's peaks against the ledger's, and each recipe's step speed against fp32."""
    vs = result.vs_fp32()
    rows = [[n, (c := r.cuda or {}).get("max_memory_allocated"), c.get("max_memory_reserved"),
             c.get("ledger_over_allocator"), vs.get(n, {}).get("speedup_vs_fp32")] for n, r in result.runs.items()]
    return Table(["recipe", ("max allocated", "bytes"), ("max reserved", "bytes"),
                  ("ledger peak / (max allocated - unseen)", "float:4"), ("step speed vs fp32", "x:2")], rows)


# ---------------------------------------------------------------------- at real size, traced
def real_scale_rows(run: RecipeRun) -> dict[str, dict[str, int]]:
    """Bytes by category of a traced recipe at two moments, ``"backward"`` (the start of step 1's
    backward: the activations at their most, with AdamW's state alive) and ``"peak"`` (the step's
    highest row), each with two parts of its activations named: ``weight_copies`` (autocast's 16-bit
    copies of the weights, from the census: exact bytes) and ``log_probs`` (the loss's float32
    log-probabilities, B x T x vocab x 4 B, made by ``_log_softmax``: ledger bytes)."""
    tl = run.ledger.timeline()
    backward = scale_harness.peaks_by_step_and_phase(tl, ("backward",))["step 1 backward"]
    return {"backward": backward | {"weight_copies": run.saved.get("16-bit weight copies", 0),
                                    "log_probs": activations_by_op(run.ledger).get("_log_softmax", 0)},
            "peak": tl.peak() | {"phase": scale_harness.peak_phase(tl)}}


def real_scale_table(runs: dict[str, RecipeRun]) -> Table:
    """The recipes side by side at real size: what is alive at the start of step 1's backward, and at the peak."""
    rows = []
    for name, run in runs.items():
        moments = real_scale_rows(run)
        b, p = moments["backward"], moments["peak"]
        cats = ("parameters", "gradients", "optimizer_state", "activations")
        rows.append([name, "start of step 1's backward", sum(b[c] for c in CATEGORIES), *(b[c] for c in cats),
                     b["weight_copies"], b["log_probs"], b["temporaries"]])
        rows.append([name, f"peak: {p['phase']}", p["total"], *(p[c] for c in cats), None, None, p["temporaries"]])
    return Table(["recipe", "when", ("total", "bytes"), ("parameters", "bytes"), ("gradients", "bytes"),
                  ("AdamW state", "bytes"), ("activations", "bytes"), ("of which 16-bit weight copies", "bytes"),
                  ("of which fp32 log-probs", "bytes"), ("temporaries", "bytes")], rows, strong=("total",))


def real_scale_peaks_table(runs: dict[str, RecipeRun], card: int) -> Table:
    """Each traced recipe's peak, where it is, how far above the lowest recipe's it is, and whether it
    fits under ``card`` bytes."""
    peaks = {name: real_scale_rows(run)["peak"] for name, run in runs.items()}
    lowest = min(p["total"] for p in peaks.values())
    return Table(["recipe", ("peak", "bytes"), "peak in", ("above the lowest peak", "bytes"), ("fits 80 GiB", "yes"),
                  "weights", ("model state (weights, gradients, AdamW)", "bytes")],
                 [[name, p["total"], p["phase"], p["total"] - lowest, p["total"] <= card, "/".join(run.param_dtypes),
                   sum(run.ledger.timeline().at_end()[c] for c in ("parameters", "gradients", "optimizer_state"))]
                  for (name, run), p in zip(runs.items(), peaks.values())], strong=("peak",))


def real_scale_numbers(runs: dict[str, RecipeRun]) -> dict:
    """What a page quotes of the traced recipes (names with ``_`` for ``-``): each one's peak and, at
    the start of step 1's backward, its total, activations, weight copies and log-probs; the recipe
    with the lowest peak (``lowest``) and how much lower it is than the next (``lowest_by``)."""
    out = {}
    for name, run in runs.items():
        m = real_scale_rows(run)
        out[name.replace("-", "_")] = {"peak": m["peak"]["total"], "activations": m["backward"]["activations"],
                                       "backward_total": sum(m["backward"][c] for c in CATEGORIES),
                                       "weight_copies": m["backward"]["weight_copies"],
                                       "log_probs": m["backward"]["log_probs"]}
    order = sorted(out, key=lambda name: out[name]["peak"])
    return out | {"lowest": order[0], "lowest_by": out[order[1]]["peak"] - out[order[0]]["peak"] if len(order) > 1 else 0}


def report(result: Result) -> None:
    config, first = result.config, next(iter(result.runs.values()))
    print(f"Lab 03 on {result.device}: {'TinyGPT' if config.model_spec() is None else config.model} with "
          f"{first.params:,} parameters, AdamW, {config.steps} steps per recipe, ledger on the first "
          f"{min(config.ledger_steps, config.steps)}" + (" (traced on fake tensors: bytes, no values, no time)"
                                                         if config.fake else ""))
    if result.device.type == "cpu" and "fp16" in result.runs and not config.fake:
        print("note: fp16 on CPU runs for real (autocast, GradScaler, overflows): its losses, bytes and scaler are\n"
              "      measured. Its speed is not a GPU figure: a CPU does not run fp16 matmuls as tensor cores do.")
    print(f"\n{recipes_table(result).text()}\n")
    lo, hi = ACTIVATION_BAND
    for name, c in result.vs_fp32().items():
        lost = result.runs[name].inject
        print(f"{name}: activations {c['activation_ratio']:.3f}x fp32's, {'in' if c['in_band'] else 'OUT of'} the band "
              f"{lo:.2f}-{hi:.2f}; largest loss difference {c['max_rel_loss_diff']:.2%} over steps "
              f"0-{c['compared_steps'] - 1}, {'within' if c['losses_within_tolerance'] else 'OVER'} the "
              f"{LOSS_RTOL:.0%} tolerance" + (f" (the update of step {lost['step']} was lost on purpose)" if lost else ""))
    print(f"\n{saved_table(result).text()}")
    if any(r.cuda for r in result.runs.values()):
        print(f"\n{allocator_table(result).text()}")
    if (fp16 := result.runs.get("fp16")) and not fp16.traced:
        print(f"\nGradScaler after the fp16 run:\n{scaler_table(fp16).text()}")
        if inj := fp16.inject:
            print(f"injected inf at step {inj['step']}: scale {inj['scale_before']:g} -> {inj['scale_after']:g}; step "
                  f"skipped: {'yes' if inj['skipped'] else 'NO'}; parameters unchanged: "
                  f"{'yes' if inj['params_unchanged'] else 'NO'}; growth tracker reset to {inj['growth_tracker']}. "
                  "A skipped step is a lost update: the curve lags.")
    if config.snapshot:
        print(f"memory history written to {config.snapshot} (open it at https://pytorch.org/memory_viz)")
