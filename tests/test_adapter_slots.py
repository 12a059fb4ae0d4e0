"""The core's adapter bookkeeping, host only (milliseconds): which slot holds which adapter, when
one is written, when a request must wait, and what unloading leaves to requests already queued."""

from __future__ import annotations

import pytest

from myserve.core.adapters import AdapterRegistry, AdapterSlots, UnknownAdapter, check_adapter
from myserve.runtime.lora_files import LoraAdapter
from myserve.wire.params import InvalidParams


def registry(*names: str) -> tuple[AdapterRegistry, list[str]]:
    reads: list[str] = []

    def read(name: str, path: str) -> LoraAdapter:
        reads.append(name)
        return LoraAdapter(name, path, 4, {})

    reg = AdapterRegistry(max_cpu_loras=2, read=read)
    for name in names:
        reg.register(name, f"/adapters/{name}")
    return reg, reads


def test_a_slot_is_written_once_and_shared() -> None:
    reg, _ = registry("a", "b")
    slots = AdapterSlots(reg, max_loras=2)
    first = slots.acquire("a")
    assert first is not None and [(s, a.name) for s, a in slots.take_pending()] == [(first, "a")]
    assert slots.acquire("a") == first and slots.take_pending() == []  # resident: no second write
    other = slots.acquire("b")
    assert other not in (None, first) and slots.resident() == {first: "a", other: "b"}


def test_a_request_waits_while_every_slot_is_held_by_others() -> None:
    reg, _ = registry("a", "b", "c")
    slots = AdapterSlots(reg, max_loras=2)
    a, b = slots.acquire("a"), slots.acquire("b")
    slots.take_pending()
    assert slots.acquire("c") is None  # both slots referenced
    slots.release(a)
    c = slots.acquire("c")
    assert c == a and [x.name for _, x in slots.take_pending()] == ["c"]  # a's slot, now unreferenced
    assert slots.acquire("b") == b and slots.take_pending() == []


def test_least_recently_used_free_slot_is_replaced() -> None:
    reg, _ = registry("a", "b", "c")
    slots = AdapterSlots(reg, max_loras=2)
    a = slots.acquire("a")
    b = slots.acquire("b")
    slots.release(b)
    slots.release(a)  # a used last
    assert slots.acquire("c") == b


def test_host_copies_are_bounded_and_read_again() -> None:
    reg, reads = registry("a", "b", "c")  # max_cpu_loras 2: "a" dropped after "c" was read
    assert reads == ["a", "b", "c"]
    slots = AdapterSlots(reg, max_loras=1)
    slots.acquire("a")
    assert reads[-1] == "a"  # read again from its path


def test_unregistered_adapters_serve_queued_requests_only() -> None:
    reg, _ = registry("a")
    reg.unregister("a")
    with pytest.raises(InvalidParams, match="does not exist"):
        check_adapter(reg, "a")  # new requests are refused
    assert AdapterSlots(reg, max_loras=1).acquire("a") == 0  # a request queued before still runs
    with pytest.raises(UnknownAdapter):
        reg.unregister("a")
    with pytest.raises(UnknownAdapter):
        AdapterSlots(reg, max_loras=1).acquire("never")
    assert reg.hash_root("a") != registry("a")[0].hash_root("b") and reg.hash_root(None) is None


def test_a_name_registered_again_with_other_weights_is_written_again() -> None:
    reg, _ = registry("a")
    slots = AdapterSlots(reg, max_loras=1)
    slot = slots.acquire("a")
    slots.take_pending()
    slots.release(slot)
    root = reg.hash_root("a")
    reg.unregister("a")
    reg.register("a", "/adapters/a-v2")
    assert slots.acquire("a") == slot and [x.path for _, x in slots.take_pending()] == ["/adapters/a-v2"]
    assert reg.hash_root("a") != root  # its pages are not the old weights' in the prefix cache
