"""The host tier's bytes (``engine.kv_offloading_size``): prefix pages evicted from the device pool,
kept in host memory and written back on a hit (the index of which page is where is the core's,
``core/host_tier.py``).

A save gathers the pages on the device (one small executable per ``GROUP`` pages, dispatched before
the step that reuses them, so it reads them first) and starts their copy into pinned host memory
(``device_put`` to the ``pinned_host`` memory kind: a DMA on a GPU or TPU, nothing the engine
thread waits for). A later op moves each finished copy into the tier's store: one numpy array per
cache array with the page axis ``num_slots`` long, allocated lazily by the OS as it fills, so the
tier never holds more than its size. A load puts the slots' pages back in the cache's sharding and
scatters them into the pool; it first settles the copies still on their way (a prefix evicted and
hit again within a step or two).

On a mesh each process keeps the shards its devices hold (a model-sharded cache: its heads), in
arrays of the whole page's shape that only its shards ever touch.
"""

from __future__ import annotations

import collections

import jax
import numpy as np
from jax.sharding import NamedSharding

from myserve.ops.paged_cache import KernelKVCache
from myserve.runtime.kv_cache import Cache
from myserve.runtime.small_ops import SmallOps, gather_pages, scatter_pages
from myserve.runtime.step_ops import LoadPages, SavePages

GROUP = 16
"""Pages per gather or scatter call: one executable each, built at start; a short group repeats its last page."""


class HostKV:
    """The host tier's store of ``num_slots`` pages for one executor's cache."""

    def __init__(self, kv_cache: Cache, num_slots: int, sharding: NamedSharding, small_ops: SmallOps):
        self.num_slots = num_slots
        self.axis = 1 if isinstance(kv_cache, KernelKVCache) else 2  # the page axis of every cache array
        self._sharding = sharding
        self._small_ops = small_ops
        devices = sharding.mesh.devices.flat
        pinned = all("pinned_host" in {m.kind for m in d.addressable_memories()} for d in devices)
        self._host_sharding = sharding.with_memory_kind("pinned_host") if pinned else sharding
        self._store = [np.zeros(self._shape(a.shape, num_slots), a.dtype) for a in jax.tree.leaves(kv_cache)]
        self._pending: collections.deque[tuple[list[jax.Array], np.ndarray]] = collections.deque()

    @property
    def nbytes(self) -> int:
        """The store's bytes when full (what ``engine.kv_offloading_size`` bounds)."""
        return sum(a.nbytes for a in self._store)

    def warm(self, kv_cache: Cache) -> Cache:
        """Build the gather and scatter executables at start: page 0 to slot 0 and back (the pool
        is still zeros, and so is the slot)."""
        zero = np.zeros(1, np.int32)
        self.save(kv_cache, SavePages(zero, zero))
        return self.load(kv_cache, LoadPages(zero, zero))

    def apply(self, op: SavePages | LoadPages, kv_cache: Cache) -> Cache:
        """Dispatch ``op`` against ``kv_cache``; the cache after it (a load writes pages)."""
        if isinstance(op, SavePages):
            self.save(kv_cache, op)
            return kv_cache
        return self.load(kv_cache, op)

    def save(self, kv_cache: Cache, op: SavePages) -> None:
        """Gather ``op.pages`` and start their copies to host memory; settle those already landed."""
        self._settle(wait=False)
        for at in range(0, len(op.pages), GROUP):
            pages, slots = op.pages[at : at + GROUP], op.slots[at : at + GROUP]
            args = (kv_cache, _padded(pages))
            gathered = self._small_ops(gather_pages, args, (self.axis, self._sharding))
            self._pending.append(([jax.device_put(a, self._host_sharding) for a in gathered], slots))

    def load(self, kv_cache: Cache, op: LoadPages) -> Cache:
        """Write the pages of ``op.slots`` into device pages ``op.pages``; the new cache."""
        self._settle(wait=True)
        for at in range(0, len(op.pages), GROUP):
            slots, pages = _padded(op.slots[at : at + GROUP]), _padded(op.pages[at : at + GROUP])
            values = tuple(self._device_pages(store, slots) for store in self._store)
            args = (kv_cache, pages, values)
            kv_cache = self._small_ops(scatter_pages, args, (self.axis, self._sharding))
        return kv_cache

    def _settle(self, *, wait: bool) -> None:
        """Move finished host copies into the store, oldest first (a slot saved twice keeps the
        later); with ``wait``, every copy, waiting for those still on their way."""
        while self._pending:
            arrays, slots = self._pending[0]
            if not wait and not all(a.is_ready() for a in arrays):  # type: ignore[attr-defined]
                return
            self._pending.popleft()
            for store, array in zip(self._store, arrays, strict=True):
                seen = set()
                for shard in array.addressable_shards:
                    key = tuple((s.start, s.stop) for s in shard.index)
                    if key in seen:  # a replicated axis: every device holds the same values
                        continue
                    seen.add(key)
                    index: list[slice | np.ndarray] = list(shard.index)
                    index[self.axis] = slots
                    data = np.asarray(shard.data)
                    store[tuple(index)] = np.take(data, np.arange(len(slots)), axis=self.axis)

    def _device_pages(self, store: np.ndarray, slots: np.ndarray) -> jax.Array:
        """The pages of ``slots`` in ``store`` as a device array in the cache's sharding."""
        shape = self._shape(store.shape, len(slots))

        def shard(index: tuple[slice, ...] | None) -> np.ndarray:
            assert index is not None, "a sharded cache array's shard has an index"
            at: list[slice | np.ndarray] = list(index)
            at[self.axis] = slots
            return store[tuple(at)]

        return jax.make_array_from_callback(shape, self._sharding, shard)

    def _shape(self, shape: tuple[int, ...], pages: int) -> tuple[int, ...]:
        """``shape`` with ``pages`` on the page axis."""
        return (*shape[: self.axis], pages, *shape[self.axis + 1 :])


def _padded(ids: np.ndarray) -> np.ndarray:
    """``ids`` (int32, at most ``GROUP``) made ``GROUP`` long by repeating the last."""
    return np.concatenate([ids, np.full(GROUP - len(ids), ids[-1], np.int32)]).astype(np.int32)
