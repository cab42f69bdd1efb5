"""Lab 16 - PyTorch's CUDA caching allocator, rule by rule, as plain Python that runs on a CPU.

Every rule below is a rule of ``c10/cuda/CUDACachingAllocator.cpp`` (``SOURCE``), cited by its line
(``L1599``) in the copy this lab was written from, pytorch commit
0919d01f216cbda88a9488b30075c674df16ff49, whose interface is the one the installed 2.13.0 headers
declare (the v2.13.0 tag itself could not be fetched here: its line numbers may differ by a few);
the sizes come from those headers (``c10/core/AllocatorConfig.h`` L16-25). What is left out is said
at the end of this docstring.

    malloc(size, stream)   round the size (L2823), pick the pool (L3379), best fit in this stream's
                           free blocks (L3443), else cudaMalloc a segment (L3576); when that fails:
                           free cached blocks and retry (L1640-1661); then out of memory (L1797)
    free(block)            back to its pool, merged with free neighbours (L3237, L3315); a block
                           used on other streams waits for their events first (L2225, L4049)
    empty_cache()          every cached segment that holds no live block goes back (L3775)

Streams are names (``"default"``, ``"copy"``, ...): every stream has its own free blocks, as the
real pools are sorted by stream first (L1011). The device is ``capacity`` bytes of which ``outside``
are held outside the allocator (the CUDA context, NCCL): cudaMalloc fails when a segment does not
fit in what is left (``capacity=None``: it never fails).

Not modelled: CUDA graph pools and user mempools (L1580, L3379), the free-memory callbacks (L1621:
CUDA IPC's, which free nothing without IPC), ``release_lock_on_cudamalloc`` (threads), and
``throw_on_cudamalloc_oom`` (L3609).
"""

from __future__ import annotations

import bisect

from allocator_blocks import (DEFAULTS, MIN_BLOCK, SMALL_BUFFER, SMALL_SIZE, Block, FreeBlocks, Options, OutOfMemory, Segment,
                              format_size, round_size, segment_size)
from expandable_segments import ExpandableSegments


