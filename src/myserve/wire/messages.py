"""The messages between the HTTP front end and the engine core process, and their codec.

Transport: two ZeroMQ PUSH/PULL pairs over ``ipc://`` sockets per front end, one each way (the
front end binds both, the core connects: one PULL fair-queues every front end's requests, one PUSH
per front end carries its outputs back). Serializer: msgspec's MessagePack with typed decoding: the engine's own
dataclasses (``SamplingParams`` with its ``GrammarSpec``, ``RequestOutput`` with its logprobs,
``EngineStats``) travel as they are, checked on decode, without pickle (nothing the receiver did not
declare can be built from a message). Measured per message on this machine: see
docs/design/wire.md, "Codec".
"""

from __future__ import annotations

import msgspec

from myserve.wire.images import ImageInput, ImageModel
from myserve.wire.outputs import EngineStats, RequestOutput
from myserve.wire.params import SamplingParams
from myserve.wire.pooling import Pooler


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    """Front -> core: queue a validated request."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    front_end: int = 0
    """Which front end sent it (``--api-server-count``): the one its outputs go back to."""
    images: list[ImageInput] = msgspec.field(default_factory=list)
    """The prompt's images, preprocessed, in prompt order (a vision-language model's)."""


class AbortRequest(msgspec.Struct, tag="abort", array_like=True):
    """Front -> core: abort a request (``choice`` None) or one of its choices (a stop string matched)."""

    request_id: str
    choice: int | None = None


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache", array_like=True):
    """Front -> core: forget every cached prompt prefix (``/reset_prefix_cache``)."""


class UpdateAdapter(msgspec.Struct, tag="update_adapter", array_like=True):
    """Front -> core: register LoRA adapter ``name`` from ``path`` (None: unregister it); the core
    answers every front end with ``AdaptersChanged`` carrying ``token``."""

    token: str
    name: str
    path: str | None = None


class UpdateWeights(msgspec.Struct, tag="update_weights", array_like=True):
    """Front -> core: serve the weights at ``path`` as version ``version`` (None: a serial number)
    under ``policy`` (``core/engine_weights.py``); the core answers every front end with
    ``WeightsChanged`` carrying ``token``."""

    token: str
    path: str
    version: str | None = None
    policy: str = "finish"


class Sleep(msgspec.Struct, tag="sleep", array_like=True):
    """Front -> core: sleep at ``level`` once the requests held have finished, or wake up (level
    0; ``core/engine_sleep.py``); the core answers every front end with ``SleepChanged``."""

    token: str
    level: int


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Front -> core: stop (in-flight requests are aborted) and exit 0."""


class Loaded(msgspec.Struct, tag="loaded", array_like=True):
    """Core -> front: the deployment loaded (warmup follows); what the front end needs of it."""

    vocab_size: int
    max_model_len: int
    max_waiting: int
    pooler: Pooler | None = None
    """How the model makes embeddings; None when it serves none."""
    generation_defaults: dict[str, float] = msgspec.field(default_factory=dict)
    """Request defaults from the model's generation config (temperature, top_p, max_new_tokens...)."""
    adapters: dict[str, str] = msgspec.field(default_factory=dict)
    """The LoRA adapters served (name -> path)."""
    images: ImageModel | None = None
    """A vision-language model's image input (None: the model takes no images)."""


class Ready(msgspec.Struct, tag="ready", array_like=True):
    """Core -> front: warmed up, serving."""


class Outputs(msgspec.Struct, tag="outputs", array_like=True):
    """Core -> front: one engine iteration's token deltas, and the counters when they are due."""

    outputs: list[RequestOutput]
    stats: EngineStats | None = None


class Heartbeat(msgspec.Struct, tag="heartbeat", array_like=True):
    """Core -> front: alive while idle, with its counters."""

    stats: EngineStats


class AdaptersChanged(msgspec.Struct, tag="adapters", array_like=True):
    """Core -> every front end: the answer to ``UpdateAdapter`` ``token`` (``error`` None: done) and
    the adapters served now."""

    token: str
    error: str | None
    adapters: dict[str, str]


class WeightsChanged(msgspec.Struct, tag="weights", array_like=True):
    """Core -> every front end: the answer to ``UpdateWeights`` ``token`` (``error`` None: the new
    version serves) and the version served now (label, loaded_at, path)."""

    token: str
    error: str | None
    version: dict[str, str | int | None]


class SleepChanged(msgspec.Struct, tag="slept", array_like=True):
    """Core -> every front end: the answer to ``Sleep`` ``token`` (``error`` None: done) and the
    sleep state now (``is_sleeping``, ``level``, the last sleep's device bytes)."""

    token: str
    error: str | None
    state: dict[str, bool | int]


class Died(msgspec.Struct, tag="died", array_like=True):
    """Core -> front: the engine stopped on an error (every request was failed first)."""

    message: str
    config_error: bool = False
    """The deployment could not load because of its configuration: a one-line error, exit 2."""


ToCore = AddRequest | AbortRequest | ResetPrefixCache | UpdateAdapter | UpdateWeights | Sleep | Shutdown
FromCore = Loaded | Ready | Outputs | Heartbeat | AdaptersChanged | WeightsChanged | SleepChanged | Died

encoder = msgspec.msgpack.Encoder()
to_core = msgspec.msgpack.Decoder(ToCore)
from_core = msgspec.msgpack.Decoder(FromCore)
