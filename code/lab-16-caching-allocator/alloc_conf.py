"""Lab 16 - ``PYTORCH_ALLOC_CONF`` read as PyTorch 2.13 reads it, into ``allocator_model.Options``.

The string is ``key:value`` pairs separated by commas, a list in brackets
(``roundup_power2_divisions:[256:1,512:2,>:8]``), white space ignored (``c10/core/AllocatorConfig.h``
L35-53, the 2.13.0 header installed here). Each key's rule is ``c10/core/AllocatorConfig.cpp``'s,
cited by line in the copy at pytorch commit 09384c1fb1d689794fa5bc256f268591c32a8e1e (``CONFIG_SOURCE``
is the file at v2.13.0); the CUDA-only keys are
``c10/cuda/CUDAAllocatorConfig.h``'s (2.13.0). PyTorch refuses what it refuses with an error; this
reader refuses the same, and also what PyTorch would accept but that contradicts itself or that the
model does not hold (a key given twice with two values; a garbage-collection threshold without a
memory fraction, which never runs: ``CUDACachingAllocator.cpp`` L1626), each as one ``UsageError``.
"""

from __future__ import annotations

import re

from labkit.config import UsageError
from allocator_blocks import MiB, Options

CONFIG_SOURCE = "https://github.com/pytorch/pytorch/blob/v2.13.0/c10/core/AllocatorConfig.cpp"
#: Keys PyTorch knows that this model has nothing to say about (host memory, threads, IPC).
INERT = {"pinned_use_background_threads", "pinned_max_round_threshold_mb", "pinned_max_cached_size_mb",
         "release_lock_on_cudamalloc", "pinned_use_cuda_host_register", "pinned_num_register_threads",
         "pinned_reserve_segment_size_mb", "pinned_free_catch_all", "graph_capture_record_stream_reuse"}
KEYS = {"large_segment_size_mb", "max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold",
        "roundup_power2_divisions", "expandable_segments", "per_process_memory_fraction", "backend",
        "throw_on_cudamalloc_oom", *INERT}


def tokens(text: str) -> list[str]:
    """AllocatorConfig.h L37-53: separators , : [ ] are tokens of their own; white space is dropped."""
    return [t for t in re.split(r"([,:\[\]])", re.sub(r"\s+", "", text)) if t]


def pairs(text: str) -> dict[str, str | list[tuple[str, str]]]:
    """``key -> value`` (a list of ``(bound, value)`` for a bracketed list); refuses a malformed string."""
    toks, out, i = tokens(text), {}, 0
    while i < len(toks):
        key = toks[i]
        if key not in KEYS:
            raise UsageError(f"--alloc-conf: unrecognized key {key!r} (PyTorch's keys: {', '.join(sorted(KEYS))})")
        if toks[i + 1:i + 2] != [":"] or i + 2 >= len(toks) or toks[i + 2] in (",", ":", "]"):
            raise UsageError(f"--alloc-conf: {key} needs ':' and a value")
        i += 2
        if toks[i] == "[":
            items, i = [], i + 1
            while i < len(toks) and toks[i] != "]":
                if toks[i + 1:i + 2] != [":"] or i + 2 >= len(toks):
                    raise UsageError(f"--alloc-conf: {key}'s list holds bound:value pairs, got {toks[i]!r}")
                items.append((toks[i], toks[i + 2]))
                i += 3
                if i < len(toks) and toks[i] == ",":
                    i += 1
            if i >= len(toks):
                raise UsageError(f"--alloc-conf: {key}'s list has no closing ']'")
            value: str | list = items
        else:
            value = toks[i]
        if key in out and out[key] != value:
            raise UsageError(f"--alloc-conf: {key} is given twice, as {out[key]} and {value}: which one?")
        out[key] = value
        i += 1
        if i < len(toks):
            if toks[i] != ",":
                raise UsageError(f"--alloc-conf: expected ',' after {key}:{value}, got {toks[i]!r}")
            i += 1
    return out


