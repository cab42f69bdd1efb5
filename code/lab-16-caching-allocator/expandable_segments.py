"""Lab 16 - expandable segments (``PYTORCH_ALLOC_CONF=expandable_segments:True``): one segment per
stream and pool with address space for the whole GPU, physical pages mapped into it as blocks need
them and unmapped when ``empty_cache`` gives them back, so a freed range never strands a segment.
A part of ``allocator_model.CachingAllocator``, cited by the lines of the same source."""

from __future__ import annotations

import bisect

from allocator_blocks import SMALL_BUFFER, Block


class ExpandableSegments:
    """The expandable-segment rules of ``CachingAllocator`` (its ``malloc`` calls them when the option is on)."""

    # --8<-- [start:expandable]
    def allocate_expandable(self, size: int, stream: str, small: bool) -> Block | None:
        """L3203-3234: the lowest address with room, mapping pages until the block is large enough."""
        candidate = self.find_expandable(size, stream, small)
        if not candidate.mapped and not self.map(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:  # L3221-3231: free -> unmapped -> ...: map the next range too
            nxt = candidate.next
            if not self.map(nxt, min(size - candidate.size, nxt.size)):
                return None
            candidate = nxt  # map() merged the free block before it into it
        self.pools[small].remove(candidate)
        return candidate

    def find_expandable(self, size: int, stream: str, small: bool) -> Block:
        """L3087-3132: an unmapped range (or the free block before it) with room, else a new segment
        with address space for 9/8 of the GPU (L396), mapped ``page`` bytes at a time (L3120)."""
        def room(b):
            total = 0
            while total < size and b is not None and not b.allocated and not b.event_count and not b.uses:
                total, b = total + b.size, b.next
            return total >= size
        for _, _, c in self.unmapped.get((small, stream), []):
            if c.prev and not c.prev.allocated and not c.prev.event_count and not c.prev.uses:
                c = c.prev  # L3113-3115
            if room(c):
                return c
        page = SMALL_BUFFER if small else self.o.large_segment_size
        space = -(-(self.capacity or 2**40) * 9 // 8 // page) * page
        seg = self.new_segment(space, stream, small, page)
        b = Block(space, seg.addr, stream, small, seg, mapped=False)
        bisect.insort(self.unmapped.setdefault((small, stream), []), (b.addr, b.counter, b))
        return b

    def map(self, b: Block, size: int) -> bool:
        """L3134-3201: map whole pages at the front of unmapped ``b``; fails when the GPU lacks them."""
        page = b.segment.page
        nbytes = min(-(-size // page) * page, b.size)
        free = self.device_free()
        if free is not None and nbytes > free:
            return False  # cuMemCreate: out of memory (L490-514)
        self.unmapped[(b.small, b.stream)].remove((b.addr, b.counter, b))
        b.mapped = True
        if nbytes < b.size:  # L3155-3167: the rest stays unmapped
            rest = Block(b.size - nbytes, b.addr + nbytes, b.stream, b.small, b.segment, mapped=False, prev=b,
                         next=b.next)
            if b.next:
                b.next.prev = rest
            b.next, b.size = rest, nbytes
            bisect.insort(self.unmapped[(b.small, b.stream)], (rest.addr, rest.counter, rest))
        self.merge(b, b.prev)
        self.merge(b, b.next)
        self.pools[b.small].add(b)
        self.grow(nbytes)
        return True

    def unmap(self, b: Block) -> None:
        """L3884-3953: give back the whole pages inside free block ``b``; its ends stay mapped."""
        page, base = b.segment.page, b.segment.addr
        start = base + -(-(b.addr - base) // page) * page  # L547-553: pages wholly inside
        end = base + (b.addr + b.size - base) // page * page
        if start >= end:
            return
        self.pools[b.small].remove(b)
        if start > b.addr:
            before = Block(start - b.addr, b.addr, b.stream, b.small, b.segment, prev=b.prev, next=b)
            if b.prev:
                b.prev.next = before
            b.prev = before
            self.pools[b.small].add(before)
        if b.addr + b.size > end:
            after = Block(b.addr + b.size - end, end, b.stream, b.small, b.segment, prev=b, next=b.next)
            if b.next:
                b.next.prev = after
            b.next = after
            self.pools[b.small].add(after)
        b.addr, b.size, b.mapped = start, end - start, False
        self.merge(b, b.prev)
        self.merge(b, b.next)
        bisect.insort(self.unmapped.setdefault((b.small, b.stream), []), (b.addr, b.counter, b))
        self.reserved -= end - start
        if b.prev is None and b.next is None:  # L3973-3978: nothing mapped any more
            self.unmapped[(b.small, b.stream)].remove((b.addr, b.counter, b))
            self.segments.remove(b.segment)
    # --8<-- [end:expandable]
