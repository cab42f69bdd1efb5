"""Lab 13 - what the command line prints and ``--json`` returns, and the tables the notebook publishes.

Each table reads a :class:`fit.Result` (or the :class:`fit.Trace` inside it), so the terminal, the
notebook and the page show one set of numbers.
"""

from __future__ import annotations

from dataclasses import asdict

from labkit.config import summary_of
from labkit.table import Table, format_bytes
from fit_gap import DEVICE_CATEGORIES, WEIGHT_CASTS, predicted, reasons
from fit_gpus import ALLOCATOR_HEADROOM, CUDA_CONTEXT_BYTES, CUDA_CONTEXT_SOURCE, GPUS, HEADROOM_SOURCE
from labkit import labs

lab16 = labs.load(16, "reserved_bytes")  # the CUDA context, and where its size comes from

TRACED_ON = ("traced on fake tensors (labkit.fake): every storage of the step counted and rounded to the CUDA "
             "allocator's 512-byte blocks, nothing allocated; CPU dispatch (CPU autocast, CPU flash attention); not "
             "in the trace: CUDA context, cuBLAS workspaces, NCCL buffers, allocator fragmentation (the verdict adds "
             "them as Lab 16 simulates them, NCCL's buffers aside)")


def summary(result) -> dict:
    """What ``--json`` prints: the issue's keys first, then the detail."""
    t, c = result.trace, result.config
    gpu, d = GPUS[c.gpu], t.derived
    return {"model": c.model, "params": d["params"], "per_rank_peak_bytes": t.per_rank_peak_bytes,
            "by_category": {k: d["peak"][k] for k in DEVICE_CATEGORIES}, "predicted": predicted(t),
            "gpu": c.gpu, "capacity_bytes": gpu.capacity_bytes, "fits": t.fits, "levers": result.levers,
            "reserved": t.reserved,
            "config": summary_of(c), "spec": asdict(c.spec), "peak_phase": d["peak_phase"], "by_phase": d["by_phase"],
            "category_max": d["category_max"], "weight_casts": d["weight_casts"], "sources": d["sources"], "reasons": reasons(t),
            "host_peak_bytes": d["host_peak_bytes"], "gpu_detail": gpu_detail(c.gpu), "trace_seconds": t.seconds,
            "measured_on_gpu": result.measured, "traced_on": TRACED_ON}


def gpu_detail(name: str) -> dict:
    g = GPUS[name]
    return {"stated": g.stated, "datasheet": g.datasheet, "total_bytes": g.total_bytes, "total_source": g.total_source,
            "cuda_context_bytes": CUDA_CONTEXT_BYTES, "cuda_context_source": CUDA_CONTEXT_SOURCE,
            "allocator_headroom": ALLOCATOR_HEADROOM, "allocator_headroom_source": HEADROOM_SOURCE,
            "capacity_bytes": g.capacity_bytes}


def phases_table(trace) -> Table:
    """Rank 0's bytes by category at each phase's highest moment, and at the step's peak."""
    d = trace.derived
    rows = {**d["by_phase"], "per-rank peak": d["peak"]}
    cats = [k for k in DEVICE_CATEGORIES if any(r.get(k) for r in rows.values())]
    return Table(["phase", ("total", "bytes"), *((k.replace("_", " "), "bytes") for k in cats)],
                 [[name, sum(r[k] for k in DEVICE_CATEGORIES), *(r[k] for k in cats)] for name, r in rows.items()],
                 unit="GiB", strong=("total",))


def twin_table(pairs: list[tuple[str, object, object]]) -> Table:
    """The trace against the real step, per configuration (``pairs``: (label, real, traced) Traces,
    both counted in exact bytes): the per-rank peak of each, and whether every category at every
    phase's peak is the same."""
    return Table(["step (small-llama)", ("measured: real CPU tensors", "B"), ("traced: fake tensors", "B"),
                  ("every phase and category equal", "yes")],
                 [[label, real.per_rank_peak_bytes, traced.per_rank_peak_bytes,
                   real.derived["by_phase"] == traced.derived["by_phase"]] for label, real, traced in pairs])


