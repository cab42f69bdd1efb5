"""Lab 14 - the two KV caches serving systems used before paging, on the same pool as the paged one.

* :class:`StaticKVCache` reserves ``max_len`` slots for a request when it is admitted, since the
  engine cannot know how long it will run (Hugging Face's ``StaticCache`` holds ``max_cache_len``
  per sequence; FasterTransformer and early Orca-style servers reserved the maximum length). It never
  runs out mid-request, and it wastes every slot reserved but not yet (or never) written.
* :class:`GrowingKVCache` gives each sequence a region of exactly its length and, on every append,
  takes a region one token longer and copies the old one over (Hugging Face's ``DynamicCache``
  concatenates with ``torch.cat``, which does the same in the caching allocator). Nothing is reserved
  ahead, but the holes left behind fragment the pool: a sequence can fail to grow although the
  free slots, added up, would hold it.

Both keep their keys and values in a :class:`paged_kv.KVStore`, the same pools as the paged cache, and
answer the same calls (``admit``, ``grow``, ``free``, ``slots``), so the scheduler and the model run
unchanged on any of the three; they differ only in which rows a sequence's positions map to.
"""

from __future__ import annotations

import bisect

from paged_kv import KVStore


# --8<-- [start:static]
class StaticKVCache:
    """Each admitted sequence owns a fixed region of ``max_len`` rows until it finishes."""

    name = "static"

    def __init__(self, store: KVStore, max_len: int) -> None:
        self.store, self.max_len = store, max_len
        self.free_regions = list(range(store.slots // max_len - 1, -1, -1))
        self.region: dict[int, int] = {}
        self.lengths: dict[int, int] = {}
        self.copied = 0  # a static cache never moves a token

    def admit(self, seq: int, tokens: int, prefix=None) -> int | None:
        if tokens > self.max_len or not self.free_regions:
            return None
        self.region[seq], self.lengths[seq] = self.free_regions.pop(), tokens  # max_len rows, reserved now
        return 0

    def grow(self, seq: int, n: int = 1) -> bool:
        if self.lengths[seq] + n > self.max_len:
            return False
        self.lengths[seq] += n  # the rows were reserved at admission: nothing to allocate
        return True

    def free(self, seq: int) -> None:
        self.free_regions.append(self.region.pop(seq))
        del self.lengths[seq]

    def slots(self, seq: int, start: int, end: int) -> list[int]:
        return list(range(self.region[seq] * self.max_len + start, self.region[seq] * self.max_len + end))
# --8<-- [end:static]

    def publish_prefix(self, seq: int, prefix) -> None:
        pass  # nothing is shared

    def held_slots(self) -> int:
        return len(self.region) * self.max_len

    def stored_slots(self) -> int:
        return sum(self.lengths.values())

    def waste(self) -> tuple[int, int]:
        return 0, self.held_slots() - self.stored_slots()  # reserved ahead and not (yet) written

    def unusable_free_slots(self) -> int:
        return self.store.slots % self.max_len  # the tail of the pool too short for one more region

    def table_entries(self) -> int:
        return len(self.region)

    def fits_alone(self, tokens: int) -> bool:
        return tokens <= self.max_len <= self.store.slots


# --8<-- [start:growing]
class GrowingKVCache:
    """Each sequence owns one region of exactly its length; growing it means a new, longer region and a copy."""

    name = "growing"

    def __init__(self, store: KVStore) -> None:
        self.store = store
        self.holes: list[tuple[int, int]] = [(0, store.slots)]  # free (start, size), sorted by start
        self.start: dict[int, int] = {}
        self.lengths: dict[int, int] = {}
        self.copied = 0  # rows copied into longer regions

    def admit(self, seq: int, tokens: int, prefix=None) -> int | None:
        start = self._take(tokens)
        if start is None:
            return None
        self.start[seq], self.lengths[seq] = start, tokens
        return 0

    def grow(self, seq: int, n: int = 1) -> bool:
        old, length = self.start[seq], self.lengths[seq]
        new = self._take(length + n)  # the old region is still held while the new one is taken
        if new is None:
            return False
        self.store.copy_rows(range(old, old + length), range(new, new + length))  # (1)!
        self._give(old, length)
        self.start[seq], self.lengths[seq], self.copied = new, length + n, self.copied + length
        return True

    def free(self, seq: int) -> None:
        self._give(self.start.pop(seq), self.lengths.pop(seq))

    def slots(self, seq: int, start: int, end: int) -> list[int]:
        return list(range(self.start[seq] + start, self.start[seq] + end))

    def _take(self, size: int) -> int | None:
        """First fit: the lowest hole of at least ``size`` rows."""
        for i, (start, room) in enumerate(self.holes):
            if room >= size:
                self.holes[i:i + 1] = [(start + size, room - size)] if room > size else []
                return start
        return None

    def _give(self, start: int, size: int) -> None:
        """Return a region, merging it with the holes on either side."""
        i = bisect.bisect(self.holes, (start, size))
        if i < len(self.holes) and start + size == self.holes[i][0]:
            size += self.holes.pop(i)[1]
        if i > 0 and self.holes[i - 1][0] + self.holes[i - 1][1] == start:
            start, size = self.holes[i - 1][0], self.holes[i - 1][1] + size
            i -= 1
            self.holes.pop(i)
        self.holes.insert(i, (start, size))
# --8<-- [end:growing]

    def publish_prefix(self, seq: int, prefix) -> None:
        pass

    def held_slots(self) -> int:
        return sum(self.lengths.values())

    def stored_slots(self) -> int:
        return self.held_slots()

    def waste(self) -> tuple[int, int]:
        return 0, 0  # a region is exactly as long as its sequence

    def unusable_free_slots(self) -> int:
        """External fragmentation: free rows outside the largest hole (no request longer than it fits)."""
        sizes = [size for _, size in self.holes]
        return sum(sizes) - max(sizes, default=0)

    def table_entries(self) -> int:
        return len(self.start)

    def fits_alone(self, tokens: int) -> bool:
        return 2 * tokens - 1 <= self.store.slots  # growing to n tokens holds n - 1 old rows and n new ones
