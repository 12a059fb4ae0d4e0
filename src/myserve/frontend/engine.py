"""What the front end needs of an engine, as a protocol: the app, the metrics and the HTTP server
take either an in-process ``GenerationService`` or an ``EngineClient`` (the core in its own process)
without importing the first, which holds the engine core (and with it JAX)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from myserve.frontend.images import ImageSupport
from myserve.frontend.stream import RequestStream
from myserve.tokenizer import Tokenizer
from myserve.wire.images import ImageInput
from myserve.wire.outputs import EngineStats
from myserve.wire.params import SamplingParams
from myserve.wire.pooling import Pooler


class Engine(Protocol):
    """An engine the front end can serve: ``GenerationService`` or ``EngineClient``."""

    ready: threading.Event
    """Set once the engine has warmed up and takes requests."""
    dead: BaseException | None
    """Why the engine stopped, once it has (``/health`` then answers 503)."""
    on_dead: Callable[[BaseException], None] | None
    """Called once after the engine died and every open request was failed."""
    pooler: Pooler | None
    """How the model makes embeddings (None: it serves none)."""
    generation_defaults: dict[str, float]
    """Sampling defaults for fields a request leaves out (the model's generation config)."""
    images: ImageSupport | None
    """A vision-language model's image input (its processor and limits); None: text only."""

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer."""
        ...

    @property
    def adapter_paths(self) -> dict[str, str]:
        """The LoRA adapters served (name -> path); empty when none are."""
        ...

    @property
    def max_model_len(self) -> int:
        """Prompt plus completion tokens the engine holds per sequence."""
        ...

    @property
    def vocab_size(self) -> int:
        """The width of the model's logits: token ids are below it."""
        ...

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        images: Sequence[ImageInput] = (),
    ) -> RequestStream:
        """Queue a request (with its prompt's images: a vision-language model's); the stream of its
        outputs. Raises on invalid or excess requests."""
        ...

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix (before the engine's next step)."""
        ...

    async def update_adapter(self, name: str, path: str | None) -> str | None:
        """Register LoRA adapter ``name`` from ``path`` (None: unregister it); the error, or None."""
        ...

    async def update_weights(self, path: str, version: str | None, policy: str) -> tuple[str | None, dict]:
        """Serve the weights at ``path`` as ``version`` under ``policy``; the error (None once the new
        version serves) and the version served now (label, loaded_at, path)."""
        ...

    @property
    def sleep_state(self) -> dict[str, object]:
        """``is_sleeping`` (asleep, or going to sleep) and ``level`` (``core/engine_sleep.py``)."""
        ...

    async def sleep(self, level: int) -> tuple[str | None, dict[str, object]]:
        """Sleep at ``level`` once the requests held have finished; the error (None once asleep)
        and the sleep state."""
        ...

    async def wake_up(self) -> tuple[str | None, dict[str, object]]:
        """Wake up (or cancel a sleep still waiting); the error and the sleep state."""
        ...

    def stats(self) -> EngineStats:
        """The engine's counters (queue lengths, pages, cache hits) for the metrics."""
        ...

    def start(self) -> None:
        """Warm up (or wait for the core to); raises if that failed."""
        ...

    def shutdown(self) -> None:
        """Stop the engine; in-flight requests are aborted."""
        ...
