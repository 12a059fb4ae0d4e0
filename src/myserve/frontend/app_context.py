"""What the routes of one served model share: its engine, its names, its options, its metrics.

The app builds one ``AppContext`` per served model; routes find the one a request names through
``ServedModels.resolve`` (``frontend/served_models.py``), never through closures over the app's
arguments.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from myserve.frontend.engine import Engine
from myserve.frontend.errors import APIError
from myserve.frontend.formatting import LogprobFormatter
from myserve.frontend.metrics import Metrics, ModelMetrics
from myserve.frontend.reasoning import ReasoningFormat
from myserve.frontend.tool_parsers import ToolParser
from myserve.frontend.tools import template_messages
from myserve.tokenizer import ChatTemplateError, Tokenizer

if TYPE_CHECKING:
    from myserve.frontend.tracing import RequestTracer


class ServerState:
    """Mutable server-wide state: draining flag for graceful shutdown, requests in flight (every
    served model's: the models of one app share one)."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0


@dataclasses.dataclass
class AppContext:
    """One served model's engine, names and options, with the checks and rendering its routes share."""

    engine: Engine
    """``GenerationService`` (in process) or ``EngineClient`` (the core in its own process)."""
    served_model_name: str
    """The model's name: what responses report, and the first of the ``model`` values it answers to."""
    aliases: tuple[str, ...] = ()
    """Further names requests may use for it (``served_model_name`` as a list)."""
    request_timeout_s: float | None = None
    """A generation request still running this long after it reached its handler is aborted."""
    chat_template: str | None = None
    """Jinja text replacing the tokenizer's chat template (None: the tokenizer's)."""
    auto_parser: type[ToolParser] | None = None
    """Reads tool calls out of ``tool_choice: auto`` outputs (None: auto tool choice is off)."""
    reasoning: ReasoningFormat | None = None
    """Splits ``reasoning_content`` off chat outputs (None: no reasoning parser)."""
    max_logprobs: int = 20
    """Most top logprobs a request may ask for (``server.max_logprobs``, vLLM's ``--max-logprobs``)."""
    state: ServerState = dataclasses.field(default_factory=ServerState)
    """Draining and requests in flight (``serve_http`` drains on a signal)."""
    tracer: RequestTracer | None = None
    """Makes each request's OpenTelemetry span (None: tracing is off, and its module never imported)."""
    app_metrics: dataclasses.InitVar[Metrics | None] = None
    """The app's metric families, shared by its models (None: a registry of its own)."""
    metrics: ModelMetrics = dataclasses.field(init=False)
    """This model's Prometheus series (labelled with its name)."""
    fmt: LogprobFormatter = dataclasses.field(init=False)
    """Logprobs in OpenAI's completions and chat shapes."""
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    """When the model card says the model was created (the app's start)."""

    def __post_init__(self, app_metrics: Metrics | None) -> None:
        self.metrics = (app_metrics or Metrics()).for_model(self.served_model_name, self.engine)
        self.fmt = LogprobFormatter(self.engine.tokenizer)

    @property
    def names(self) -> tuple[str, ...]:
        """Every ``model`` value this model answers to."""
        return (self.served_model_name, *self.aliases)

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer."""
        return self.engine.tokenizer

    def model_card(self, name: str | None = None) -> dict[str, Any]:
        """The model under ``name`` (one of ``names``; default its own), as ``/v1/models`` lists it."""
        return {
            "id": name or self.served_model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "myserve",
            "root": self.served_model_name,
            "max_model_len": self.engine.max_model_len,
        }

    def check_ready(self, model: str | None = None) -> None:
        """503 while draining or loading; 404 if ``model`` is given and is not one of this model's names."""
        if self.state.draining:
            raise APIError(503, "the server is shutting down", code="server_draining")
        if not self.engine.ready.is_set():
            raise APIError(503, "the model is still loading", code="server_not_ready")
        if model is not None and model != self.served_model_name and model not in self.aliases:
            raise model_not_found(model)

    def check_token_ids(self, ids: Iterable[int], param: str) -> None:
        """Token ids a client sent must index the model's vocabulary (its logits' width)."""
        vocab = self.engine.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"{param} token ids must be in [0, {vocab})", param=param, code="invalid_value")

    def render_text(
        self,
        messages: list,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The chat template applied to ``messages`` (400 naming ``messages`` if it fails)."""
        try:
            return self.tokenizer.render_chat(
                template_messages(messages),
                add_generation_prompt,
                tools=tools,
                chat_template=self.chat_template,
                template_kwargs=template_kwargs,
            )
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages") from None

    def encode_chat(self, text: str) -> list[int]:
        """A rendered chat's token ids: the template wrote BOS and friends itself, none are added."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def deadline(self) -> float | None:
        """When a request arriving now must be done (event-loop time), or None without a timeout."""
        if self.request_timeout_s is None:
            return None
        return asyncio.get_running_loop().time() + self.request_timeout_s


def model_not_found(model: str) -> APIError:
    """The 404 for a ``model`` this server does not serve."""
    return APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
