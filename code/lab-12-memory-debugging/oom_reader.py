"""Lab 12's OOM reader: a torch.OutOfMemoryError message, sentence by sentence, and the next lever.

    read_oom      split the message into its sentences and name every number in it
    next_levers   the pattern those numbers show, and the lever to pull for it

Plain text in, plain data out: it reads a message from any run, in the current wording and in the
one before PyTorch 2.1 (cuda_scenarios.py makes real ones on a GPU). From another lab or a
notebook: ``labs.load(12, "oom_reader").read_oom(str(err))``.
"""

from __future__ import annotations

import re

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
                    "lever": "PYTORCH_ALLOC_CONF=expandable_segments:True (it wins over PYTORCH_CUDA_ALLOC_CONF); keep shapes steady"})
    if not out or v.get("allocated", 0) >= limit * 2 / 3:  # (3)!
        out.append({"pattern": "live tensors fill most of the memory",
                    "lever": "find what is alive (live-by-origin table, snapshot), then shrink it: "
                             "leaks, activations (Labs 04, 06), precision (Lab 03), offload "
                             "(Labs 07-09), sharding (Lab 11)"})
    return out
# --8<-- [end:levers]
