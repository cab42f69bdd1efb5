"""Lab 08 - a pinned host arena: many flat buffers, asked of the allocator in power-of-two chunks.

PyTorch's caching host allocator (``aten/src/ATen/core/CachingHostAllocator.h``) rounds every
pinned request up to the next power of two (``c10::llvm::PowerOf2Ceil``), so that a freed block
can serve any later request of its size class. A transformer block's weights, 16·w² parameters
plus biases and norms, sit just above a power of two: one pinned buffer per block of a width-1024
bf16 denoiser asks for 33,593,344 bytes and is given 64 MiB, nearly twice what it holds.

The arena asks the allocator only for sizes that already are powers of two, so the rounding adds
nothing, and packs the units (one flat buffer per block, per component or per module) into those
chunks. Every unit stays one contiguous region, so moving a block is still one copy; what a chunk
wastes is the tail that no remaining unit fits into.

Without a GPU the same chunks are allocated unpinned, so a memory ledger that labels them
``host_copies`` (from outside: ``ledger.track(arena.chunks, "host_copies")``) counts exactly the
host bytes a GPU run would pin.
"""

from __future__ import annotations

import torch


def next_pow2(n: int) -> int:
    """What the caching host allocator reserves for a request of ``n`` bytes."""
    return 1 << (n - 1).bit_length() if n > 1 else n


def chunk_bytes(chunks: list[list[int]], sizes: list[int]) -> int:
    """Bytes a packing costs: each chunk is the smallest power of two that holds its units."""
    return sum(next_pow2(sum(sizes[i] for i in units)) for units in chunks)


def first_fit(sizes: list[int], order: list[int], capacity: int) -> list[list[int]]:
    """Put each unit, in ``order``, into the first chunk with room for it; open a chunk if none has."""
    chunks: list[list[int]] = []
    room: list[int] = []
    for i in order:
        c = next((c for c, free in enumerate(room) if sizes[i] <= free), None)
        if c is None:
            chunks.append([])
            room.append(capacity)
            c = len(chunks) - 1
        chunks[c].append(i)
        room[c] -= sizes[i]
    return chunks


# --8<-- [start:plan]
def plan_chunks(sizes: list[int]) -> list[list[int]]:
    """Group units (by index) into chunks; returns the cheapest of the packings below.

    * one chunk per unit: exactly what pinning every unit separately costs;
    * first-fit, largest unit first, into chunks of ``C`` bytes, for every power of two ``C``
      from the largest unit up to the total (the last one puts everything in a single chunk).

    So the arena never costs more than one pinned buffer per unit, nor more than
    ``next_pow2(total)`` (< 2x the total); in a first-fit packing every chunk but the last wastes
    less than the largest unit.
    """
    order = sorted((i for i, s in enumerate(sizes) if s), key=lambda i: (-sizes[i], i))
    if not order:
        return []
    plans = [[[i] for i in order]]  # (1)!
    capacity, total = next_pow2(sizes[order[0]]), sum(sizes)
    while True:
        plans.append(first_fit(sizes, order, capacity))  # (2)!
        if capacity >= total:
            break
        capacity *= 2
    return min(plans, key=lambda chunks: (chunk_bytes(chunks, sizes), len(chunks)))  # (3)!
# --8<-- [end:plan]


# --8<-- [start:arena]
class PinnedArena:
    """Host memory for many units: power-of-two chunks, each unit one contiguous view into one."""

    def __init__(self, sizes: list[int], pinned: bool) -> None:
        self.sizes, self.pinned = list(sizes), pinned
        self.chunks: list[torch.Tensor] = []
        self.regions: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8)] * len(sizes)
        for units in plan_chunks(self.sizes):
            units.sort()  # install order inside a chunk: block 3 sits before block 4
            chunk = torch.empty(next_pow2(sum(self.sizes[i] for i in units)), dtype=torch.uint8,
                                pin_memory=pinned)  # (1)!
            offset = 0
            for i in units:
                self.regions[i] = chunk[offset:offset + self.sizes[i]]  # (2)!
                offset += self.sizes[i]
            self.chunks.append(chunk)
        self.nbytes = sum(c.numel() for c in self.chunks)  # what the host really holds
        self.unit_bytes = sum(self.sizes)  # what the units need
# --8<-- [end:arena]
