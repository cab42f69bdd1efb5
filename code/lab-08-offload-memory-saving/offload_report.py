"""Lab 08 - the tables of a run, for a terminal and a page: one row per mode.

The tables read the ``ModeRun``s of an ``offload.Result`` and nothing else; the notebook publishes
the same tables the command line prints.
"""

from __future__ import annotations

from labkit.table import Table

TRACED = "traced on fake tensors: bytes, no values, no time (CPU dispatch; nothing pinned)"


def modes_table(runs: list, times: bool = True) -> Table:
    """One row per mode: what it keeps on the device, what it moves, and (``times``) how fast."""
    resident = next((r.summary["peak_device_bytes"] for r in runs if r.mode == "none"), None)
    columns = ["mode", ("peak device bytes", "bytes"), ("vs resident", "x:2"), "denoiser blocks resident",
               ("host to device per run", "bytes"), ("device to host", "B"), ("max abs diff", "sci:1")]
    rows = []
    for r in runs:
        s = r.summary
        name = f"layerwise (k={s['prefetch_depth']})" if r.mode == "layerwise" else r.mode
        rows.append([name, s["peak_device_bytes"], resident and s["peak_device_bytes"] / resident,
                     f"{s['max_resident_blocks']} of {s['denoiser_blocks']}", s["h2d_bytes"], s["d2h_bytes"],
                     s["max_abs_diff"]] + ([step_time(s)] if times else []))
    return Table(columns + ["ms per step, median (min-max)"] if times else columns, rows)


def step_time(s: dict) -> str:
    """A mode's step time without the ledger: the median of the warm steps, and their range."""
    low, high = s["step_ms_range"]
    return f"{s['step_ms']:.2f} ({low:.2f}-{high:.2f})"


def host_table(runs: list) -> Table:
    """What the host masters cost: the arenas against one pinned buffer per unit."""
    rows = [[r.mode, s["host_weight_bytes"], s["host_bytes"], s["host_bytes"] / s["host_weight_bytes"],
             s["host_bytes_one_buffer_per_unit"], s["host_bytes_one_buffer_per_unit"] / s["host_weight_bytes"]]
            for r in runs if (s := r.summary)["host_weight_bytes"]]
    return Table(["mode", ("weights on the host", "bytes"), ("arena (measured: ledger `host_copies`)", "bytes"),
                  ("vs weights", "x:2"), ("one pinned buffer per unit would take", "bytes"), ("vs weights", "x:2")], rows)


def steps_table(runs: list) -> Table:
    """One row per mode: the peak, and the bytes moved in at the first denoising step and at each one
    after it (every later step moves the same: all blocks again for layerwise, nothing for model-level)."""
    resident = next((r.summary["peak_device_bytes"] for r in runs if r.mode == "none"), None)
    rows = []
    for r in runs:
        s, by_step = r.summary, r.summary["h2d_bytes_by_step"]
        name = f"layerwise (k={s['prefetch_depth']})" if r.mode == "layerwise" else r.mode
        rows.append([name, s["peak_device_bytes"], resident and s["peak_device_bytes"] / resident,
                     f"{s['max_resident_blocks']} of {s['denoiser_blocks']}", by_step[0],
                     by_step[-1] if len(by_step) > 1 else None, s["host_bytes"]])
    return Table(["mode", ("peak device bytes", "bytes"), ("vs resident", "x:2"), "denoiser blocks resident",
                  ("host to device, first step", "bytes"), ("host to device, each later step", "bytes"),
                  ("host masters (arena)", "bytes")], rows)


def report(result) -> None:
    c, cpu = result.config, result.device.type == "cpu"
    spec = c.model_spec()
    shape = f"width {c.width}" if spec is None else f"{spec.name} ({spec.param_count() / 1e9:.1f} B parameters)"
    print(f"Lab 08 on {result.device}: {c.denoiser_blocks()}-block denoiser, {c.steps} steps, {shape}, {c.dtype}, "
          f"{c.latent_tokens} latent tokens" + (f"; {TRACED}" if c.fake else
                                                 " (CPU: times are CPU times, transfers are memcpy)" if cpu else ""))
    print(modes_table(result.runs, times=not c.fake).text())
    print("\nHost to device per denoising step (the engines' own marks):")
    print(steps_table(result.runs).text())
    if any(r.summary["host_weight_bytes"] for r in result.runs):
        print("\nHost masters (the arenas' power-of-two chunks, pinned on a GPU):")
        print(host_table(result.runs).text())
    if c.snapshot:
        print(f"memory history written to {c.snapshot} (open it at https://pytorch.org/memory_viz)")
