"""Which LoRA adapters the engine knows and which sit in the device's slots (host logic only).

Each replica's device holds ``max_loras`` slots of adapter stacks (``models/lora.py``); a running sequence
whose request names an adapter holds a reference to the slot its adapter is in. Admitting a
sequence acquires its adapter's slot: the slot it is already in, else the least recently used slot
no running sequence references, into which the adapter is written before the next step (a
``WriteAdapter`` op of the same shapes every time: nothing compiles). When every slot is referenced
by other adapters the sequence waits. Adapters read from disk are kept on the host, at most
``max_cpu_loras`` of them (least recently used dropped, re-read when needed again).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from myserve.wire.params import InvalidParams

if TYPE_CHECKING:  # (the core runs without JAX; the adapters' reader, runtime/lora_files.py, imports it)
    from myserve.runtime.lora_files import LoraAdapter


class UnknownAdapter(KeyError):
    """A request names an adapter the engine does not know."""


def check_adapter(registry: AdapterRegistry | None, name: str | None) -> None:
    """InvalidParams naming ``model`` when a request's adapter is not served (None: the base model)."""
    if name is not None and (registry is None or name not in registry.paths):
        raise InvalidParams("model", f"the model `{name}` does not exist")


class AdapterRegistry:
    """The adapters the engine knows (name -> path) and the host copies read so far (shared by the
    replicas, each of which has its own ``AdapterSlots``)."""

    def __init__(self, max_cpu_loras: int, read: Callable[[str, str], LoraAdapter]):
        """``read(name, path)``: an adapter's host arrays (``models/lora.py::read_adapter``)."""
        self.paths: dict[str, str] = {}
        self._retired: dict[str, str] = {}
        """Unregistered adapters, for the sequences queued with them before (new requests are refused)."""
        self._read = read
        self._host: collections.OrderedDict[str, LoraAdapter] = collections.OrderedDict()
        self._max_cpu = max(max_cpu_loras, 1)

    def register(self, name: str, path: str) -> None:
        """Know ``name`` (read now, so that a bad adapter fails here rather than at a request)."""
        adapter = self._read(name, path)
        self.paths[name] = path
        self._retired.pop(name, None)
        self._keep(adapter)

    def unregister(self, name: str) -> None:
        """Forget ``name`` (UnknownAdapter if unknown); sequences running with it keep their slot."""
        if name not in self.paths:
            raise UnknownAdapter(name)
        self._retired[name] = self.paths.pop(name)

    def path_of(self, name: str) -> str:
        """Where ``name`` was registered from (retired ones too); UnknownAdapter if never."""
        path = self.paths.get(name) or self._retired.get(name)
        if path is None:
            raise UnknownAdapter(name)
        return path

    def get(self, name: str) -> LoraAdapter:
        """``name``'s host arrays (read again if they were dropped); UnknownAdapter if unknown."""
        path = self.path_of(name)
        adapter = self._host.get(name)
        if adapter is None or adapter.path != path:
            adapter = self._read(name, path)
        self._keep(adapter)
        return adapter

    def hash_root(self, name: str | None) -> bytes | None:
        """The prefix cache's chain root of sequences using ``name`` (its path too: the same name
        registered again with other weights shares no pages with the old); None for the base model."""
        if name is None:
            return None
        path = self.paths.get(name) or self._retired.get(name, "")
        return hashlib.blake2b(f"lora:{name}:{path}".encode(), digest_size=16).digest()

    def _keep(self, adapter: LoraAdapter) -> None:
        self._host[adapter.name] = adapter
        self._host.move_to_end(adapter.name)
        while len(self._host) > self._max_cpu:
            self._host.popitem(last=False)


@dataclasses.dataclass
class _Slot:
    name: str | None = None
    path: str | None = None
    refs: int = 0


class AdapterSlots:
    """One replica's device slots: which adapter each holds and how many running sequences use it."""

    def __init__(self, registry: AdapterRegistry, max_loras: int):
        self.registry = registry
        self._slots = [_Slot() for _ in range(max_loras)]
        self._used = collections.OrderedDict((i, None) for i in range(max_loras))  # least recent first
        self.pending: list[tuple[int, LoraAdapter]] = []
        """Adapters to write into slots before the next step (the runner turns them into ops)."""

    def acquire(self, name: str) -> int | None:
        """A reference to the slot holding ``name``'s current weights, writing them into an unused
        slot if needed; None when every slot is referenced by other adapters. UnknownAdapter if
        ``name`` is not registered."""
        path = self.registry.path_of(name)
        index = next((i for i, s in enumerate(self._slots) if s.name == name and s.path == path), None)
        if index is None:
            index = next((i for i in self._used if self._slots[i].refs == 0), None)
            if index is None:
                return None
            adapter = self.registry.get(name)
            self._slots[index] = _Slot(name, path)
            self.pending = [(i, a) for i, a in self.pending if i != index]
            self.pending.append((index, adapter))
        self._slots[index].refs += 1
        self._used.move_to_end(index)
        return index

    def release(self, index: int) -> None:
        """Drop one reference to slot ``index``."""
        slot = self._slots[index]
        assert slot.refs > 0, f"slot {index} released more often than acquired"
        slot.refs -= 1
        self._used.move_to_end(index)  # in use until now: the last to be replaced among free slots

    def take_pending(self) -> list[tuple[int, LoraAdapter]]:
        """The slot writes to run before the next step (and forget them)."""
        pending, self.pending = self.pending, []
        return pending

    def resident(self) -> dict[int, str]:
        """Slot -> adapter name, of the slots holding one."""
        return {i: s.name for i, s in enumerate(self._slots) if s.name is not None}
