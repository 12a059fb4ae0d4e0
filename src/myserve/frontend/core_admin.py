"""The front end's administrative requests to its engine core (adapter and weight updates), each
answered by the core with a message carrying the request's token. A mixin of ``EngineClient``,
which owns ``_answers``, ``_send`` and the receiver that settles the answers."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any, cast

from myserve.wire import messages as msg


class CoreAdmin:
    """``update_adapter``, ``update_weights``, ``sleep`` and ``wake_up`` of ``EngineClient``."""

    _answers: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]]
    """Requests waiting for the core's answer, by token (the receiver settles them)."""

    _send: Callable[[msg.ToCore], None]
    """EngineClient's: one message to the core (``EngineDead`` when it is not connected)."""

    async def _ask(self, message: Callable[[str], msg.ToCore]) -> Any:
        """Send ``message(token)`` to the core and wait for its answer carrying ``token``."""
        token = uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._answers[token] = (loop, future)
        try:
            self._send(message(token))
            return await future
        finally:
            self._answers.pop(token, None)

    async def update_adapter(self, name: str, path: str | None) -> str | None:
        """Register LoRA adapter ``name`` from ``path`` in the core (None: unregister it); the
        core's error, or None once done (every front end then knows the new set)."""
        return cast(str | None, await self._ask(lambda token: msg.UpdateAdapter(token, name, path)))

    async def update_weights(self, path: str, version: str | None, policy: str) -> tuple[str | None, dict]:
        """Serve the weights at ``path`` in the core (``core/engine_weights.py``); the core's error
        (None once the new version serves) and the version served now."""
        answer = await self._ask(lambda token: msg.UpdateWeights(token, path, version, policy))
        return cast(tuple[str | None, dict], answer)

    sleep_state: dict[str, object]
    """The core's sleep state as last heard (``is_sleeping``, ``level``; ``core/engine_sleep.py``)."""

    async def sleep(self, level: int) -> tuple[str | None, dict[str, object]]:
        """Put the core to sleep at ``level`` once its requests have finished (this front end
        refuses new ones from now on); the core's error (None once asleep) and its sleep state."""
        self.sleep_state = {**self.sleep_state, "is_sleeping": True}
        return cast(tuple[str | None, dict], await self._ask(lambda token: msg.Sleep(token, level)))

    async def wake_up(self) -> tuple[str | None, dict[str, object]]:
        """Wake the core up (or cancel a sleep still waiting); its error and sleep state."""
        return cast(tuple[str | None, dict], await self._ask(lambda token: msg.Sleep(token, 0)))
