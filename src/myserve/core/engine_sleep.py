"""Sleep mode (vLLM's ``--enable-sleep-mode``: ``POST /sleep?level=``, ``POST /wake_up``,
``GET /is_sleeping``), on the engine thread between steps.

A sleep request stops admissions at once: from then on a new request is refused (``EngineSleeping``:
HTTP 503 with ``Retry-After``), while every request the engine already holds runs to its end (the
sleep waits for them, so no admitted request is lost or cut short). Once none is left, and no
weight update is being read, the engine forgets its prefix cache (the pages' contents are about to
go) and the device side frees the KV cache and the weights (``runtime/device_sleep.py``): level 1
keeps a host copy of the weights, level 2 none. ``wake_up`` fills the devices again (level 2:
each version's weights read again from its checkpoint, unless a weight update installed a new
version meanwhile) and admissions resume. Nothing compiles either way: the step executables stay
built and the arrays come back with the same shapes and shardings.

A second sleep while asleep is a no-op (answered with the current state); a ``wake_up`` while the
engine waits for its requests to end cancels the sleep (its caller is told so). A mixin of
``EngineCore``.
"""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast

from myserve.wire.outputs import EngineSleeping

if TYPE_CHECKING:
    from myserve.core.engine_weights import WeightsVersion
    from myserve.core.replica import Replica, Request

logger = logging.getLogger(__name__)

SleepDone = Callable[[str | None, dict[str, object]], None]
"""Told on the engine thread: (error or None, the sleep state after it: ``sleep_state``)."""


class Sleeper(Protocol):
    """Frees and refills the devices (``runtime/device_sleep.DeviceSleep``)."""

    def sleep(self, level: int) -> dict[str, int]:
        """Free the KV cache and the weights (level 1: kept on the host); device bytes before and after."""
        ...

    def wake_up(self, paths: dict[int, str | None]) -> dict[str, int]:
        """Fill the devices again (``paths``: each weight slot's checkpoint, for level 2)."""
        ...


class EngineSleep:
    """Sleep and wake-up requests, queued to the engine thread (a mixin of ``EngineCore``)."""

    _inbox: object
    _requests: dict[str, Request]
    _inflight: object
    _weights_loading: bool
    replicas: list[Replica]
    weight_versions: dict[int, WeightsVersion]

    def _init_sleep(self, sleeper: Sleeper | None) -> None:
        self.sleeper = sleeper
        """Frees and refills the devices (None: this engine does not sleep)."""
        self.sleep_level = 0
        """0 awake, else the level it sleeps at."""
        self.admitting = threading.Event()
        """Set while requests are admitted: cleared from a sleep request until the wake-up."""
        self.admitting.set()
        self._sleeps: list[tuple[int, SleepDone]] = []
        self.last_sleep: dict[str, int] = {}
        """The last sleep's device bytes before and after (for /is_sleeping and the logs)."""

    @property
    def sleep_state(self) -> dict[str, object]:
        """``is_sleeping`` (asleep, or going to sleep) and ``level``, with the last sleep's bytes."""
        asleep = self.sleep_level > 0 or bool(self._sleeps)
        return {"is_sleeping": asleep, "level": self.sleep_level, **self.last_sleep}

    def request_sleep(self, level: int, done: SleepDone) -> None:
        """Sleep at ``level`` (1 or 2) once the requests held now have finished; new ones are
        refused from this call on. ``done`` is told once asleep, or why not."""
        if self.sleeper is not None and level in (1, 2):
            self.admitting.clear()
        self._inbox.put(("sleep", (level, done)))  # type: ignore[attr-defined]

    def request_wake_up(self, done: SleepDone) -> None:
        """Wake up (or cancel a sleep still waiting for its requests); ``done`` once awake."""
        self._inbox.put(("wake_up", done))  # type: ignore[attr-defined]

    def check_awake(self) -> None:
        """Raise ``EngineSleeping`` while requests are refused (a sleep asked for, or asleep)."""
        if not self.admitting.is_set():
            raise EngineSleeping("the engine is sleeping: POST /wake_up first")

    def _sleep_admin(self, kind: str, payload: object) -> bool:
        """Apply a sleep inbox item (engine thread); False if ``kind`` is not one."""
        if kind == "sleep":
            level, done = cast(tuple[int, SleepDone], payload)
            if self.sleeper is None:
                done("this server was started without --enable-sleep-mode", self.sleep_state)
            elif level not in (1, 2):
                done(f"level must be 1 or 2, got {level}", self.sleep_state)
            elif self.sleep_level:
                done(None, self.sleep_state)  # already asleep
            else:
                self._sleeps.append((level, done))
                self._sleep_when_idle()
            return True
        if kind != "wake_up":
            return False
        done = cast(SleepDone, payload)
        waiting, self._sleeps = self._sleeps, []
        for _, told in waiting:
            told("cancelled by a wake_up before the engine fell asleep", self.sleep_state)
        if self.sleep_level and self.sleeper is not None:
            paths = {slot: version.path for slot, version in self.weight_versions.items()}
            self.last_sleep.update(self.sleeper.wake_up(paths))
            self.sleep_level = 0
            logger.info("awake: requests are admitted again")
        self.admitting.set()
        done(None, self.sleep_state)
        return True

    def _sleep_when_idle(self) -> None:
        """Fall asleep once nothing is held: no request, no step in flight, no weights being read."""
        if not self._sleeps or self._requests or self._inflight is not None or self._weights_loading:
            return
        assert self.sleeper is not None
        level = max(level for level, _ in self._sleeps)
        for rep in self.replicas:
            rep.allocator.reset_prefix_cache()  # every page is free: the cached ones are forgotten
        self.last_sleep = self.sleeper.sleep(level)
        self.sleep_level = level
        gc.collect()  # what referred to the freed arrays
        waiting, self._sleeps = self._sleeps, []
        for _, done in waiting:
            done(None, self.sleep_state)
