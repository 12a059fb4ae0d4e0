"""Live weight updates (sglang's ``/update_weights_from_disk``), on the engine thread between steps.

A new version of the served weights is read in the background (``WeightLoader.load``: any format
the server reads, checked against the served shapes and dtypes, so nothing compiles) onto spare
device memory: every executor holds two weight slots, and a step runs on the one its
``StepCall.weights`` names. Once read, the switch happens between two steps, atomically: requests
admitted from then on run on the new version. Under the default policy ``"finish"`` every request
finishes on the version it started on: while old ones remain, the engine alternates steps of each
version (a step holds one version's sequences: ``Scheduler.schedule(weights)``), and the old slot
is let go when its last request ends. Under ``"cut"`` the running requests move to the new version
at once (their remaining tokens come from it, and their outputs say so) and the old slot goes
immediately. Memory: a second copy of the weights while a version loads and, under ``"finish"``,
until the old version drains. A second update waits until then (two slots).

Each version has a label (the caller's, or a serial number), its own root of the prefix cache's
hash chains (an old version's cached pages are never reused by the new one), and every token
output names the version that produced it (``RequestOutput.weights_version``).

A mixin of ``EngineCore`` (which owns ``_inbox``, ``_requests``, ``replicas`` and ``_iteration``).
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast

if TYPE_CHECKING:
    from myserve.core.replica import Replica, Request

logger = logging.getLogger(__name__)

POLICIES = ("finish", "cut")
"""What happens to running requests at a switch: finish on their version, or move to the new one."""


class WeightLoader(Protocol):
    """Reads versions of the served weights onto the devices (``runtime/weight_update.py``)."""

    def load(self, path: str) -> object:
        """Read the weights at ``path`` onto every replica's devices (any thread), checked against
        the served ones; raises ``MyserveError`` naming what is wrong (the caller's 400)."""
        ...

    def install(self, staged: object, slot: int) -> None:
        """Make weight slot ``slot`` of every replica hold ``staged`` (``load``'s result)."""
        ...

    def drop(self, slot: int) -> None:
        """Let weight slot ``slot`` of every replica go."""
        ...


@dataclasses.dataclass(frozen=True)
class WeightsVersion:
    """A version of the served weights."""

    label: str
    loaded_at: float
    """Unix time it began serving."""
    path: str | None
    """Where it was read from (None: the deployment's own checkpoint)."""
    root: bytes | None
    """The root of its prefix-cache hash chains (None: the first version's, as without updates)."""

    def info(self) -> dict[str, object]:
        """What ``/v1/models`` and the update's answer say of it."""
        return {"version": self.label, "loaded_at": int(self.loaded_at), "path": self.path}


WeightsDone = Callable[[str | None, dict[str, object]], None]
"""Told once an update is applied or refused: the error (None: serving) and the version served now."""


class EngineWeights:
    """Versions of the served weights and their updates, on the engine thread."""

    _inbox: queue.SimpleQueue[tuple[str, object]]
    _requests: dict[str, Request]
    replicas: list[Replica]
    _iteration: int

    def _init_weights(self, loader: WeightLoader | None) -> None:
        self.weight_loader = loader
        """Reads new versions (None: this engine takes no weight updates)."""
        self.weight_versions = {0: WeightsVersion("0", time.time(), None, None)}
        """The loaded versions by weight slot: one, or two while the old one drains."""
        self.weights_slot = 0
        """The slot of the current version: requests admitted now run on it."""
        self._weight_updates: list[tuple[str, str | None, str, WeightsDone]] = []
        self._weights_loading = False
        self.weight_swaps = 0
        """Versions switched to since start (a ``vllm:``-style counter)."""

    @property
    def weights_info(self) -> dict[str, object]:
        """The current version: label, when it began serving, where it was read from."""
        return self.weight_versions[self.weights_slot].info()

    def request_weight_update(self, path: str, version: str | None, policy: str, done: WeightsDone) -> None:
        """Serve the weights at ``path`` as version ``version`` (None: the next serial number) once
        read; ``policy`` says what running requests do (``POLICIES``). ``done(error, info)`` is told
        on the engine thread once the new version serves, or why it does not (the old one still does)."""
        self._inbox.put(("weights", (path, version, policy, done)))

    def _weights_admin(self, kind: str, payload: object) -> bool:
        """Apply a weights inbox item (engine thread); False if ``kind`` is not one."""
        if kind == "weights":
            path, version, policy, done = cast(tuple[str, str | None, str, WeightsDone], payload)
            if self.weight_loader is None:
                done("this server takes no weight updates (--enable-weight-updates)", self.weights_info)
            elif policy not in POLICIES:
                done(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}", self.weights_info)
            elif version is not None and any(v.label == version for v in self.weight_versions.values()):
                done(f"version {version!r} is already loaded", self.weights_info)
            else:
                self._weight_updates.append((path, version, policy, done))
                self._next_weight_update()
            return True
        if kind != "weights_loaded":
            return False
        staged, error, (path, version, policy, done) = cast(tuple[object, str | None, tuple], payload)
        self._weights_loading = False
        if error is None:
            self._switch(staged, path, version, policy)
        done(error, self.weights_info)
        self._next_weight_update()
        return True

    def _next_weight_update(self) -> None:
        """Start reading the next queued version, when none is being read and a slot is free."""
        if self._weights_loading or not self._weight_updates or len(self.weight_versions) > 1:
            return
        item = self._weight_updates.pop(0)
        self._weights_loading = True
        loader = self.weight_loader
        assert loader is not None

        def read() -> None:
            staged, error = None, None
            try:
                staged = loader.load(item[0])
            except Exception as e:  # any failure to read is the caller's 400, and the old version serves on
                logger.warning("weight update from %s refused: %s", item[0], e)
                error = str(e) or type(e).__name__
            self._inbox.put(("weights_loaded", (staged, error, item)))

        threading.Thread(target=read, name="myserve-weights", daemon=True).start()

    def _switch(self, staged: object, path: str, version: str | None, policy: str) -> None:
        """Between steps: the new version into the free slot, and current from now on."""
        assert self.weight_loader is not None
        old, slot = self.weights_slot, 1 - self.weights_slot
        self.weight_loader.install(staged, slot)
        self.weight_swaps += 1
        label = version if version is not None else str(self.weight_swaps)
        root = hashlib.sha256(f"weights {self.weight_swaps} {label}".encode()).digest()
        self.weight_versions[slot] = WeightsVersion(label, time.time(), path, root)
        self.weights_slot = slot
        if policy == "cut":  # every request goes on with the new weights (its K/V so far is kept)
            for req in self._requests.values():
                for seq in req.seqs:
                    seq.weights = slot
        logger.info("weights: version %s from %s serves (policy %s)", label, path, policy)
        self._retire_weights()
        if old in self.weight_versions:
            left = sum(1 for r in self._requests.values() if r.seqs and r.seqs[0].weights == old)
            logger.info("weights: version %s finishes its %d request(s)", self.weight_versions[old].label, left)

    def _retire_weights(self) -> None:
        """Let an old version go once no request runs on it (then a queued update may start)."""
        for slot in [s for s in self.weight_versions if s != self.weights_slot]:
            if not any(seq.weights == slot for req in self._requests.values() for seq in req.seqs):
                assert self.weight_loader is not None
                self.weight_loader.drop(slot)
                # The start froze the first weights' objects out of the collector's reach
                # (``EngineCore.start``): let it see what the old version left, then freeze again.
                gc.unfreeze()
                gc.collect()
                gc.freeze()
                logger.info("weights: version %s let go", self.weight_versions.pop(slot).label)
                self._next_weight_update()

    def _step_weights(self) -> int:
        """The weight slot of the next step: the current one, alternating with the old one's while
        it still has requests."""
        if len(self.weight_versions) > 1:
            self._retire_weights()
        if len(self.weight_versions) == 1:
            return self.weights_slot
        return self.weights_slot if self._iteration % 2 else 1 - self.weights_slot

    def _version_root(self, adapter_root: bytes | None) -> bytes | None:
        """The prefix-cache root of a request admitted now: its adapter's, under the current version's."""
        root = self.weight_versions[self.weights_slot].root
        if root is None:
            return adapter_root
        return root if adapter_root is None else hashlib.sha256(root + adapter_root).digest()

    def _version_label(self, seq_weights: int) -> str:
        return self.weight_versions[seq_weights].label
