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
from myserve.frontend.protocol import ChatTemplateFields
from myserve.frontend.reasoning import ReasoningFormat
from myserve.frontend.responses_store import ResponseStore
from myserve.frontend.tool_parsers import ToolParser
from myserve.frontend.tools import template_messages
from myserve.tokenizer import ChatTemplateError, Tokenizer

if TYPE_CHECKING:
    from myserve.frontend.tracing import RequestTracer


class ServerState:
    """Mutable server-wide state: draining flag for graceful shutdown, requests in flight, stored
    Responses API objects (every served model's: the models of one app share one)."""

    def __init__(self, responses_store_size: int = 256) -> None:
        self.draining = False
        self.in_flight = 0
        self.responses = ResponseStore(responses_store_size)
        """The Responses API objects kept for ``GET /v1/responses/{id}`` (``server.responses_store_size``)."""


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
    trust_request_chat_template: bool = False
    """Whether a request may bring its own chat template (``server.trust_request_chat_template``,
    vLLM's ``--trust-request-chat-template``): a template is code the server runs."""
    return_tokens_as_token_ids: bool = False
    """Logprobs name tokens ``token_id:<id>`` whatever the request asks (``server.return_tokens_as_token_ids``)."""
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
            **self.weights_card(),
        }

    def weights_card(self) -> dict[str, Any]:
        """The version of the weights new requests run on, and when it began serving (live updates:
        ``core/engine_weights.py``); none while the engine loads."""
        if not self.engine.ready.is_set():
            return {}
        stats = self.engine.stats()
        return {"weights_version": stats.weights_version, "weights_loaded_at": int(stats.weights_loaded_at)}

    def check_ready(self, model: str | None = None) -> None:
        """503 while draining or loading; 404 if ``model`` is given and is not one of this model's names."""
        if self.state.draining:
            raise APIError(503, "the server is shutting down", code="server_draining")
        if not self.engine.ready.is_set():
            raise model_loading()
        if model is not None and model not in self.names and model not in self.engine.adapter_paths:
            raise model_not_found(model)

    def adapter_of(self, model: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` names (None: the base model, by any of its names)."""
        return model if model is not None and model not in self.names and model in self.engine.adapter_paths else None

    def adapter_cards(self) -> list[dict[str, Any]]:
        """``/v1/models`` cards of the LoRA adapters served (vLLM's: the base model as ``parent``)."""
        return [
            {**self.model_card(), "id": name, "root": path, "parent": self.served_model_name}
            for name, path in self.engine.adapter_paths.items()
        ]

    def check_token_ids(self, ids: Iterable[int], param: str) -> None:
        """Token ids a client sent must index the model's vocabulary (its logits' width)."""
        vocab = self.engine.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"{param} token ids must be in [0, {vocab})", param=param, code="invalid_value")

    def render_text(
        self,
        messages: list,
        how: ChatTemplateFields | None = None,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The chat template applied to ``messages``, rendered as ``how`` asks (generation prompt,
        continued final message, documents, a request's own template; None: the defaults), with
        ``tools`` and extra ``template_kwargs``. 400 naming the field that made it fail."""
        how = how or ChatTemplateFields()
        template = self.chat_template
        if how.chat_template is not None:
            if not self.trust_request_chat_template:
                message = "this server does not accept chat templates in requests (--trust-request-chat-template)"
                raise APIError(400, message, param="chat_template", code="invalid_value")
            template = how.chat_template
        if how.continue_final_message and (not messages or messages[-1].role != "assistant"):
            message = "continue_final_message needs the last message to be an assistant message"
            raise APIError(400, message, param="continue_final_message", code="invalid_value")
        variables = dict(template_kwargs or {})
        if how.documents is not None:
            variables["documents"] = how.documents
        try:
            return self.tokenizer.render_chat(
                template_messages(messages),
                how.add_generation_prompt,
                tools=tools,
                chat_template=template,
                template_kwargs=variables,
                continue_final_message=how.continue_final_message,
            )
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="chat_template" if how.chat_template else "messages") from None

    def truncate(self, prompts: list[list[int]], keep: int | None) -> list[list[int]]:
        """Each prompt cut to its last ``keep`` tokens (``truncate_prompt_tokens``; -1: the context
        length; None or 0: uncut); 400 when ``keep`` exceeds the context length."""
        if not keep:
            return prompts
        limit = self.engine.max_model_len
        if keep > limit:
            message = f"truncate_prompt_tokens ({keep}) exceeds the model's context length ({limit})"
            raise APIError(400, message, param="truncate_prompt_tokens", code="invalid_value")
        keep = limit if keep == -1 else keep
        return [ids[-keep:] for ids in prompts]

    def encode_chat(self, text: str) -> list[int]:
        """A rendered chat's token ids: the template wrote BOS and friends itself, none are added."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def deadline(self) -> float | None:
        """When a request arriving now must be done (event-loop time), or None without a timeout."""
        if self.request_timeout_s is None:
            return None
        return asyncio.get_running_loop().time() + self.request_timeout_s


def model_loading() -> APIError:
    """The 503 for a model whose engine is still loading."""
    return APIError(503, "the model is still loading", code="server_not_ready")


def model_not_found(model: str) -> APIError:
    """The 404 for a ``model`` this server does not serve."""
    return APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
