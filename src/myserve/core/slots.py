"""Penalty slots: host bookkeeping of the device rows that hold each sequence's token history.

Presence, frequency and repetition penalties need to know which tokens a sequence has seen. The
device keeps that state in a table of ``num_slots`` rows (plus one scratch row for sequences without
penalties); this pool hands a row to each running sequence that uses penalties and takes it back
when the sequence stops running (finish, abort, preemption or an engine error). Plain Python, no
device: the scheduler owns it, and it is unit-tested alone.
"""

from __future__ import annotations


class OutOfSlots(Exception):
    """Raised by ``acquire`` when every slot is owned (a bookkeeping bug: at most ``max_num_seqs``
    sequences run, and the pool has a slot for each)."""


class SlotPool:
    """Free list and owners of ``num_slots`` penalty slots, identified by the owner's key."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._owner: dict[int, object] = {}

    @property
    def num_free(self) -> int:
        """Slots no sequence owns."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Slots owned by a sequence."""
        return self.num_slots - len(self._free)

    def owner(self, slot: int) -> object | None:
        """Who owns ``slot`` (None if it is free)."""
        return self._owner.get(slot)

    def acquire(self, owner: object) -> int:
        """A free slot, now owned by ``owner``."""
        if not self._free:
            raise OutOfSlots(f"all {self.num_slots} penalty slots are owned")
        slot = self._free.pop()
        self._owner[slot] = owner
        return slot

    def release(self, slot: int, owner: object) -> None:
        """Give ``slot`` back; it must be owned by ``owner`` (a double release is a bug, not a no-op)."""
        if self._owner.get(slot) is not owner:
            raise ValueError(f"penalty slot {slot} released by a sequence that does not own it")
        del self._owner[slot]
        self._free.append(slot)
