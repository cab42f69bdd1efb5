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


def report(result) -> None:
    budget = result.config.budget
    split = (f"{result.accum_steps} x micro-batch {result.micro_batch}, "
             f"checkpointing {'on' if result.checkpoint else 'off'}")
    print(f"Lab 06 on {result.device}: TinyGPT, {result.params:,} parameters, AdamW; "
          f"batch {result.micro_batch * result.accum_steps} = {split}")
    if result.candidates:
        print(f"\nBudget {format_bytes(budget)}: candidates measured with the ledger (2 steps each, out of memory: -)")
        print(f"{candidates_table(result.candidates).text()}\nchosen: {split}")
    print("\n".join(f"  step {i:4d}  loss {loss:.4f}" for i, loss in enumerate(result.losses)))
    tl = result.ledger.timeline()
    print("\nPeak live device bytes in each phase (ledger, measured):")
    print(by_category(tl.peaks_by_phase()).text())
    if budget is not None:
        print(f"\nRun peak {tl.peak()['total']:,} B is within the budget of {budget:,} B ({format_bytes(budget)}).")
    if c := ledger_vs_allocator(tl, result.cuda):
        print(f"CUDA allocator: max allocated {format_bytes(c['max_memory_allocated'])}, reserved "
              f"{format_bytes(c['max_memory_reserved'])}; ledger / allocated {c['ledger_over_allocator']:.3f}")
    if result.config.snapshot:
        print(f"memory history written to {result.config.snapshot} (open it at https://pytorch.org/memory_viz)")
