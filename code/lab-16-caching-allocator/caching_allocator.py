"""Lab 16 - the caching allocator, simulated: reserved memory, fragmentation and the real OOM line.

A GPU runs out of memory at *reserved* bytes, not at the bytes tensors hold. This lab replays what a
memory ledger recorded through a model of PyTorch's CUDA caching allocator written from its source
(``allocator_model.py``, rule by rule with the source lines; ``replay.py``), so reserved bytes,
segments, per-stream pools and the out-of-memory message come out of a CPU run:

    changing-batch  Lab 12's batches that grow by one sample, traced on fake tensors: reserved
                    against allocated, with the default allocator and with expandable segments
    fragmented      Lab 12's fragmented cache under a 1 GiB cap: the OOM error a GPU raises, read by
                    Lab 12's reader; then the same pattern with expandable segments (``pressure``: its
                    other pattern, buffers past the cap)
    step            Lab 13's step of a real model at real size (FSDP2's streams included), replayed:
                    the reserved peak a GPU would report, and Lab 13's verdict in reserved bytes

Each workload is replayed twice: with ``--alloc-conf`` (``PYTORCH_ALLOC_CONF``'s syntax) and with
``expandable_segments:True`` added. On a GPU (``--device cuda``) the same workload also runs for real
and the simulation stands next to the allocator's own counters. Run it:
    .venv/bin/python code/lab-16-caching-allocator/caching_allocator.py --device cpu
    .venv/bin/python code/lab-16-caching-allocator/caching_allocator.py --workload fragmented
    .venv/bin/python code/lab-16-caching-allocator/caching_allocator.py --workload step --model llama-3.2-1b --seq 2048
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import alloc_conf
import replay
from allocator_blocks import GiB, KiB, MiB, Options, format_size, round_size, segment_size
from labkit import cli, fake, labs, provenance, zoo
from labkit.config import MAX_BYTES, LabConfig, UsageError, option, summary_of
from labkit.ledger import Ledger
from labkit.table import Table
from replay import Events, Replay
from reserved_bytes import CUDA_CONTEXT, CUDA_CONTEXT_SOURCE, simulate

TrainingRun = labs.load(1, "fit_inputs").TrainingRun  # --batch ... --zero-stage: Lab 13's flags, once
Step = labs.load(13).Step  # --model, --task
scenarios = labs.load(12, "cuda_scenarios")  # the changing batch and the fragmented cache, as Lab 12 runs them
oom_reader = labs.load(12, "oom_reader")  # an OOM message, number by number
GPUS = labs.load(13, "fit_gpus").GPUS  # the cards, with the total their driver reports
parse_bytes = labs.load(6).parse_bytes  # '80GiB' -> bytes



# --8<-- [start:workloads]
def traced(workload) -> Events:
    """``workload()`` on fake tensors under a memory ledger: every allocation and free, nothing allocated."""
    with fake.tensors(), Ledger("cpu") as ledger:
        workload()
    return replay.events_of(ledger)


def changing_batch(config: Config) -> Events:
    """Lab 12's growing batch (``scenarios.changing_batch``), as a GPU would allocate it."""
    return traced(lambda: scenarios.changing_batch(config.iters, layers=config.layers, device="cpu"))


def capped(config: Config) -> Events:
    """Lab 12's out-of-memory patterns (``scenarios.allocate``): ``fragmented``, 20 MiB pieces of one big
    block, every other one freed, then 40 MiB asked for; ``pressure``, 64 MiB buffers past the cap."""
    return traced(lambda: scenarios.allocate(config.workload, config.cap_mb, 64, "cpu", []))


def step(config: Config):
    """Lab 13's trace of the step ``config`` names (a real model at real size, per rank)."""
    lab13 = labs.load(13)
    fields = {k: getattr(config, k) for k in (*TrainingRun.__dataclass_fields__, *Step.__dataclass_fields__)}
    return lab13.trace(lab13.Config(**fields, gpu=config.gpu, levers="none"))


# --8<-- [end:workloads]