def gap_table(trace) -> Table:
    """Each category's most over the step, traced, against Lab 01's formula, and why they differ."""
    d, want, why = trace.derived, predicted(trace), reasons(trace)
    rows = [[k.replace("_", " "), d["category_max"][k], want[k],
             None if want[k] is None else d["category_max"][k] - want[k], d["sources"][k].split(":")[0], why[k]]
            for k in DEVICE_CATEGORIES if d["category_max"][k] or want[k]]
    if trace.config.precision == "mixed" and trace.config.task == "train":  # a part of activations, named
        at = next(i for i, r in enumerate(rows) if r[0] == "activations") + 1
        rows.insert(at, ["of which: bf16 weight casts", d["weight_casts"]["at_activations_max"], None, None, "traced",
                         why[WEIGHT_CASTS]])
    total = sum(v for v in want.values() if v)
    rows.append(["per-rank peak (Lab 01: the sum)", trace.per_rank_peak_bytes, total,
                 trace.per_rank_peak_bytes - total, "traced", "categories peak at different moments: the trace's peak "
                 "is one moment, Lab 01's figure is the sum of every category"])
    return Table(["category", ("traced (most in the step)", "bytes"), ("Lab 01", "bytes"), ("gap", "bytes"), "source",
                  "why"], rows, unit="GiB")


def gpu_table(result) -> Table:
    """What the GPU holds for the step: its total, the CUDA context, and the step in reserved bytes (Lab 16)."""
    g, t = GPUS[result.config.gpu], result.trace
    r = t.reserved
    rows = [[f"{g.name}: stated {g.stated}", None, "cited", g.datasheet],
            ["total the driver reports (NVML)", g.total_bytes, "assumed", g.total_source],
            ["the CUDA context, outside the allocator", r["cuda_context_bytes"], "cited",
             lab16.CUDA_CONTEXT_SOURCE],
            ["the step's reserved peak (Lab 16's model of the caching allocator)", r["reserved_bytes"], "simulated",
             "the trace replayed, two steps, cuBLAS's workspaces first"],
            ["of which live tensors at the peak", t.per_rank_peak_bytes, "traced", "this trace"]]
    if r["derived_bytes"]:
        rows.append(["derived beside the trace (KV cache, DDP buckets, offload)", r["derived_bytes"], "derived", "fit_gap"])
    rows.append(["what the GPU must hold: reserved + derived + context", r["need_bytes"], "simulated", "Lab 16"])
    return Table(["", ("bytes", "bytes"), "kind", "source"], rows, unit="GiB")


def levers_table(levers: list[dict]) -> Table:
    """Each lever on the ladder (pulled after the cheaper ones it kept) and, where traced, alone."""
    rows = []
    for r in levers:
        up, alone = r["together"] or {}, r["alone"] or {}
        kept = None if not up else f"replaced by {up['replaced_by']}" if up.get("replaced_by") else \
            "yes" if up["kept"] else "no: saves nothing there"
        rows.append([r["name"], kept, up.get("saves_bytes"), up.get("per_rank_peak_bytes"), up.get("fits"),
                     alone.get("saves_bytes"), alone.get("fits"), (alone.get("how") or "-").split(":")[0],
                     r["numerics"], r["cost"]])
    return Table(["lever", "on the ladder: kept", ("saves there", "bytes"), ("peak with those kept", "bytes"),
                  ("fits", "yes"), ("alone: saves", "bytes"), ("fits alone", "yes"), "how (alone)", "numerics", "costs"], rows,
                 unit="GiB")


def to_fit(levers: list[dict]) -> list[str] | None:
    """The flags of the ladder's rung that fits, if one does."""
    return next((r["together"]["flags"] for r in levers if r["together"] and r["together"]["fits"]), None)


