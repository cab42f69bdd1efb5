"""Lab 16 - the caching allocator's sizes and bookkeeping: how a request is rounded, which segment
a cudaMalloc gets, and the blocks, segments and free lists the rules of ``allocator_model.py`` move
around. Lines (``L2823``) are those of ``c10/cuda/CUDACachingAllocator.cpp`` (``SOURCE``) in the copy
``allocator_model.py`` names."""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

SOURCE = "https://github.com/pytorch/pytorch/blob/v2.13.0/c10/cuda/CUDACachingAllocator.cpp"
KiB, MiB, GiB = 2**10, 2**20, 2**30

# --8<-- [start:sizes]
MIN_BLOCK = 512  # every size is rounded up to a multiple of 512 B (AllocatorConfig.h L19)
SMALL_SIZE = 1 * MiB  # requests up to 1 MiB are "small" (L21) ...
SMALL_BUFFER = 2 * MiB  # ... and packed into 2 MiB segments (L17)
MIN_LARGE_ALLOC = 10 * MiB  # requests under 10 MiB share a large_segment_size segment (L23) ...
ROUND_LARGE = 2 * MiB  # ... larger ones get their own segment, rounded up to 2 MiB (L25)


@dataclass(frozen=True)
class Options:
    """``PYTORCH_ALLOC_CONF``'s settings (``alloc_conf.parse`` reads the string), PyTorch's defaults."""

    max_split_size: int | None = None  # blocks this large are never split (None: no limit)
    max_non_split_rounding: int = 20 * MiB  # how much larger an oversize block may be than its request
    roundup_power2_divisions: tuple[int, ...] = (0,) * 16  # per power of two from 1 MiB (0: off)
    garbage_collection_threshold: float = 0.0  # collect cached blocks above this share of the cap
    expandable_segments: bool = False
    large_segment_size: int = 20 * MiB
    memory_fraction: float = 1.0  # set_per_process_memory_fraction: the allocator's own cap


DEFAULTS = Options()  # what PyTorch does when PYTORCH_ALLOC_CONF is not set


def round_size(size: int, o: Options = DEFAULTS) -> int:
    """L2823-2834: at least 512 B; a multiple of 512 B, or of a power-of-two division (L2803)."""
    if size < MIN_BLOCK:
        return MIN_BLOCK
    divisions = o.roundup_power2_divisions[min(max(size.bit_length() - 1 - 20, 0), 15)]  # AllocatorConfig.cpp L69
    if divisions > 1 and size > MIN_BLOCK * divisions:
        floor = 1 << (size.bit_length() - 1)
        if floor == size:
            return size
        step = floor // divisions  # L2803-2821: the next of `divisions` equal steps above the power of two
        return size if size % step == 0 else (size // step + 1) * step
    return -(-size // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int, o: Options = DEFAULTS) -> int:
    """L3433-3441: the cudaMalloc a rounded request needs when no cached block fits it."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return o.large_segment_size
    return -(-size // ROUND_LARGE) * ROUND_LARGE
# --8<-- [end:sizes]


class OutOfMemory(RuntimeError):
    """What ``torch.OutOfMemoryError`` says (L1797-1822), with its numbers as attributes (its last
    sentence, a link to PyTorch's documentation, is left out)."""

    def __init__(self, message: str, numbers: dict) -> None:
        super().__init__(message)
        self.numbers = numbers


_counter = itertools.count()  # a Block's registration order: the tie-break of best fit (L1011-1019)


@dataclass(eq=False)
class Block:
    size: int
    addr: int
    stream: str
    small: bool
    segment: Segment
    allocated: bool = False
    requested: int = 0
    mapped: bool = True  # expandable segments: backed by physical pages
    prev: Block | None = None
    next: Block | None = None
    event_count: int = 0  # outstanding events of the streams it was used on
    uses: set = field(default_factory=set)  # record_stream: other streams that used it
    gc_base: int = 0
    counter: int = field(default_factory=lambda: next(_counter))

    def split(self) -> bool:
        return self.prev is not None or self.next is not None


@dataclass(eq=False)
class Segment:
    addr: int
    size: int  # cudaMalloc'd bytes; for an expandable segment, its address space
    stream: str
    small: bool
    page: int = 0  # expandable: bytes mapped at a time (2 MiB small, large_segment_size large)


class FreeBlocks:
    """One pool's free blocks, per stream, sorted as the real set is: by size, then age (L1011)."""

    def __init__(self) -> None:
        self.keys: dict[str, list] = {}
        self.calls = 0  # get_free_block calls, the clock of garbage collection (L3450)

    def add(self, b: Block) -> None:
        b.gc_base = self.calls  # L237-240 (insert_into_blocks)
        bisect.insort(self.keys.setdefault(b.stream, []), (b.size, b.counter, b))

    def remove(self, b: Block) -> None:
        keys = self.keys[b.stream]
        del keys[bisect.bisect_left(keys, (b.size, b.counter))]

    def all(self) -> list[Block]:
        return [k[2] for stream in sorted(self.keys) for k in self.keys[stream]]



def format_size(n: int) -> str:
    """c10's format_size (c10/core/Allocator.h L432-449), as the OOM message prints sizes."""
    if n <= 1024:
        return f"{n} bytes"
    for unit, scale in (("KiB", KiB), ("MiB", MiB)):
        if n <= scale * 1024:
            return f"{n / scale:.2f} {unit}"
    return f"{n / GiB:.2f} GiB"
