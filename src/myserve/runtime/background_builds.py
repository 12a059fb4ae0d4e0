"""The executables warmup defers, built one at a time on a thread of their own while the engine
serves, out of the way of the requests.

On the 2-core CPU a background build (a load from the step cache: ~0.4 s of a core each, 60-70 of
them for the bundled model) made every request served meanwhile ~1.35x slower: XLA:CPU's step
uses both cores. So the builds yield to serving (``BuildGate``): one starts only once the process's
engines have been idle for ``IDLE_GRACE_S`` (a gap between one client's back-to-back requests is
not idleness), or once a spell of serving has lasted ``HOLD_S`` (under a sustained load the
narrower buckets pay for the contention soon). A build a step would use right now is *wanted*
(``BackgroundBuilds.want``): it jumps the queue and does not wait for the gate, because the step
meanwhile runs in a wider, slower bucket.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from typing import Any

IDLE_GRACE_S = 0.25
"""How long every engine of the process must have been idle before a deferred build (or an idle
engine's priming run) starts: longer than a client's turnaround between two requests."""

HOLD_S = 10.0
"""The longest spell of serving the deferred builds wait out; past it they run alongside."""

_POLL_S = 0.05
"""How often a waiting build looks at the gate again."""


class BuildGate:
    """Whether deferred work may run now: the engines of a process report when they are busy."""

    def __init__(
        self, grace_s: float = IDLE_GRACE_S, hold_s: float = HOLD_S, clock: Callable[[], float] = time.monotonic
    ):
        self.grace_s, self.hold_s, self._clock = grace_s, hold_s, clock
        self._lock = threading.Lock()
        self._busy: set[int] = set()  # ids of the engines with work
        self._idle_since: float | None = clock()  # None while some engine is busy
        self._spell_since: float | None = None  # when the current spell of serving began

    def set_busy(self, holder: object, busy: bool) -> None:
        """Say whether ``holder`` (an engine) has work. A spell of serving lasts through idle gaps
        shorter than the grace."""
        with self._lock:
            now, key = self._clock(), id(holder)
            if busy and key not in self._busy:
                gap = None if self._idle_since is None else now - self._idle_since
                if not self._busy and (self._spell_since is None or gap is None or gap >= self.grace_s):
                    self._spell_since = now
                self._busy.add(key)
                self._idle_since = None
            elif not busy and key in self._busy:
                self._busy.discard(key)
                if not self._busy:
                    self._idle_since = now

    def idle_for(self) -> float:
        """Seconds since the last engine went idle; 0 while one is busy."""
        with self._lock:
            return 0.0 if self._idle_since is None else self._clock() - self._idle_since

    def wait_s(self) -> float:
        """Seconds until deferred work may start (0: now), as things stand."""
        with self._lock:
            now = self._clock()
            waits = []
            if self._idle_since is not None:  # idle: once the grace has passed
                waits.append(self.grace_s - (now - self._idle_since))
            if self._spell_since is not None:  # serving (or within the grace): once the spell is long
                waits.append(self.hold_s - (now - self._spell_since))
            return max(0.0, min(waits))


GATE = BuildGate()
"""The process's gate: every engine core reports to it, every background builder waits on it."""


_LIVE: weakref.WeakSet[BackgroundBuilds] = weakref.WeakSet()


def _stop_all() -> None:
    """At interpreter exit: every builder stopped, so that its thread ends after the build under way.
    A thread still inside XLA while the interpreter finalizes crashed processes at exit (SIGSEGV,
    SIGABRT), which a ``ThreadPoolExecutor`` avoids the same way."""
    for builds in list(_LIVE):
        builds.stop()


# (As ``concurrent.futures`` does: called before the interpreter joins its non-daemon threads.)
threading._register_atexit(_stop_all)  # type: ignore[attr-defined]


class BackgroundBuilds:
    """Keys built by ``build`` one at a time on a thread of its own, in the order submitted, each
    after the gate lets it; a wanted key first and ungated. Each key's ``Future`` holds its result.
    The thread is joined at interpreter exit (``_stop_all``), after the build under way."""

    def __init__(self, build: Callable[[Any], Any], gate: BuildGate = GATE, name: str = "build-later"):
        self._build, self._gate = build, gate
        self._cond = threading.Condition()
        self._order: collections.OrderedDict[Hashable, Future[Any]] = collections.OrderedDict()
        self._wanted: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
        self._stopped = False
        _LIVE.add(self)
        self._thread = threading.Thread(target=self._run, name=name)
        self._thread.start()

    def submit(self, keys: Sequence[Hashable]) -> dict[Hashable, Future[Any]]:
        """Queue ``keys`` (after those queued before); their futures."""
        futures: dict[Hashable, Future[Any]] = {}
        with self._cond:
            for key in keys:
                futures[key] = self._order.setdefault(key, Future())
            self._cond.notify()
        return futures

    def want(self, key: Hashable) -> None:
        """Build ``key`` next, without waiting for the gate (a no-op once it started)."""
        with self._cond:
            if key in self._order and key not in self._wanted:
                self._wanted[key] = None
                self._cond.notify()

    def stop(self) -> None:
        """Cancel the keys not yet started; the one under way ends on its own."""
        with self._cond:
            self._stopped = True
            for future in self._order.values():
                future.cancel()
            self._order.clear()
            self._cond.notify()

    def _next(self) -> tuple[Hashable, Future[Any]] | None:
        """The next key to build, its future already running (under the lock: a key is always
        queued, wanted, running or done); None once stopped."""
        with self._cond:
            while not self._stopped:
                item = None
                while self._wanted and item is None:
                    key, _ = self._wanted.popitem(last=False)
                    if key in self._order:
                        item = key, self._order.pop(key)
                if item is None and self._order:
                    wait = self._gate.wait_s()
                    if wait > 0:
                        self._cond.wait(min(wait, _POLL_S))
                        continue
                    item = self._order.popitem(last=False)
                if item is None:
                    self._cond.wait()
                elif item[1].set_running_or_notify_cancel():
                    return item
            return None

    def _run(self) -> None:
        while (item := self._next()) is not None:
            key, future = item
            try:
                future.set_result(self._build(key))
            except BaseException as e:  # handed to whoever waits for the key
                future.set_exception(e)