def parse(text: str) -> Options:
    """The ``Options`` a ``PYTORCH_ALLOC_CONF`` string sets ('' is PyTorch's defaults)."""
    kv = pairs(text or "")
    if kv.get("backend", "native") != "native":
        raise UsageError("--alloc-conf: backend:cudaMallocAsync hands memory to CUDA's own pool allocator, which "
                         "this model does not hold; only backend:native is modelled")
    if kv.get("throw_on_cudamalloc_oom", "False") != "False":
        raise UsageError("--alloc-conf: throw_on_cudamalloc_oom is not modelled (it rejects before cudaMalloc)")
    large = mb(kv, "large_segment_size_mb", 20)
    if large * MiB <= 10 * MiB:  # AllocatorConfig.cpp L97-101
        raise UsageError(f"--alloc-conf: large_segment_size_mb must be > 10 MB, got {large}")
    split = mb(kv, "max_split_size_mb", None)
    rounding = mb(kv, "max_non_split_rounding_mb", large)  # L65: it defaults to large_segment_size
    for name, value in (("max_split_size_mb", split), ("max_non_split_rounding_mb", rounding)):
        if value is not None and value < large:  # L117-120, L136-139
            raise UsageError(f"--alloc-conf: {name} too small, must be >= {large} (large_segment_size_mb), got {value}")
    threshold = number(kv, "garbage_collection_threshold", 0.0)
    if "garbage_collection_threshold" in kv and not 0 < threshold < 1:  # L151-153
        raise UsageError(f"--alloc-conf: garbage_collection_threshold must be in (0.0, 1.0), got {threshold}")
    fraction = number(kv, "per_process_memory_fraction", 1.0)
    if not 0 <= fraction <= 1:  # CUDAAllocatorConfig's check, and setMemoryFraction's (L2324-2328)
        raise UsageError(f"--alloc-conf: per_process_memory_fraction must be in [0.0, 1.0], got {fraction}")
    if threshold and fraction >= 1:
        raise UsageError("--alloc-conf: garbage_collection_threshold without per_process_memory_fraction below 1 "
                         "contradicts itself: PyTorch collects only under a memory fraction (CUDACachingAllocator.cpp "
                         "L1626-1631), so it would never run")
    expandable = kv.get("expandable_segments", "False")
    if expandable not in ("True", "False"):  # AllocatorConfig.h L80-95: exactly True or False
        raise UsageError(f"--alloc-conf: expandable_segments takes True or False, got {expandable!r}")
    return Options(max_split_size=None if split is None else split * MiB, max_non_split_rounding=rounding * MiB,
                   roundup_power2_divisions=divisions(kv.get("roundup_power2_divisions")),
                   garbage_collection_threshold=threshold, expandable_segments=expandable == "True",
                   large_segment_size=large * MiB, memory_fraction=fraction)


def divisions(value) -> tuple[int, ...]:
    """L159-221: one division count per power of two from 1 MiB to 64 GiB (16 intervals)."""
    out = [0] * 16
    if value is None:
        return tuple(out)
    if isinstance(value, str):  # L214-220: one value for every interval
        n = whole("roundup_power2_divisions", value)
        if not power_of_two(n):
            raise UsageError(f"--alloc-conf: roundup_power2_divisions has to be a power of 2, got {n}")
        return (n,) * 16
    last, first = 0, True
    for bound, text in value:
        n = whole("roundup_power2_divisions", text)
        if n and not power_of_two(n):  # L172-174
            raise UsageError(f"--alloc-conf: roundup_power2_divisions has to be a power of 2 or 0, got {n}")
        if bound == ">":  # L176-183: the value for every interval after the last bound
            out[last + 1:] = [n] * (15 - last)
            continue
        b = whole("roundup_power2_divisions", bound)
        if not power_of_two(b):  # L186-188
            raise UsageError(f"--alloc-conf: roundup_power2_divisions' bounds have to be powers of 2, got {b}")
        index = min(b.bit_length() - 1, 15)  # L190-192: the bound in MB picks the interval
        if first:  # L194-201: the first value also covers the intervals below it
            out[:index] = [n] * index
            first = False
        out[index], last = n, index
    return tuple(out)


def power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def whole(key: str, text: str) -> int:
    if not text.isdigit():
        raise UsageError(f"--alloc-conf: {key} takes a whole number, got {text!r}")
    return int(text)


def mb(kv: dict, key: str, default):
    return default if key not in kv else whole(key, kv[key])


def number(kv: dict, key: str, default: float) -> float:
    if key not in kv:
        return default
    try:
        value = float(kv[key])
    except ValueError:
        raise UsageError(f"--alloc-conf: {key} takes a number, got {kv[key]!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise UsageError(f"--alloc-conf: {key} takes a finite number, got {kv[key]!r}")
    return value
