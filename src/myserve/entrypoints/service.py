"""GenerationService: the engine core and its front half in one process, for Python callers and tests.

``submit`` (any thread, usually the asyncio loop) validates a request, registers its stream with
the ``OutputProcessor`` and queues it in the core; the core's engine thread hands each iteration's
token deltas to the output thread (``frontend/output_thread.py``), whose processor detokenizes
them, applies stop strings (telling the core to abort a choice that matched one) and delivers
text deltas to the request's stream: the engine thread never detokenizes. Deltas reach
asyncio consumers through ``loop.call_soon_threadsafe``; nothing polls with sleeps.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Self

from myserve.core.engine_core import EngineCore
from myserve.frontend.images import ImageSupport
from myserve.frontend.output_processor import OutputProcessor
from myserve.frontend.output_thread import OutputThread
from myserve.frontend.stream import RequestStream, settle
from myserve.wire.images import ImageInput
from myserve.wire.params import SamplingParams

if TYPE_CHECKING:
    from myserve.runtime.deployment import Deployment
    from myserve.runtime.executor import Executor


class GenerationService(EngineCore):
    """An ``EngineCore`` whose token deltas become text deltas on a thread of their own."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.processor = OutputProcessor(self.tokenizer, abort_choice=self.abort)
        self.outputs = OutputThread(self.processor)  # detokenizing off the engine thread
        self.sink = self.outputs.put
        self.images: ImageSupport | None = None
        """The front end's image input of a vision-language model (``from_deployment`` sets it)."""

    @classmethod
    def from_deployment(cls, dep: Deployment, executors: Sequence[Executor] | None = None) -> Self:
        """A service (not yet started) for a loaded deployment, with its model's image input."""
        service = super().from_deployment(dep, executors)
        service.images = ImageSupport.load(service.image_model, dep.config.model)
        return service

    def shutdown(self) -> None:
        """Stop the engine thread (in-flight requests are aborted), then the output thread once it
        has delivered everything the engine handed it."""
        super().shutdown()
        self.outputs.close()

    async def update_adapter(self, name: str, path: str | None) -> str | None:
        """Register LoRA adapter ``name`` from ``path`` (None: unregister it) on the engine thread;
        its error, or None once done."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[str | None] = loop.create_future()

        def done(error: str | None, _: dict[str, str]) -> None:
            loop.call_soon_threadsafe(settle, future, error)

        self.request_adapter_update(name, path, done)
        return await future

    async def update_weights(self, path: str, version: str | None, policy: str) -> tuple[str | None, dict]:
        """Serve the weights at ``path`` (``core/engine_weights.py``); the error (None once the new
        version serves) and the version served now."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[tuple[str | None, dict]] = loop.create_future()

        def done(error: str | None, version: dict[str, object]) -> None:
            loop.call_soon_threadsafe(settle, future, (error, version))

        self.request_weight_update(path, version, policy, done)
        return await future

    async def sleep(self, level: int) -> tuple[str | None, dict[str, object]]:
        """Sleep at ``level`` once the requests held have finished (``core/engine_sleep.py``); the
        error (None once asleep) and the sleep state."""
        return await self._told(lambda done: self.request_sleep(level, done))

    async def wake_up(self) -> tuple[str | None, dict[str, object]]:
        """Wake up (or cancel a sleep still waiting); the error and the sleep state."""
        return await self._told(self.request_wake_up)

    async def _told(self, ask: Callable[[Callable[[str | None, dict[str, object]], None]], None]) -> tuple:
        """``ask(done)`` the engine thread, and wait for what it tells ``done``."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[tuple] = loop.create_future()

        def done(error: str | None, state: dict[str, object]) -> None:
            loop.call_soon_threadsafe(settle, future, (error, state))

        ask(done)
        return await future

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        images: Sequence[ImageInput] = (),
    ) -> RequestStream:
        """Queue a request (with its prompt's images, if any); returns the stream of its deltas.
        Raises on invalid or excess requests."""
        request_id = request_id or f"req-{uuid.uuid4().hex[:16]}"
        stream = RequestStream(request_id, on_close=self.abort)
        prompt = [int(t) for t in prompt_ids]
        self.processor.track(request_id, prompt, params, stream)
        try:
            self.add(request_id, prompt, params, images=images)
        except BaseException:
            self.processor.forget(request_id)
            raise
        return stream