# ----------------------------------------------------------------------------- the configuration
CAPPED = ("fragmented", "pressure")  # Lab 12's capped patterns: a memory fraction of cap_mb


@dataclass
class Config(TrainingRun, Step, LabConfig):
    """The caching allocator, simulated: a workload's reserved bytes, segments and OOM, on a CPU."""

    workload: Literal["changing-batch", "fragmented", "pressure", "step"] = option("changing-batch", "what to replay")
    alloc_conf: str = option("", "PYTORCH_ALLOC_CONF for the model, e.g. max_split_size_mb:64 (the run also adds "
                                 "expandable_segments:True)", metavar="TEXT")
    gpu: Literal[tuple(GPUS)] = option("h100-80gb", "the GPU whose memory the allocator has (its driver's total)")
    capacity: int | None = option(None, "the GPU's bytes instead of --gpu's, e.g. 24GiB", parse=parse_bytes,
                                  metavar="BYTES", min=1, max=MAX_BYTES)
    iters: int = option(12, "changing-batch: batch sizes, one sample more each (Lab 12's default)", min=1, max=64)
    layers: int = option(8, "changing-batch: buffer pairs kept alive per batch (Lab 12's default)", min=1, max=64)
    cap_mb: int = option(1024, "fragmented, pressure: the memory cap (set_per_process_memory_fraction), MiB", min=128,
                        max=MAX_BYTES >> 20)
    ledger: Path | None = option(None, "replay this ledger file (written by --export) instead of a workload",
                                 path="read")
    export: Path | None = option(None, "write the workload's ledger file here", path="write")

    def __post_init__(self) -> None:
        super().__post_init__()
        zoo.get(self.model)  # --model is read with the flags: a bad name or config.json is refused before any run
        self.options = alloc_conf.parse(self.alloc_conf)
        total = self.total_bytes
        if total < CUDA_CONTEXT + 2 * MiB:  # the smallest segment is 2 MiB (allocator_model.SMALL_BUFFER)
            raise UsageError(f"--capacity {total} B holds not one 2 MiB segment beside the {format_size(CUDA_CONTEXT)} "
                             "CUDA context")
        if self.workload in CAPPED and self.cap_mb * MiB > total - CUDA_CONTEXT:
            raise UsageError(f"--cap-mb {self.cap_mb} is more than the GPU leaves ({format_size(total - CUDA_CONTEXT)})")
        if self.workload == "step":
            self.check_sharding()

    @property
    def total_bytes(self) -> int:
        return self.capacity or GPUS[self.gpu].total_bytes


# ----------------------------------------------------------------------------- the run
@dataclass
class Run:
    """One allocator setting's replay of the workload."""

    setting: str
    replay: Replay
    oom_reading: dict | None = None  # Lab 12's reader on the OOM message, when there is one


@dataclass
class Result:
    config: Config
    traced_peak: int
    runs: list[Run]
    wall_time_s: float
    measured: dict | None = None  # on a GPU: the real allocator's counters for the same workload
    iterations: list[dict] = field(default_factory=list)  # changing-batch: reserved per batch size

    def summary(self) -> dict:
        return {"workload": self.config.workload, "traced_peak_bytes": self.traced_peak,
                "runs": [run_summary(r) for r in self.runs], "iterations": self.iterations,
                "measured_on_gpu": self.measured, "config": summary_of(self.config) | {"options": str(self.config.options)},
                "cuda_context_bytes": CUDA_CONTEXT, "cuda_context_source": CUDA_CONTEXT_SOURCE,
                "provenance": provenance.collect(__file__, "cpu", self.wall_time_s)}


