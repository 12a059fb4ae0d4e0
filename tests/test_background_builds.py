"""The deferred builds yield to serving (``runtime/background_builds.py``): host logic, no device."""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError

import pytest

from myserve.runtime.background_builds import BackgroundBuilds, BuildGate


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def gate(clock: Clock) -> BuildGate:
    return BuildGate(grace_s=0.25, hold_s=10.0, clock=clock)


def test_an_idle_process_builds_after_the_grace() -> None:
    clock = Clock()
    g = gate(clock)
    assert g.wait_s() == pytest.approx(0.25)
    clock.now += 0.3
    assert g.wait_s() == 0.0
    assert g.idle_for() == pytest.approx(0.3)


def test_serving_holds_builds_back_for_at_most_the_hold() -> None:
    clock = Clock()
    g = gate(clock)
    engine = object()
    clock.now += 1.0
    g.set_busy(engine, True)
    assert g.wait_s() == pytest.approx(10.0) and g.idle_for() == 0.0
    clock.now += 4.0
    assert g.wait_s() == pytest.approx(6.0)
    clock.now += 6.0  # a spell of serving as long as the hold: builds run alongside
    assert g.wait_s() == 0.0


def test_a_gap_between_requests_shorter_than_the_grace_does_not_end_the_spell() -> None:
    clock = Clock()
    g = gate(clock)
    engine = object()
    g.set_busy(engine, True)
    clock.now += 5.0
    g.set_busy(engine, False)  # one request done; the client's next comes 20 ms later
    assert g.wait_s() == pytest.approx(0.25)
    clock.now += 0.02
    g.set_busy(engine, True)
    assert g.wait_s() == pytest.approx(10.0 - 5.02)
    clock.now += 1.0
    g.set_busy(engine, False)
    clock.now += 0.5  # a real pause: the next request begins a new spell
    assert g.wait_s() == 0.0
    g.set_busy(engine, True)
    assert g.wait_s() == pytest.approx(10.0)


def test_the_process_is_idle_only_when_every_engine_is() -> None:
    clock = Clock()
    g = gate(clock)
    a, b = object(), object()
    g.set_busy(a, True)
    g.set_busy(b, True)
    g.set_busy(a, False)
    clock.now += 1.0
    assert g.idle_for() == 0.0 and g.wait_s() == pytest.approx(9.0)
    g.set_busy(a, False)  # told twice: no change
    g.set_busy(b, False)
    clock.now += 0.25
    assert g.wait_s() == 0.0


class Recorder:
    """A build function that records the keys it built, in order."""

    def __init__(self) -> None:
        self.built: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, key: str) -> str:
        if key == "broken":
            raise RuntimeError("no such step")
        with self.lock:
            self.built.append(key)
        return key.upper()


def test_builds_wait_for_the_gate_and_a_wanted_one_does_not() -> None:
    clock = Clock()
    g = gate(clock)
    engine = object()
    g.set_busy(engine, True)  # serving: the gate is shut for 10 s of the test's clock
    record = Recorder()
    builds = BackgroundBuilds(record, g)
    futures = builds.submit(["a", "b", "c", "d"])
    time.sleep(0.15)
    assert record.built == [] and not any(f.done() for f in futures.values())
    builds.want("c")  # a step would run in it now
    assert futures["c"].result(5) == "C" and record.built == ["c"]
    assert not futures["a"].done()
    builds.want("c")  # already built: nothing happens
    g.set_busy(engine, False)
    clock.now += 0.3  # idle past the grace: the rest, in order
    assert [futures[k].result(5) for k in "abd"] == ["A", "B", "D"]
    assert record.built == ["c", "a", "b", "d"]
    builds.stop()


def test_a_failed_build_reaches_its_waiter_and_stop_cancels_the_rest() -> None:
    clock = Clock()
    g = gate(clock)
    clock.now += 1.0
    record = Recorder()
    builds = BackgroundBuilds(record, g)
    futures = builds.submit(["broken", "x"])
    with pytest.raises(RuntimeError, match="no such step"):
        futures["broken"].result(5)
    assert futures["x"].result(5) == "X"
    engine = object()
    g.set_busy(engine, True)
    later = builds.submit(["y", "z"])
    builds.stop()
    for f in later.values():
        with pytest.raises(CancelledError):
            f.result(1)
    assert record.built == ["x"]


def test_a_step_waiting_for_a_queued_build_gets_it_while_the_engine_serves() -> None:
    """``Executables.get`` of a key still queued behind the gate wants it: it is built at once
    rather than after the engine's 10 s spell of serving (or behind every key queued before it)."""
    from myserve.runtime.background_builds import GATE
    from myserve.runtime.executables import Executables

    compiled = Executables(lambda key: (None, (), ()), {}, (), None)
    compiled._build_one = lambda key: f"built {key[1]}"  # type: ignore[method-assign]
    engine = object()
    GATE.set_busy(engine, True)  # serving: the gate holds the queue back
    try:
        compiled.build_in_background([("score", n) for n in range(5)])
        t0 = time.monotonic()
        assert compiled.get(("score", 3)) == "built 3"
        assert time.monotonic() - t0 < 5
        assert not compiled.ready(("score", 0))  # the rest still wait
    finally:
        GATE.set_busy(engine, False)
    assert compiled.background_done(30)
    compiled.stop_background()
