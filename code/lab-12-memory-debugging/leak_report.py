"""Lab 12 - the leak hunt for a terminal and a page: growth per step, what grew, what is alive.

The tables read a memory_debugging.Result and nothing else; the notebook publishes the same
tables the command line prints.
"""

from __future__ import annotations

import cuda_scenarios
from labkit.table import Table, format_bytes

FORMULAS = {"leak-losses": "saved by one TinyGPT forward (Lab 01) + 4 B",
            "leak-activations": "layers x batch x seq x width x 4 B", "fixed": "0"}


def growth_table(result) -> Table:
    """Growth per step measured by the ledger against the growth derived from the shapes."""
    table = Table([("loop", "code"), ("growth in the last step, measured", "B"), ("derived", "B"), "formula",
                   ("equal at every step", "yes")])
    for name, leak in result.leaks.items():
        derived = leak.expected_growth
        equal = None if derived is None else all(g == derived for g in leak.growth_per_step)
        table.add(name, leak.growth_per_step[-1], derived, FORMULAS[name], equal)
    return table


ORIGIN = ["category", ("allocated at (file:line in function: code)", "code"), ("called from", "code"),
          ("tensors", "int"), ("bytes", "B")]


def origin_row(r: dict) -> list:
    return [r["category"], r["where"], r.get("called_from"), r["tensors"], r["bytes"]]


def origin_table(rows: list[dict], top: int) -> Table:
    """The first ``top`` groups of live tensors: category, the line that allocated them, the lab
    line that called it there, how many tensors, how many bytes."""
    return Table(ORIGIN, [origin_row(r) for r in rows[:top]])


def grew_table(result) -> Table:
    """What grew in the last step of each loop, by the line that allocated it. A flat loop adds no
    rows; if no loop grew, the table says so under its header (the answer a fixed loop should give)."""
    flat = [name for name, leak in result.leaks.items() if not leak.grew(result.config.top)]
    return Table([("loop", "code"), *ORIGIN], [[name, *origin_row(r)] for name, leak in result.leaks.items()
                                               for r in leak.grew(result.config.top)],
                 empty=f"nothing: no origin holds more bytes after the last step of {', '.join(flat)} than before it")


def report(result) -> None:
    config = result.config
    model = "TinyGPT" if config.model == "tiny" else config.model
    print(f"Lab 12 on {result.device}: {model}, AdamW, {config.steps} steps per leak scenario, "
          f"a monitoring forward each step{', bf16 autocast' if config.precision == 'bf16' else ''}"
          + ("; traced on fake tensors: bytes, no values (.item() reads NaN), no time" if config.fake else ""))
    if result.leaks:
        print("\nGrowth per step: measured by the ledger, derived from the shapes")
        print(growth_table(result).text())
        print("\nWhat grew in the last step, by the line that allocated it and the lab line that called it")
        print(grew_table(result).text())
    for name, leak in result.leaks.items():
        print(f"\n{name}, live device bytes after each step: " + "  ".join(map(format_bytes, leak.live_after_step)))
        if leak.cuda:
            print("  the CUDA allocator's count: " + "  ".join(
                map(format_bytes, leak.summary(config.top)["cuda"]["allocated_after_step"])))
        print(f"alive at the peak of the run, {format_bytes(leak.timeline.peak()['total'])} (top {config.top}):")
        print(origin_table(leak.at_peak, config.top).text())
        print(f"alive at the end of the last step (top {config.top}):")
        print(origin_table(leak.after_step[-1], config.top).text())
    cuda_scenarios.print_results(result.fragmentation, result.oom, result.simulated)
    if result.snapshots:
        print(f"memory history written: {', '.join(result.snapshots)}, next to {config.snapshot} "
              "(open it at https://pytorch.org/memory_viz)")