def run(config: Config) -> Result:
    t0 = time.perf_counter()
    device = cli.pick_device(config.device)
    ev = replay.load(config.ledger) if config.ledger else {
        "changing-batch": changing_batch, "fragmented": capped, "pressure": capped,
        "step": lambda c: replay.events_of(step(c).ledger)}[config.workload](config)
    if config.export:
        config.export.write_text(json.dumps(replay.export_events(ev)), encoding="utf-8")
    runs = []
    for name, options in settings(config):
        capacity = config.total_bytes
        if config.workload in CAPPED and not config.ledger:
            options = replace(options, memory_fraction=config.cap_mb * MiB / capacity)
        step_ = config.workload == "step"
        r = simulate(ev, options, capacity, workspaces=2 if step_ else 0, repeat=2 if step_ else 1)
        runs.append(Run(name, r, oom_reader.read_oom(str(r.oom)) if r.oom else None))
    result = Result(config, max(runs[0].replay.traced, default=0), runs, time.perf_counter() - t0,
                    iterations=per_iteration(ev, runs) if config.workload == "changing-batch" else [])
    if device.type == "cuda" and not config.ledger:
        result.measured = measure_on_gpu(config)
    return result


# --8<-- [start:settings]
def settings(config: Config) -> list[tuple[str, Options]]:
    """The allocator settings each workload is replayed with: ``--alloc-conf``, and it plus expandable segments."""
    name = config.alloc_conf or "default"
    if config.options.expandable_segments:
        return [(name, config.options)]
    return [(name, config.options), (f"{config.alloc_conf + ',' if config.alloc_conf else ''}expandable_segments:True",
                                     replace(config.options, expandable_segments=True))]
# --8<-- [end:settings]


def per_iteration(ev: Events, runs: list[Run]) -> list[dict]:
    """changing-batch: each batch's moment (the end of its ``batch`` phase, its buffers alive)."""
    ends = sorted(ev.boundaries)[1::2]
    return [{"iteration": i, **{r.setting: {"allocated": r.replay.allocated[at - 1], "reserved": r.replay.reserved[at - 1]}
                                for r in runs if at - 1 < len(r.replay.reserved)}} for i, at in enumerate(ends)]


def measure_on_gpu(config: Config) -> dict:
    """The same workload on a real GPU, each allocator setting in a fresh process (Lab 12's, Lab 13's)."""
    if config.workload == "changing-batch":
        runs = [scenarios.in_fresh_process("changing_batch", None if name == "default" else name, iters=config.iters,
                                           layers=config.layers) for name, _ in settings(config)]
        return {"runs": runs}
    if config.workload in CAPPED:
        return {"runs": [scenarios.in_fresh_process("out_of_memory", None if name == "default" else name,
                                                    pattern=config.workload, cap_mb=config.cap_mb)
                         for name, _ in settings(config)]}
    lab13 = labs.load(13)
    traced_step = step(config)
    return lab13.measure_on_gpu(traced_step.config, traced_step)


def run_summary(r: Run) -> dict:
    rp = r.replay
    return {"setting": r.setting, "peak_allocated_bytes": rp.peak_allocated, "peak_reserved_bytes": rp.peak_reserved,
            "reserved_over_allocated": rp.peak_reserved / max(rp.peak_allocated, 1), "by_stream": rp.by_stream,
            "segments": len(rp.allocator.blocks()), "retries": rp.retries,
            "oom": None if rp.oom is None else {"message": str(rp.oom), "numbers": rp.oom.numbers, "at_event": rp.oom_at,
                                                "reading": r.oom_reading}}


# ----------------------------------------------------------------------------- what it prints
REQUESTS = (1, 4 * KiB, MiB, MiB + 1, 9 * MiB, 10 * MiB, 12 * MiB + 1, 100 * MiB + 1)


def sizes_table(divisions: int = 4) -> Table:
    """What a request becomes (allocator_model's rules): its block, its pool, the segment a cudaMalloc
    makes when no cached block fits, and its block under ``roundup_power2_divisions:<divisions>``."""
    rounded = alloc_conf.parse(f"roundup_power2_divisions:{divisions}")
    return Table([("request", "size"), ("block", "size"), "pool", ("new segment", "size"),
                  (f"block, {divisions} divisions", "size")],
                 [[n, round_size(n), "small" if round_size(n) <= MiB else "large", segment_size(round_size(n)),
                   round_size(n, rounded)] for n in REQUESTS])


