"""Lab 06 - the budget trainer's run for a terminal: the candidates it measured, the split it chose,
the peaks of the run. It reads a ``grad_accumulation.Result`` and nothing else."""

from __future__ import annotations

from labkit.cuda import ledger_vs_allocator
from labkit.table import Table, by_category, format_bytes


def candidates_table(candidates: list[dict]) -> Table:
    """One row per candidate split the trainer measured under the ledger."""
    return Table([("micro-batch", "int"), ("accumulation steps", "int"), ("checkpointing", "yes"),
                  ("measured peak", "bytes"), ("fits", "yes")],
                 [[c["micro_batch"], c["accum_steps"], c["checkpoint"], c["peak_bytes"], c["fits"]] for c in candidates])


def real_scale_table(runs: dict) -> Table:
    """Traced runs side by side (name -> ``grad_accumulation.Result``): the split, the tokens per
    optimizer step, and the bytes by category at each run's peak."""
    rows = []
    for name, r in runs.items():
        tl = r.ledger.timeline()
        peak, total = tl.peak(), tl.device_total()
        at = max(range(len(total)), key=total.__getitem__)
        rows.append([name, peak["total"], f"step {tl.step[at]} {tl.phase[at]}", f"{r.accum_steps} x {r.micro_batch}",
                     r.accum_steps * r.micro_batch * r.config.seq_len, peak["parameters"], peak["gradients"],
                     peak["optimizer_state"], peak["activations"], peak["temporaries"]])
    return Table(["run", ("peak", "bytes"), "peak in", "micro-batches x samples", ("tokens per optimizer step", "int"),
                  ("parameters", "bytes"), ("gradients", "bytes"), ("AdamW state", "bytes"), ("activations", "bytes"),
                  ("temporaries", "bytes")], rows, strong=("peak",))


def report(result) -> None:
    budget = result.config.budget
    split = (f"{result.accum_steps} x micro-batch {result.micro_batch}, "
             f"checkpointing {'on' if result.checkpoint else 'off'}")
    config = result.config
    print(f"Lab 06 on {result.device}: {'TinyGPT' if config.model_spec() is None else config.model}, "
          f"{result.params:,} parameters, AdamW; batch {result.micro_batch * result.accum_steps} = {split}"
          + (" (traced on fake tensors: bytes, no values, no time)" if config.fake else ""))
    if result.candidates:
        print(f"\nBudget {format_bytes(budget)}: candidates measured with the ledger (2 steps each, out of memory: -)")
        print(f"{candidates_table(result.candidates).text()}\nchosen: {split}")
    print("\n".join(f"  step {i:4d}  loss {loss:.4f}" for i, loss in enumerate(result.losses)))
    tl = result.ledger.timeline()
    print(f"\nPeak live device bytes in each phase (ledger, {'traced' if config.fake else 'measured'}):")
    print(by_category(tl.peaks_by_phase()).text())
    if budget is not None:
        print(f"\nRun peak {tl.peak()['total']:,} B is within the budget of {budget:,} B ({format_bytes(budget)}).")
    if c := ledger_vs_allocator(tl, result.cuda):
        print(f"CUDA allocator: max allocated {format_bytes(c['max_memory_allocated'])}, reserved "
              f"{format_bytes(c['max_memory_reserved'])}; ledger / allocated {c['ledger_over_allocator']:.3f}")
    if config.snapshot:
        print(f"memory history written to {result.config.snapshot} (open it at https://pytorch.org/memory_viz)")