def fits_table(traces: list[tuple[str, object]], gpus: list[str]) -> Table:
    """One row per traced step (``traces``: (label, Trace) pairs): its per-rank peak, where that peak
    is, its simulated reserved peak (Lab 16), and on which of ``gpus`` it fits."""
    return Table(["model", "step", ("per-rank peak", "bytes"), "peak in", ("reserved (simulated)", "bytes"),
                  *((g, "yes") for g in gpus)],
                 [[t.config.model, label, t.per_rank_peak_bytes, t.derived["peak_phase"], t.reserved["reserved_bytes"],
                   *(t.reserved["need_bytes"] <= GPUS[g].total_bytes for g in gpus)] for label, t in traces],
                 unit="GiB")


def verdict(result) -> str:
    """In reserved bytes: the simulated reserved peak, what is derived beside it and the CUDA context,
    against the total the GPU's driver reports."""
    t, g = result.trace, GPUS[result.config.gpu]
    need, have = t.reserved["need_bytes"], g.total_bytes
    if t.fits:
        return f"fits: {format_bytes(need)} of {format_bytes(have)} on {g.name} ({need / have:.0%}), in reserved bytes"
    return f"does not fit: {format_bytes(need)} needed in reserved bytes, {format_bytes(have)} on {g.name}, " \
           f"{format_bytes(need - have)} short"


def report(result) -> None:
    c, t = result.config, result.trace
    d = t.derived
    size = (f"batch {c.batch}, {c.new_tokens} new token(s) each against a KV cache of {c.kv_len or c.seq:,}"
            if c.task == "decode" else f"batch {c.batch} x {c.seq} tokens")
    print(f"Lab 13 · will it fit? {c.model} ({d['params']:,} parameters), {c.task}, {size}"
          f"{f' x {c.accumulation} micro-batches' if c.accumulation > 1 else ''}, {c.precision}, "
          + (f"{c.method} rank {c.lora_rank} on {','.join(c.lora_targets)}, " if c.method != "full" else "")
          + (f"{c.optimizer}, checkpointing {c.checkpointing}, " if c.task == "train" else "")
          + f"dp {c.dp}, ZeRO {c.zero_stage}, offload {c.offload}" + (", every block torch.compile'd" if c.compile else "")
          + (", optimizer stepped in backward" if c.optimizer_in_backward else "")
          + (f", activations offloaded ({format_bytes(d['host_peak_bytes'])} on the host at most)"
             if c.offload_activations else ""))
    print(f"{TRACED_ON}; traced in {t.seconds:.1f} s.\n")
    print(f"Rank 0's bytes at each phase's peak (the step's peak is in {d['peak_phase']}):")
    print(phases_table(t).text())
    print("\nThe trace against Lab 01's formulas (most each category holds during the step):")
    print(gap_table(t).text())
    print("\n" + gpu_table(result).text())
    print(f"\n{verdict(result)}")
    if result.levers:
        print("\nLevers, exact ones first (the same numbers), cheapest first, then those that change the numerics, "
              "pulled one after another (kept when they save bytes) until it fits; alone where that needs no other "
              "trace (--levers all traces each):")
        print(levers_table(result.levers).text())
        flags = to_fit(result.levers)
        print("\nTo fit: " + (" ".join(flags) if flags else "no combination of these levers fits; more ranks (--dp) "
                                                             "or a larger GPU"))
    m = result.measured
    if m and m["measured"]:
        print(f"\nThe same step run on {m['device_name']}: traced {format_bytes(m['traced_peak_bytes'])}, its real ledger "
              f"{format_bytes(m['ledger_peak_bytes'])}, max_memory_allocated {format_bytes(m['max_memory_allocated'])} "
              f"({format_bytes(m['unseen_before_step'])} of it held before the step: workspaces), requested bytes "
              f"{format_bytes(m['max_requested_bytes'])}; traced / allocated {m['traced_over_allocated']:.4f}")
    elif m:
        print(f"\nNot run on this GPU: {m['why']}")
