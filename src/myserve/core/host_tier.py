"""The host-memory tier of the prefix cache (``engine.kv_offloading_size``): which prefix pages host
memory holds, in which of its slots, least recently used first.

A cached page the device pool evicts (``PageAllocator.allocate``) is offered here: the tier gives it
a slot (its own least recently used entry makes room when it is full) and the runtime copies the
page's K/V there before the step that reuses the device page (``SavePages``). A later prompt whose
prefix the device no longer holds but this tier does takes device pages for it and has them filled
from their slots (``LoadPages``) instead of computing them. This class only keeps the index and the
counts; the bytes live in the executor (``runtime/host_kv.py``). Host-only and JAX-free, like the
allocator that owns it.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence

import numpy as np

from myserve.runtime.step_ops import LoadPages, Op, SavePages

PageHash = bytes


class HostTier:
    """``num_slots`` host slots of one page each, keyed by the page's chained prefix hash, LRU."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._slots: collections.OrderedDict[PageHash, int] = collections.OrderedDict()  # oldest use first
        self._pinned: set[int] = set()
        self.saved_pages = 0
        """Pages copied into the tier so far."""
        self.evicted_pages = 0
        """Entries dropped to make room for newer ones."""
        self.hit_tokens = 0
        """Prompt tokens whose K/V came back from this tier rather than being computed."""

    @property
    def num_used(self) -> int:
        """Slots holding a page."""
        return len(self._slots)

    def __contains__(self, page_hash: PageHash) -> bool:
        return page_hash in self._slots

    def store(self, page_hash: PageHash) -> int | None:
        """The slot an evicted device page of ``page_hash`` is to be copied into, or None when the
        tier already holds it (it becomes the most recently used) or every slot is pinned."""
        if page_hash in self._slots:
            self._slots.move_to_end(page_hash)
            return None
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, s in self._slots.items() if s not in self._pinned), None)
            if victim is None:
                return None
            slot = self._slots.pop(victim)
            self.evicted_pages += 1
        self._slots[page_hash] = slot
        self.saved_pages += 1
        return slot

    def match(self, hashes: Sequence[PageHash]) -> list[int]:
        """Slots of the longest run of ``hashes`` from the first that the tier holds; each becomes
        the most recently used and is pinned (no ``store`` reuses it) until ``unpin``."""
        slots = []
        for page_hash in hashes:
            slot = self._slots.get(page_hash)
            if slot is None:
                break
            self._slots.move_to_end(page_hash)
            slots.append(slot)
        self._pinned.update(slots)
        return slots

    def unpin(self, slots: Iterable[int]) -> None:
        """Matched slots whose pages were loaded (or not taken after all) may be reused again."""
        self._pinned.difference_update(slots)

    def clear(self) -> int:
        """Forget every entry (``/reset_prefix_cache``, sleep); how many there were."""
        forgotten = len(self._slots)
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._slots.clear()
        self._pinned.clear()
        return forgotten


def host_tier_ops(saves: Sequence[tuple[int, int]], loads: Sequence[tuple[int, int]]) -> list[Op]:
    """A step's host-tier transfers as ops: one ``SavePages`` of its (device page, slot) saves, then
    one ``LoadPages`` of its (slot, device page) loads; none where there are none."""
    ops: list[Op] = []
    if saves:
        pages, slots = np.ascontiguousarray(np.asarray(saves, np.int32).T)
        ops.append(SavePages(pages, slots))
    if loads:
        slots, pages = np.ascontiguousarray(np.asarray(loads, np.int32).T)
        ops.append(LoadPages(slots, pages))
    return ops