def as_lab12(result: Result) -> list[dict]:
    """The runs in the form of Lab 12's GPU experiments, so that its tables show the simulation."""
    out = []
    for r in result.runs:
        rp = r.replay
        row = {"alloc_conf": r.setting, "segments": len(rp.allocator.blocks()), "num_alloc_retries": rp.retries,
               "after": {"reserved": rp.reserved[-1] if rp.reserved else 0},
               "rows": [{"allocated": it[r.setting]["allocated"], "reserved": it[r.setting]["reserved"]}
                        for it in result.iterations if r.setting in it] or
                       [{"allocated": rp.peak_allocated, "reserved": rp.peak_reserved}],
               "pattern": result.config.workload, "oom": rp.oom is not None, "message": str(rp.oom) if rp.oom else None,
               "allocated": rp.oom.numbers["allocated"] if rp.oom else last_allocated(rp)}
        if r.oom_reading:
            row["reading"], row["levers"] = r.oom_reading, oom_reader.next_levers(r.oom_reading["values"])
        out.append(row)
    return out


def last_allocated(rp: Replay) -> int:
    """What was allocated after the workload's last allocation (before it let go of everything)."""
    grew = [i for i in range(1, len(rp.allocated)) if rp.allocated[i] > rp.allocated[i - 1]]
    return rp.allocated[grew[-1]] if grew else 0


def runs_table(result: Result) -> Table:
    """Each allocator setting: the traced peak, the simulated allocated and reserved peaks, the cache."""
    return Table(["allocator", ("traced peak", "bytes"), ("allocated peak", "bytes"), ("reserved peak", "bytes"),
                  ("reserved / allocated", "x:2"), ("segments at the end", "int"), ("retries", "int"), "out of memory"],
                 [[r.setting, result.traced_peak, r.replay.peak_allocated, r.replay.peak_reserved,
                   r.replay.peak_reserved / max(r.replay.peak_allocated, 1), len(r.replay.allocator.blocks()),
                   r.replay.retries, f"at event {r.replay.oom_at}" if r.replay.oom else "no"] for r in result.runs],
                 unit="GiB" if result.traced_peak > 8 * GiB else "MiB", strong=("reserved peak",))


def streams_table(result: Result) -> Table:
    """Reserved bytes by the stream whose pool holds them, per setting (FSDP2 keeps three pools)."""
    streams = sorted({s for r in result.runs for s in r.replay.by_stream})
    return Table(["allocator", *((s, "bytes") for s in streams)],
                 [[r.setting, *(r.replay.by_stream.get(s, 0) for s in streams)] for r in result.runs], unit="GiB")


def iterations_table(result: Result) -> Table:
    names = [r.setting for r in result.runs]
    return Table(["batch", *((f"{n}: reserved", "bytes") for n in names), ("allocated", "bytes")],
                 [[row["iteration"], *(row.get(n, {}).get("reserved") for n in names),
                   row.get(names[0], {}).get("allocated")] for row in result.iterations], unit="MiB")


def report(result: Result) -> None:
    c = result.config
    print(f"Lab 16 · the caching allocator, simulated: {c.ledger or c.workload} on {c.gpu if not c.capacity else 'a GPU'} "
          f"of {format_size(c.total_bytes)}; simulated, from the source's rules (allocator_model.py)")
    print(runs_table(result).text())
    if c.workload == "step" or any(len(r.replay.by_stream) > 1 for r in result.runs):
        print("\nReserved by stream (each stream has its own pool of cached blocks):")
        print(streams_table(result).text())
    if result.iterations:
        print("\nPer batch size, while its buffers are alive:")
        print(iterations_table(result).text())
    for r in result.runs:
        if r.replay.oom:
            print(f"\n{r.setting}: {r.replay.oom}")
            for lever in oom_reader.next_levers(r.oom_reading["values"]):
                print(f"  {lever['pattern']}: {lever['lever']}")
    if result.measured:
        print(f"\nOn this GPU, for real: {json.dumps(result.measured)[:2000]}")


if __name__ == "__main__":
    cli.main(Config, run, report)
