"""The engine core's administrative requests, applied on the engine thread between steps: forget
the prefix cache, and register or unregister a LoRA adapter (vLLM's ``/v1/load_lora_adapter``).

A mixin of ``EngineCore`` (which owns ``_inbox``, ``replicas`` and ``adapters``), kept apart so the
loop's module stays about the loop.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from myserve.core.adapters import AdapterRegistry, UnknownAdapter
from myserve.errors import MyserveError

if TYPE_CHECKING:
    from myserve.core.replica import Replica

logger = logging.getLogger(__name__)

AdapterDone = Callable[[str | None, dict[str, str]], None]
"""Told once an adapter update is applied: the error (None: done) and the adapters now served."""


class EngineAdmin:
    """``reset_prefix_cache`` and adapter updates, queued to the engine thread."""

    _inbox: queue.SimpleQueue[tuple[str, object]]
    replicas: list[Replica]
    adapters: AdapterRegistry | None

    @property
    def adapter_paths(self) -> dict[str, str]:
        """The LoRA adapters served (name -> path); empty when none are."""
        return dict(self.adapters.paths) if self.adapters is not None else {}

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix, on the engine thread before its next step (running
        sequences keep their pages; later requests compute their prompts afresh)."""
        self._inbox.put(("reset_prefix_cache", None))

    def request_adapter_update(self, name: str, path: str | None, done: AdapterDone) -> None:
        """Register adapter ``name`` from ``path`` (None: unregister it) on the engine thread; then
        ``done(error, adapters)``. Requests already queued with an unregistered adapter still run."""
        self._inbox.put(("adapter", (name, path, done)))

    def _admin(self, kind: str, payload: object) -> bool:
        """Apply an administrative inbox item (engine thread); False if ``kind`` is not one."""
        if kind == "reset_prefix_cache":
            forgotten = sum(r.allocator.reset_prefix_cache() for r in self.replicas)
            logger.info("prefix cache reset: %d cached pages forgotten", forgotten)
            return True
        if kind != "adapter":
            return False
        name, path, done = cast(tuple[str, str | None, AdapterDone], payload)
        error = None
        try:
            error = self._apply_adapter(name, path)
        except MyserveError as e:  # an adapter that cannot be read or served: the caller's 400
            error = str(e)
        done(error, self.adapter_paths)
        return True

    def _apply_adapter(self, name: str, path: str | None) -> str | None:
        if self.adapters is None:
            return "this server does not serve LoRA adapters (--enable-lora)"
        if path is None:
            try:
                self.adapters.unregister(name)
            except UnknownAdapter:
                return f"The lora adapter '{name}' cannot be found."
            logger.info("LoRA adapter %s unloaded", name)
            return None
        if name in self.adapters.paths:
            return f"The lora adapter '{name}' has already been loaded."
        self.adapters.register(name, path)
        logger.info("LoRA adapter %s loaded from %s", name, path)
        return None
