"""Sleep mode's device side (``--enable-sleep-mode``, ``core/engine_sleep.py``): free what a
deployment holds on its devices, and fill them again, with nothing compiled either way.

Level 1 copies every loaded weight slot to host memory (numpy, beside its sharding) and frees the
device arrays; level 2 frees them without a copy. Both free the KV cache (the engine forgets its
prefix cache first: the pages' contents are gone). Waking puts the host copies back with the very
shardings they had and makes a zeroed cache in the same layout (``init_kv_cache``, whose
executable the executor's ``SmallOps`` already holds), so every step executable applies as
before. A slot freed at level 2 is read again from the checkpoint of the version it held, unless
a weight update installed a new version while asleep (``/update_weights_from_disk``: the RL loop
sleeps, loads the trainer's weights, wakes).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from myserve.models.checkpoint import resolve_checkpoint

if TYPE_CHECKING:
    from myserve.runtime.executor import Executor
    from myserve.runtime.weight_update import WeightUpdater

logger = logging.getLogger(__name__)

HostCopy = tuple[Any, list[Any], list[Any]]
"""A weight slot to put back: its model's tree structure, each leaf's values (a host copy, or the
leaf itself where it is no array) and each array's sharding (None for the other leaves)."""


def device_bytes(executors: Sequence[Executor]) -> int:
    """Bytes of the live arrays on the executors' devices (what sleep frees: a device's allocator
    may keep its pool reserved, which ``memory_stats`` would count)."""
    devices = {d for ex in executors for d in ex.mesh.devices.flat}
    return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted() and x.devices() & devices)


class DeviceSleep:
    """Frees and refills the devices of a deployment's replicas (their executors)."""

    def __init__(self, executors: Sequence[Executor], reader: WeightUpdater):
        """``reader``: reads a version's weights again onto every replica (after level 2)."""
        self.executors = list(executors)
        self.reader = reader
        self.checkpoint = str(resolve_checkpoint(reader.dep.config.model.checkpoint).path)
        """The served checkpoint: where the first version's weights are read again."""
        self._host: list[dict[int, HostCopy]] = [{} for _ in self.executors]

    def sleep(self, level: int) -> dict[str, int]:
        """Free the KV cache and the weights (level 1: kept in host memory); the device bytes
        before and after."""
        before = device_bytes(self.executors)
        for ex, host in zip(self.executors, self._host, strict=True):
            for slot, weights in enumerate(ex.weight_slots):
                if weights is None:
                    continue
                if level == 1:
                    host[slot] = _host_copy(weights[0], to_host=True)
                for x in jax.tree.leaves(weights[0]):
                    if isinstance(x, jax.Array):
                        x.delete()
            ex.free_kv_cache()
        after = device_bytes(self.executors)
        logger.info(
            "asleep (level %d): device arrays %.2f GiB -> %.2f GiB", level, before / (1 << 30), after / (1 << 30)
        )
        return {"device_bytes_before": before, "device_bytes_after": after}

    def wake_up(self, paths: dict[int, str | None]) -> dict[str, int]:
        """Fill the devices again: host copies back, slots freed without one read from ``paths``
        (weight slot -> the checkpoint of the version it holds), a zeroed KV cache."""
        for ex, host in zip(self.executors, self._host, strict=True):
            for slot, weights in enumerate(ex.weight_slots):
                if weights is None or slot in host or not _freed(weights[0]):
                    continue  # (a version installed while asleep is on the device already)
                path = paths.get(slot) or self.checkpoint
                host[slot] = _host_copy(self.reader.load(path)[self.executors.index(ex)], to_host=False)
            for slot, (treedef, values, shardings) in host.items():
                if ex.weight_slots[slot] is None:
                    continue  # let go while asleep (a newer version replaced it)
                leaves = [v if s is None else jax.device_put(v, s) for v, s in zip(values, shardings, strict=True)]
                ex.put_weights(slot, jax.tree.unflatten(treedef, leaves))
            host.clear()
            ex.restore_kv_cache()
        after = device_bytes(self.executors)
        logger.info("awake: device arrays %.2f GiB", after / (1 << 30))
        return {"device_bytes_after": after}


def _freed(model: Any) -> bool:
    return any(x.is_deleted() for x in jax.tree.leaves(model) if isinstance(x, jax.Array))


def _host_copy(model: Any, *, to_host: bool) -> HostCopy:
    """``model`` as a weight slot to put back: its arrays copied to host memory (``to_host``; a
    copy, not a view: on CPU a view would share the buffer that sleep then frees), or kept as they
    are (a model just read onto the device)."""
    leaves, treedef = jax.tree.flatten(model)
    arrays = [isinstance(x, jax.Array) for x in leaves]
    pairs = list(zip(leaves, arrays, strict=True))
    values = [np.array(jax.device_get(x), copy=True) if a and to_host else x for x, a in pairs]
    return treedef, values, [x.sharding if a else None for x, a in pairs]
