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

A worker can be run by hand on a GPU machine (it prints one JSON object):
    python code/lab-12-memory-debugging/cuda_scenarios.py changing_batch '{"iters": 4}'
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

MiB = 2**20


def allocator_now(device: torch.device) -> dict:
    """What the caching allocator holds right now: in live tensors, and in total (None on CPU)."""
    if device.type != "cuda":
        return {"allocated": None, "reserved": None, "inactive_split": None}
    stats = torch.cuda.memory_stats(device)
    return {"allocated": torch.cuda.memory_allocated(device),
            "reserved": torch.cuda.memory_reserved(device),
            "inactive_split": stats.get("inactive_split_bytes.all.current", 0)}


# --8<-- [start:fresh]
def in_fresh_process(worker: str, alloc_conf: str | None = None, **kwargs) -> dict:
    """Run ``worker(**kwargs)`` in a new Python process whose allocator starts with ``alloc_conf``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    if alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf  # (1)!
    cmd = [sys.executable, str(Path(__file__).resolve()), worker, json.dumps(kwargs)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)  # (2)!
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{worker} with {alloc_conf or 'the default allocator'} failed: {last}")
    return {"alloc_conf": alloc_conf or "default", **json.loads(proc.stdout.strip().splitlines()[-1])}
# --8<-- [end:fresh]


# --8<-- [start:fragmentation]
def changing_batch(iters: int = 12, first: int = 8, layers: int = 8, unit_mb: int = 2, wide: int = 4,
                   device: str = "cuda") -> dict:
    """Batches that grow by one sample per iteration, as batched inference sees them.

    Each iteration keeps ``layers`` pairs of buffers alive, like a forward keeps activations: one
    of n x unit_mb MiB and one ``wide`` times larger (n = the batch size), then frees them all.
    """
    device = torch.device(device)
    unit = unit_mb * MiB // 4  # fp32 elements per sample in the narrow buffer
    rows = []
    for i in range(iters):
        n = first + i
        kept = []
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
                  device: str = "cuda") -> dict:
    """Run into a memory cap on purpose and return the torch.OutOfMemoryError's message.

    pressure: allocate chunk_mb buffers until the cap is reached.
    fragmented: cache one big block, carve it into 20 MiB pieces, free every other piece, then
    ask for 40 MiB: half the cap is free, but not in one piece.
    """
    device = torch.device(device)
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(cap_mb * MiB / total, device)  # (1)!
    held: list[torch.Tensor] = []
    try:
        if pattern == "pressure":
            for _ in range(cap_mb // chunk_mb + 2):  # (2)!
                held.append(torch.empty(chunk_mb * MiB, dtype=torch.uint8, device=device))
        else:
            pieces = cap_mb // 20
            torch.empty(pieces * 20 * MiB, dtype=torch.uint8, device=device)  # (3)!
            held = [torch.empty(20 * MiB, dtype=torch.uint8, device=device) for _ in range(pieces)]
            del held[::2]  # (4)!
            held.append(torch.empty(40 * MiB, dtype=torch.uint8, device=device))
        return {"pattern": pattern, "oom": False, "message": None, **allocator_now(device)}
    except torch.OutOfMemoryError as err:  # (5)!
        return {"pattern": pattern, "oom": True, "message": str(err), **allocator_now(device)}
    finally:
        held.clear()
        torch.cuda.set_per_process_memory_fraction(1.0, device)
# --8<-- [end:oom]


# --8<-- [start:reader]
SIZE = r"(\d+(?:\.\d+)?) (bytes|KiB|MiB|GiB|TiB)"
UNITS = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}

#: (name, pattern, what the number is). Both wordings: PyTorch >= 2.1, and the older one.
CLAUSES = [
    ("request", rf"Tried to allocate {SIZE}",
     "the segment the allocator failed to get: the request rounded up"),  # (1)!
    ("capacity", rf"total capacity of {SIZE}", "all the memory the GPU has"),
    ("free", rf"of which {SIZE} is free", "free on the GPU for anyone, as the driver sees it"),
    ("other_process", rf"Process \d+ has {SIZE} memory in use", "held by another process"),
    ("process", rf"this process has {SIZE} memory in use",
     "all this process holds: PyTorch's cache and the CUDA context, library workspaces, NCCL"),  # (2)!
    ("allowed", rf"{SIZE} allowed;", "the cap set by set_per_process_memory_fraction"),
    ("allocated", rf"{SIZE} is allocated by PyTorch", "in live tensors: memory_allocated()"),
    ("private_pools", rf"{SIZE} allocated in private pools", "kept by CUDA graphs' private pools"),
    ("unallocated", rf"{SIZE} is reserved by PyTorch but unallocated",
     "cached, in no tensor, and not one free piece big enough: memory_reserved() - memory_allocated()"),  # (3)!
    ("capacity", rf"{SIZE} total capacity", "all the memory the GPU has"),
    ("allocated", rf"{SIZE} already allocated", "in live tensors: memory_allocated()"),
    ("free", rf"{SIZE} free\b", "free on the GPU for anyone, as the driver sees it"),
    ("reserved", rf"{SIZE} reserved in total by PyTorch", "held by the caching allocator: memory_reserved()"),
]


def to_bytes(number: str, unit: str) -> int:
    return round(float(number) * UNITS[unit])


def read_oom(message: str) -> dict:
    """The sentences of an OOM message, each with the numbers it holds, and the numbers by name."""
    lines, values = [], {}
    for sentence in re.split(r"(?<=[.;])\s+(?=[A-Z(\d])", message.strip()):  # (4)!
        found = []
        for name, pattern, meaning in CLAUSES:
            for m in re.finditer(pattern, sentence):
                nbytes = to_bytes(*m.groups())
                found.append({"name": name, "bytes": nbytes, "meaning": meaning})
                if name == "other_process":
                    values[name] = values.get(name, 0) + nbytes
                else:
                    values.setdefault(name, nbytes)
        lines.append({"text": sentence, "numbers": found})
    if "reserved" not in values and "allocated" in values and "unallocated" in values:
        values["reserved"] = values["allocated"] + values["unallocated"]
    if "unallocated" not in values and "reserved" in values and "allocated" in values:
        values["unallocated"] = values["reserved"] - values["allocated"]
    named = [n for line in lines for n in line["numbers"] if n["name"] == "other_process"]
    if "process" not in values and len(named) == 1 and named[0]["bytes"] >= values.get("reserved", 0):
        values["process"] = values.pop("other_process")  # (5)!
    return {"lines": lines, "values": values}
# --8<-- [end:reader]


# --8<-- [start:levers]
def next_levers(v: dict) -> list[dict]:
    """What the numbers of an OOM message show, and the lever to pull for each pattern."""
    req, unalloc, reserved = v.get("request", 0), v.get("unallocated", 0), v.get("reserved", 0)
    limit = v.get("allowed") or v.get("capacity") or 0
    if limit and req > limit:  # (1)!
        return [{"pattern": "one tensor larger than all the memory there is",
                 "lever": "change the shape: chunk the computation (Lab 05), a smaller batch; "
                          "no allocator setting can help"}]
    out = []
    if v.get("allowed") and v.get("free", 0) > req:
        out.append({"pattern": "a cap stopped it while the GPU still had free memory",
                    "lever": "raise or remove set_per_process_memory_fraction if the cap is not meant"})
    if v.get("other_process"):
        out.append({"pattern": "another process holds memory on this GPU",
                    "lever": "find it (nvidia-smi) and stop it, or use another GPU"})
    if v.get("process", 0) - reserved > max(2**30, v.get("process", 0) // 10):
        out.append({"pattern": "memory outside PyTorch's allocator",
                    "lever": "CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers, other libraries: "
                             "the ledger and memory_allocated() do not see them"})
    if unalloc >= req > 0:  # (2)!
        out.append({"pattern": "fragmentation: enough is cached, but not in one piece",
                    "lever": "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; keep shapes steady"})
    if not out or v.get("allocated", 0) >= limit * 2 / 3:  # (3)!
        out.append({"pattern": "live tensors fill most of the memory",
                    "lever": "find what is alive (live-by-origin table, snapshot), then shrink it: "
                             "leaks, activations (Labs 04, 06), precision (Lab 03), offload "
                             "(Labs 07-09), sharding (Lab 11)"})
    return out
# --8<-- [end:levers]


# --8<-- [start:experiments]
def fragmentation(iters: int, layers: int) -> list[dict]:
    """The changing-batch workload with the default allocator and with expandable segments."""
    return [in_fresh_process("changing_batch", conf, iters=iters, layers=layers)
            for conf in (None, "expandable_segments:True")]


def oom_experiments(cap_mb: int) -> list[dict]:
    """Real pressure, fragmentation, and the same fragmentation with expandable segments."""
    runs = [in_fresh_process("out_of_memory", None, pattern="pressure", cap_mb=cap_mb),
            in_fresh_process("out_of_memory", None, pattern="fragmented", cap_mb=cap_mb),
            in_fresh_process("out_of_memory", "expandable_segments:True", pattern="fragmented", cap_mb=cap_mb)]
    for run in runs:
        if run["message"]:
            run["reading"] = read_oom(run["message"])
            run["levers"] = next_levers(run["reading"]["values"])
    return runs
# --8<-- [end:experiments]


WORKERS = {"changing_batch": changing_batch, "out_of_memory": out_of_memory}

if __name__ == "__main__":
    name, kwargs = sys.argv[1], json.loads(sys.argv[2] if len(sys.argv) > 2 else "{}")
    seen = {k: v for k, v in os.environ.items() if k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    print(json.dumps({"conf_seen": seen, **WORKERS[name](**kwargs)}))  # what this allocator started with