class CachingAllocator(ExpandableSegments):
    """The caching allocator of one GPU. ``malloc``/``free``/``record_stream``/``empty_cache``."""

    def __init__(self, options: Options = DEFAULTS, capacity: int | None = None, outside: int = 0) -> None:
        self.o, self.capacity, self.outside = options, capacity, outside
        self.pools = {True: FreeBlocks(), False: FreeBlocks()}  # small, large
        self.unmapped: dict[tuple[bool, str], list] = {}  # expandable: unmapped ranges by address
        self.segments: list[Segment] = []
        self.events: list[list] = []  # [stream, block, completed]
        self.active: set[Block] = set()  # allocated, or freed and waiting for events (L1356: active_blocks)
        self.reserved = self.allocated = self.peak_reserved = self.peak_allocated = 0
        self.retries = self.ooms = 0
        self._next_addr = 1 << 40
        self.allowed = None if options.memory_fraction >= 1 or capacity is None else int(
            options.memory_fraction * capacity)  # L2323-2334

    # ------------------------------------------------------------------ malloc
    # --8<-- [start:malloc]
    def malloc(self, orig_size: int, stream: str = "default") -> Block:
        """L1571-1828: events (L1592), size (L1599), pool (L3398), best fit (L1619), garbage collection
        (L1626), cudaMalloc (L1638), the two retries (L1653, L1659), the error (L1797), the split (L1824)."""
        self.process_events()  # (1)!
        size = round_size(orig_size, self.o)  # L1599
        small = size <= SMALL_SIZE  # L3398: get_pool
        alloc_size = segment_size(size, self.o)  # L1601
        block = self.free_block_for(size, stream, small)  # (2)!
        if block is None:
            if self.allowed is not None and self.o.garbage_collection_threshold > 0:
                self.garbage_collect()  # (3)!
            block = (self.alloc_block(size, alloc_size, stream, small)  # L1638: cudaMalloc
                     or self.release_available_cached_blocks(size, stream, small)  # L1653
                     and self.alloc_block(size, alloc_size, stream, small)
                     or self.release_cached_blocks()  # (4)!
                     and self.alloc_block(size, alloc_size, stream, small, retry=True))  # ... and once more
        if block is None:
            raise self.out_of_memory(alloc_size)  # (5)!
        remaining = block.size - size
        if small or self.o.expandable_segments:  # L3413-3431: should_split
            split = remaining >= MIN_BLOCK
        else:
            split = size < (self.o.max_split_size or 2**63) and remaining > SMALL_SIZE
        if split:  # (6)!
            front = Block(size, block.addr, stream, small, block.segment, prev=block.prev, next=block)
            if block.prev:
                block.prev.next = front
            block.prev, block.addr, block.size = front, block.addr + size, remaining
            self.pools[small].add(block)
            block = front
        block.allocated, block.requested = True, orig_size
        self.active.add(block)
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free_block_for(self, size: int, stream: str, small: bool) -> Block | None:
        """L3443-3499: the smallest cached block of this stream that fits (best fit), within limits."""
        pool, o = self.pools[small], self.o
        if self.allowed is not None and o.garbage_collection_threshold > 0:
            pool.calls += 1  # L3446-3451
        keys = pool.keys.get(stream, [])
        i = bisect.bisect_left(keys, (size, -1))  # L3452: lower_bound
        if i == len(keys):
            return None
        b = keys[i][2]
        if b.segment.page:  # L3455-3483: an expandable block counts the room it can grow into
            def grows(x):
                return x.size + (x.next.size if x.next and not x.next.mapped else 0)
            while keys[i][2].segment.page and i + 1 < len(keys) and grows(keys[i + 1][2]) < grows(keys[i][2]):
                i += 1
            b = keys[i][2]
        split_limit = o.max_split_size or 2**63
        if size < split_limit <= b.size:  # L3489-3491: no oversize block for a smaller request
            return None
        if size >= split_limit and b.size >= size + o.max_non_split_rounding:  # L3493-3496
            return None
        pool.remove(b)
        return b
    # --8<-- [end:malloc]

    # --8<-- [start:segments]
    def device_free(self) -> int | None:
        return None if self.capacity is None else self.capacity - self.outside - self.reserved

    def alloc_block(self, size: int, alloc_size: int, stream: str, small: bool, retry: bool = False) -> Block | None:
        """L3576-3711: a new segment from cudaMalloc, or pages mapped into an expandable one."""
        self.retries += retry  # L3587
        if self.allowed is not None and self.reserved + alloc_size > self.allowed:
            return None  # L3596-3600: the memory fraction's cap
        if self.o.expandable_segments:
            return self.allocate_expandable(size, stream, small)  # L3631
        free = self.device_free()
        if free is not None and alloc_size > free:
            return None  # cudaMalloc: cudaErrorMemoryAllocation
        seg = self.new_segment(alloc_size, stream, small)
        self.grow(alloc_size)
        return Block(alloc_size, seg.addr, stream, small, seg)

    def new_segment(self, size: int, stream: str, small: bool, page: int = 0) -> Segment:
        seg = Segment(self._next_addr, size, stream, small, page)
        self._next_addr += -(-size // SMALL_BUFFER) * SMALL_BUFFER + SMALL_BUFFER  # a gap between segments
        self.segments.append(seg)
        return seg

    def grow(self, nbytes: int) -> None:
        self.reserved += nbytes  # L3685: total_allocated_memory, memory_reserved()
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def release_available_cached_blocks(self, size: int, stream: str, small: bool) -> bool:
        """L3718-3773: with max_split_size set, free oversize cached blocks, largest first, just enough."""
        if self.o.max_split_size is None:
            return False
        keys, want = self.pools[small].keys.get(stream, []), max(size, self.o.max_split_size)
        i = bisect.bisect_left(keys, (want, -1))
        if i < len(keys) and not keys[i][2].segment.page:
            self.release_segment(keys[i][2])
            return True
        released = 0
        for _, _, b in reversed(keys[:i]):  # L3740-3757: from the largest down
            if released >= want or b.size < self.o.max_split_size:
                break
            if not b.segment.page:
                released += b.size
                self.release_segment(b)
        return released >= want

    def release_cached_blocks(self) -> bool:
        """L3775-3834 (empty_cache, and the last retry): wait for every event (L3987), then give back
        every cached segment that holds no live block (L3955-3979)."""
        for event in self.events:
            event[2] = True
        self.process_events()
        for small in (False, True):  # L3788-3789: large pool, then small
            pool = self.pools[small]
            expandable = []
            for b in pool.all():
                if b.segment.page:
                    expandable.append(b)
                elif not b.split():
                    self.release_segment(b)
            for b in expandable:
                self.unmap(b)
        return True

    def release_segment(self, b: Block) -> None:
        """L3837-3882: cudaFree a whole cached segment."""
        self.pools[b.small].remove(b)
        self.segments.remove(b.segment)
        self.reserved -= b.size

    def garbage_collect(self) -> None:
        """L3512-3569: above threshold x the cap, free unsplit cached large blocks, oldest first."""
        limit = int(self.o.garbage_collection_threshold * self.allowed)
        if self.reserved <= limit:
            return
        pool = self.pools[False]
        candidates = [b for b in pool.all() if not b.split()]
        if not candidates:
            return
        total_age, count, reclaimed, freed = sum(pool.calls - b.gc_base for b in candidates), len(candidates), 0, True
        while reclaimed < self.reserved - limit and freed and count > 0:
            threshold, freed = total_age / count, False  # L3548-3551: the average age
            for b in pool.all():
                if not b.split() and not b.segment.page and pool.calls - b.gc_base >= threshold:
                    freed, reclaimed = True, reclaimed + b.size
                    total_age, count = total_age - (pool.calls - b.gc_base), count - 1
                    self.release_segment(b)
    # --8<-- [end:segments]

    # ------------------------------------------------------------------ free
    # --8<-- [start:free]
    def free(self, block: Block) -> None:
        """L2189-2253: the block leaves the tensor; used on other streams, it waits for their events."""
        block.allocated = False
        self.allocated -= block.size
        if block.uses:  # L2225-2241: insert_events, one event per stream that used it (L4049-4066)
            for stream in block.uses:
                self.events.append([stream, block, False])
            block.event_count, block.uses = len(block.uses), set()
        else:
            self.free_block(block)

    def record_stream(self, block: Block, stream: str) -> None:
        """L2299-2310: ``tensor.record_stream(s)``; a use on the block's own stream needs nothing."""
        if stream != block.stream:
            block.uses.add(stream)

    def complete_events(self, stream: str | None = None) -> None:
        """The GPU has finished the work queued on ``stream`` (None: every stream) so far."""
        for event in self.events:
            if stream is None or event[0] == stream:
                event[2] = True

    def process_events(self) -> None:
        """L4087-4126: completed events; a block whose last one completed becomes free."""
        pending = []
        for event in self.events:
            if event[2]:
                event[1].event_count -= 1
                if event[1].event_count == 0:
                    self.free_block(event[1])
            else:
                pending.append(event)
        self.events = pending

    def free_block(self, b: Block) -> None:
        """L3237-3312: merge with the free neighbours in its segment (L3261), then cache it."""
        self.active.discard(b)
        for other in (b.prev, b.next):
            self.merge(b, other)
        self.pools[b.small].add(b)

    def merge(self, dst: Block, src: Block | None) -> None:
        """L3315-3348: a neighbour that is free, has no pending event and is mapped alike joins ``dst``."""
        if src is None or src.allocated or src.event_count or src.uses or src.mapped != dst.mapped:
            return
        if src.mapped:
            self.pools[src.small].remove(src)
        else:
            self.unmapped[(src.small, src.stream)].remove((src.addr, src.counter, src))
        if dst.prev is src:  # L3323-3330: [src dst]
            dst.addr, dst.prev = src.addr, src.prev
            if dst.prev:
                dst.prev.next = dst
        else:  # [dst src]
            dst.next = src.next
            if dst.next:
                dst.next.prev = dst
        dst.size += src.size
    # --8<-- [end:free]

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()`` (L2353-2357)."""
        self.release_cached_blocks()


    # ------------------------------------------------------------------ what it tells you
    def out_of_memory(self, alloc_size: int) -> OutOfMemory:
        """L1716-1822: the message torch.OutOfMemoryError carries, and its numbers."""
        self.ooms += 1
        total = self.capacity or 0
        free = max(self.device_free() or 0, 0)
        numbers = {"request": alloc_size, "capacity": total, "free": free, "process": self.reserved + self.outside,
                   "allowed": self.allowed, "allocated": self.allocated, "reserved": self.reserved,
                   "unallocated": self.reserved - self.allocated}
        allowed = f"{format_size(self.allowed)} allowed; " if self.allowed is not None else ""
        return OutOfMemory(
            f"CUDA out of memory. Tried to allocate {format_size(alloc_size)}. GPU 0 has a total capacity of "
            f"{format_size(total)} of which {format_size(free)} is free. Including non-PyTorch memory, this process "
            f"has {format_size(self.reserved + self.outside)} memory in use. {allowed}Of the allocated memory "
            f"{format_size(self.allocated)} is allocated by PyTorch, and {format_size(self.reserved - self.allocated)}"
            " is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.", numbers)

    def blocks(self) -> list[list[Block]]:
        """Every segment's blocks in address order (one list per contiguous mapped range)."""
        heads = {}
        for b in self._all_blocks():
            while b.prev is not None:
                b = b.prev
            heads[id(b)] = b
        out = []
        for head in sorted(heads.values(), key=lambda h: h.addr):
            run, b = [], head
            while b is not None:
                if b.mapped:
                    run.append(b)
                elif run:
                    out.append(run)
                    run = []
                b = b.next
            if run:
                out.append(run)
        return out

    def _all_blocks(self):
        yield from (b for pool in self.pools.values() for b in pool.all())
        yield from (k[2] for keys in self.unmapped.values() for k in keys)
        yield from self.active

    def reserved_by_stream(self) -> dict[str, int]:
        """Reserved bytes by the stream each segment belongs to (a stream's pool holds them)."""
        out: dict[str, int] = {}
        for run in self.blocks():
            out[run[0].stream] = out.get(run[0].stream, 0) + sum(b.size for b in run)
        return out
