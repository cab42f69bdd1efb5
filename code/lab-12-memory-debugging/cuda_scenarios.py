"""Lab 12's allocator scenarios: fragmentation and an out-of-memory error, and how to read one.

Both need the CUDA caching allocator, so they run on a GPU only. Each experiment runs in a fresh
Python process, because the allocator reads ``PYTORCH_CUDA_ALLOC_CONF`` once, when CUDA starts:
comparing ``expandable_segments`` off and on needs two processes, and a memory cap set for an
out-of-memory test should not outlive the test.

    changing_batch    batches that grow by one sample per iteration: allocated against reserved
    out_of_memory     fill a capped allocator until it raises torch.OutOfMemoryError, or fragment
                      it first, and return the error's message
    read_oom          split an OOM message into its sentences and say what each number is
    next_levers       the pattern the numbers show and the lever to pull for it

This file is also the command line ``in_fresh_process`` runs: one experiment in this process, one
JSON object on stdout. By hand, on a GPU machine:
    .venv/bin/python code/lab-12-memory-debugging/cuda_scenarios.py --experiment changing_batch --iters 4
    .venv/bin/python code/lab-12-memory-debugging/cuda_scenarios.py --experiment out_of_memory --pattern fragmented
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from labkit import cli, labs, marks
from labkit.config import MAX_BATCH, MAX_BYTES, MAX_COUNT, MAX_LAYERS, MAX_STEPS, LabConfig, UsageError, option
from labkit.table import Table
from oom_reader import CLAUSES, next_levers, read_oom

lab16 = labs.load(16)  # on a CPU: the same experiments, simulated by Lab 16's model of the allocator

MiB = 2**20
ALLOC_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
EXPANDABLE = "expandable_segments:True"


def allocator_now(device: torch.device) -> dict:
    """What the caching allocator holds right now: in live tensors, and in total (None on CPU)."""
    if device.type != "cuda":
        return {"allocated": None, "reserved": None, "inactive_split": None}
    stats = torch.cuda.memory_stats(device)
    return {"allocated": torch.cuda.memory_allocated(device),
            "reserved": torch.cuda.memory_reserved(device),
            "inactive_split": stats.get("inactive_split_bytes.all.current", 0)}


# --8<-- [start:fresh]
def in_fresh_process(experiment: str, alloc_conf: str | None = None, **flags) -> dict:
    """Run ``experiment`` through this file's command line, in a new Python process whose allocator
    starts with ``alloc_conf``; ``flags`` are its options (``cap_mb=512`` is ``--cap-mb=512``)."""
    env = {k: v for k, v in os.environ.items() if k not in ALLOC_ENV}
    if alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf  # (1)!
    cmd = [sys.executable, str(Path(__file__).resolve()), f"--experiment={experiment}", "--json",
           *(f"--{name.replace('_', '-')}={value}" for name, value in flags.items())]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)  # (2)!
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{experiment} with {alloc_conf or 'the default allocator'} failed: {last}")
    return {"alloc_conf": alloc_conf or "default", **json.loads(proc.stdout.strip().splitlines()[-1])}
# --8<-- [end:fresh]


# --8<-- [start:fragmentation]
def changing_batch(iters: int = 12, first: int = 8, layers: int = 8, unit_mb: int = 2, wide: int = 4,
                   device: str | torch.device = "cuda") -> dict:
    """Batches that grow by one sample per iteration, as batched inference sees them.

    Each iteration keeps ``layers`` pairs of buffers alive, like a forward keeps activations: one
    of n x ``unit_mb`` MiB and one ``wide`` times larger (n = the batch size, ``first`` at the first
    of ``iters`` iterations), then frees them all.
    """
    device = torch.device(device)
    unit = unit_mb * MiB // 4  # fp32 elements per sample in the narrow buffer
    rows = []
    for i in range(iters):
        n = first + i
        kept = []
        with marks.phase("batch", i):  # a ledger (Lab 16's trace on a CPU) sees each iteration
            for _ in range(layers):
                kept.append(torch.empty(n * unit, device=device))  # (1)!
                kept.append(torch.empty(n * unit * wide, device=device))
            rows.append({"batch": n, "live": sum(t.nbytes for t in kept), **allocator_now(device)})  # (2)!
        del kept  # (3)!
    out = {"rows": rows, "after": allocator_now(device)}
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        out["segments"] = stats.get("segment.all.current", 0)
        out["num_alloc_retries"] = stats.get("num_alloc_retries", 0)
        out["max_allocated"] = torch.cuda.max_memory_allocated(device)
        out["max_reserved"] = torch.cuda.max_memory_reserved(device)
    return out
# --8<-- [end:fragmentation]


# --8<-- [start:oom]
def out_of_memory(pattern: str = "pressure", cap_mb: int = 1024, chunk_mb: int = 64,
                  device: str | torch.device = "cuda") -> dict:
    """Run into a cap of ``cap_mb`` MiB on ``device`` on purpose and return the
    torch.OutOfMemoryError's message, with ``pattern``:

    pressure: allocate chunk_mb buffers until the cap is reached.
    fragmented: cache one big block, carve it into 20 MiB pieces, free every other piece, then
    ask for 40 MiB: half the cap is free, but not in one piece.
    """
    device = torch.device(device)
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(cap_mb * MiB / total, device)  # (1)!
    held: list[torch.Tensor] = []
    try:
        allocate(pattern, cap_mb, chunk_mb, device, held)
        return {"pattern": pattern, "oom": False, "message": None, **allocator_now(device)}
    except torch.OutOfMemoryError as err:  # (2)!
        return {"pattern": pattern, "oom": True, "message": str(err), **allocator_now(device)}
    finally:
        held.clear()
        torch.cuda.set_per_process_memory_fraction(1.0, device)


def allocate(pattern: str, cap_mb: int, chunk_mb: int, device, held: list) -> None:
    """The pattern's buffers, kept in ``held`` (on any device: Lab 16 traces them on a CPU)."""
    if pattern == "pressure":
        for _ in range(cap_mb // chunk_mb + 2):  # (3)!
            held.append(torch.empty(chunk_mb * MiB, dtype=torch.uint8, device=device))
        return
    pieces = cap_mb // 20
    torch.empty(pieces * 20 * MiB, dtype=torch.uint8, device=device)  # (4)!
    held.extend(torch.empty(20 * MiB, dtype=torch.uint8, device=device) for _ in range(pieces))
    del held[::2]  # (5)!
    held.append(torch.empty(40 * MiB, dtype=torch.uint8, device=device))
# --8<-- [end:oom]


# --8<-- [start:experiments]
FRAGMENTATION_RUNS = (None, EXPANDABLE)  # the allocator settings compared
OOM_RUNS = (("pressure", None), ("fragmented", None), ("fragmented", EXPANDABLE))  # (pattern, setting)


def fragmentation(iters: int, layers: int) -> list[dict]:
    """The changing-batch workload with the default allocator and with expandable segments."""
    return [in_fresh_process("changing_batch", conf, iters=iters, layers=layers) for conf in FRAGMENTATION_RUNS]


def simulated(iters: int, layers: int, cap_mb: int) -> tuple[list[dict], list[dict]]:
    """On a CPU: :func:`fragmentation` and :func:`oom_experiments` through Lab 16's model of the caching
    allocator (simulated): each workload traced on fake tensors, replayed with each setting."""
    batch = lab16.as_lab12(lab16.run(lab16.Config(device="cpu", iters=iters, layers=layers)))
    runs = [r for pattern in ("pressure", "fragmented")
            for r in lab16.as_lab12(lab16.run(lab16.Config(device="cpu", workload=pattern, cap_mb=cap_mb)))]
    return batch, [next(r for r in runs if (r["pattern"], r["alloc_conf"]) == (p, c or "default")) for p, c in OOM_RUNS]


def oom_experiments(cap_mb: int) -> list[dict]:
    """Real pressure, fragmentation, and the same fragmentation with expandable segments."""
    runs = [in_fresh_process("out_of_memory", conf, pattern=pattern, cap_mb=cap_mb) for pattern, conf in OOM_RUNS]
    for run in runs:
        if run["message"]:
            run["reading"] = read_oom(run["message"])
            run["levers"] = next_levers(run["reading"]["values"])
    return runs
# --8<-- [end:experiments]


# ---------------------------------------------------------------------- the command line in_fresh_process runs
@dataclass
class Config(LabConfig):
    """Run one allocator experiment in this process and print what it measured as one JSON object.

    Lab 12's starter runs it through in_fresh_process, once per allocator setting."""

    experiment: Literal["changing_batch", "out_of_memory"] = option("changing_batch", "the experiment to run")
    iters: int = option(12, "changing_batch: batch sizes tried, one sample more each", min=1, max=MAX_STEPS)
    first: int = option(8, "changing_batch: the first batch size", min=1, max=MAX_BATCH)
    layers: int = option(8, "changing_batch: buffer pairs kept alive per iteration", min=1, max=MAX_LAYERS)
    unit_mb: int = option(2, "changing_batch: MiB per sample of the narrow buffer", min=1, max=MAX_BYTES >> 20)
    wide: int = option(4, "changing_batch: how many narrow buffers the wide one holds", min=1, max=MAX_COUNT)
    pattern: Literal["pressure", "fragmented"] = option("pressure", "out_of_memory: fill the cap, or fragment it first")
    cap_mb: int = option(1024, "out_of_memory: the memory cap in MiB (the patterns need at least 128)",
                         min=128, max=MAX_BYTES >> 20)
    chunk_mb: int = option(64, "out_of_memory: MiB per buffer of the pressure pattern", min=1, max=MAX_BYTES >> 20)


def run(config: Config) -> dict:
    """The experiment's measurements, with the allocator setting this process started with."""
    device = cli.pick_device(config.device)
    seen = {k: v for k, v in os.environ.items() if k in ALLOC_ENV}
    if config.experiment == "changing_batch":
        out = changing_batch(config.iters, config.first, config.layers, config.unit_mb, config.wide, device)
    else:
        check_cap(config.cap_mb, device, "--experiment out_of_memory")
        out = out_of_memory(config.pattern, config.cap_mb, config.chunk_mb, device)
    return {"conf_seen": seen, **out}


def check_cap(cap_mb: int, device: torch.device, what: str) -> None:
    """An out-of-memory experiment (``what``, as the user asked for it) needs ``device`` to be a
    GPU with more than ``cap_mb`` MiB."""
    if device.type != "cuda":
        raise UsageError(f"{what} needs a CUDA GPU (it caps CUDA's caching allocator)")
    total_mb = torch.cuda.get_device_properties(device).total_memory // MiB
    if cap_mb >= total_mb:
        raise UsageError(f"--cap-mb {cap_mb} must be below the GPU's {total_mb} MiB")


# ---------------------------------------------------------------------- tables ('-' where not measured)
def fragmentation_table(runs: list[dict] | None) -> Table:
    """Peak allocated against peak reserved for each allocator setting of :func:`fragmentation`."""
    measured = {r["alloc_conf"]: r for r in runs or []}
    table = Table(["allocator", ("peak allocated", "bytes"), ("peak reserved", "bytes"),
                   ("reserved / allocated", "x:2"), ("segments", "int"), ("cached after the last free", "bytes")])
    for conf in (c or "default" for c in FRAGMENTATION_RUNS):
        if (r := measured.get(conf)) is None:
            table.add(conf, None, None, None, None, None)
            continue
        allocated, reserved = max(x["allocated"] for x in r["rows"]), max(x["reserved"] for x in r["rows"])
        table.add(conf, allocated, reserved, reserved / allocated, r["segments"], r["after"]["reserved"])
    return table


def oom_table(runs: list[dict] | None) -> Table:
    """Each out-of-memory experiment: did it raise, and which patterns :func:`next_levers` read."""
    measured = {(r["pattern"], r["alloc_conf"]): r for r in runs or []}
    table = Table(["pattern", "allocator", ("torch.OutOfMemoryError", "yes"), ("allocated when it stopped", "bytes"),
                   "what the numbers show"])
    for pattern, conf in OOM_RUNS:
        r = measured.get((pattern, conf or "default"), {})
        shows = "; ".join(lever["pattern"] for lever in r.get("levers", [])) or None
        table.add(pattern, conf or "default", r.get("oom"), r.get("allocated"), shows)
    return table


def oom_numbers_table(runs: list[dict] | None) -> Table:
    """Every number :func:`read_oom` names, in each experiment's message ('-': not in it, or not measured)."""
    measured = {(r["pattern"], r["alloc_conf"]): r.get("reading", {}).get("values", {}) for r in runs or []}
    meaning = {name: what for name, _, what in CLAUSES}
    table = Table([("number", "code"), "what it is",
                   *((f"{pattern}, {conf or 'default'}", "bytes") for pattern, conf in OOM_RUNS)], unit="MiB")
    for name in meaning:
        table.add(name, meaning[name], *(measured.get((p, c or "default"), {}).get(name) for p, c in OOM_RUNS))
    return table


def print_results(fragmentation_runs: list[dict] | None, oom_runs: list[dict] | None, simulated: bool = False) -> None:
    """The allocator experiments for a terminal (Lab 12's report): the tables, then each lever."""
    how = "simulated on this CPU by Lab 16's model of the allocator" if simulated else \
        "each allocator setting in a fresh process"
    if fragmentation_runs:
        print(f"\nFragmentation: allocated against reserved, {how}")
        print(fragmentation_table(fragmentation_runs).text())
    if oom_runs:
        print(f"\nOut of memory on purpose, under a memory cap ({how.split(',')[0]})")
        print(oom_table(oom_runs).text())
        print("\nEvery number of each message, read by read_oom:")
        print(oom_numbers_table(oom_runs).text())
        for r in oom_runs:
            for lever in r.get("levers", []):
                print(f"{r['pattern']}, {r['alloc_conf']}: {lever['pattern']}\n    next lever: {lever['lever']}")


if __name__ == "__main__":
    cli.main(Config, run)
