"""The FastAPI app: OpenAI routes over one or several models, each with its engine (an in-process
``GenerationService``, or an ``EngineClient`` whose core runs in its own process).

``create_models_app`` assembles it: one ``AppContext`` per served model (engine, names, options,
metrics) in a ``ServedModels`` registry, ``app.state.models``, through which every route finds the
model a request names (``create_app`` is the one-model form); the request guard (body size, API
key) inside CORS (``frontend/cors.py``), OpenAI-shaped errors, the routers of ``frontend/routes/``
and the schema of ``frontend/openapi.py``. Each generation route validates (pydantic, the unsupported-field tables,
then SamplingParams), renders chat templates, tokenizes, submits one engine request per prompt and
either collects the outputs into one JSON response or streams them as server-sent events. A client
that disconnects aborts its requests, and so does the per-request deadline (``request_timeout_s``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from fastapi import FastAPI

from myserve.frontend.app_context import AppContext, ServerState
from myserve.frontend.core_client import EngineClient
from myserve.frontend.cors import CORS, CORSPolicy
from myserve.frontend.engine import Engine
from myserve.frontend.errors import install_error_handlers
from myserve.frontend.guard import RequestGuard
from myserve.frontend.metrics import Metrics
from myserve.frontend.openapi import install_openapi
from myserve.frontend.reasoning import FORMATS
from myserve.frontend.routes import ROUTERS, lora, sleep, weights
from myserve.frontend.served_models import ServedModels
from myserve.frontend.tool_parsers import PARSERS

if TYPE_CHECKING:
    from myserve.frontend.tracing import RequestTracer


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServedModel:
    """One model an app serves: its engine (which the caller starts and stops), its names and options."""

    engine: Engine
    """``GenerationService`` or ``EngineClient``."""
    names: tuple[str, ...]
    """The ``model`` values it answers to; the first is the name responses report."""
    request_timeout_s: float | None = None
    """A generation request still running this long after it reached its handler (time queued in
    the engine included) is aborted: HTTP 504, or an error event ending its stream."""
    chat_template: str | None = None
    """Jinja text replacing the tokenizer's template."""
    tool_call_parser: str | None = None
    """A name of ``frontend/tool_parsers.py::PARSERS``: reads calls out of ``tool_choice: auto``
    outputs when ``enable_auto_tool_choice``."""
    enable_auto_tool_choice: bool = False
    """Serve ``tool_choice: auto`` (needs ``tool_call_parser``)."""
    reasoning_parser: str | None = None
    """A name of ``frontend/reasoning.py::FORMATS``: splits off ``reasoning_content``."""
    max_logprobs: int = 20
    """Most top logprobs a request may ask for (``server.max_logprobs``)."""
    trust_request_chat_template: bool = False
    """Whether requests may bring their own chat template (``server.trust_request_chat_template``)."""
    return_tokens_as_token_ids: bool = False
    """Logprobs name tokens ``token_id:<id>`` for every request (``server.return_tokens_as_token_ids``)."""

    def __post_init__(self) -> None:
        if not self.names:
            raise ValueError("a served model needs a name")
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"unknown tool call parser {self.tool_call_parser!r}; known: {', '.join(PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser")
        if self.reasoning_parser is not None and self.reasoning_parser not in FORMATS:
            raise ValueError(f"unknown reasoning parser {self.reasoning_parser!r}; known: {', '.join(FORMATS)}")


def create_app(
    service: Engine,
    *,
    served_model_name: str | Sequence[str],
    api_key: str | None = None,
    max_body_bytes: int = 4 * 1024 * 1024,
    request_timeout_s: float | None = None,
    chat_template: str | None = None,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
    reasoning_parser: str | None = None,
    tracer: RequestTracer | None = None,
    cors: CORSPolicy | None = None,
    responses_store_size: int = 256,
    weight_updates: bool = False,
    sleep_mode: bool = False,
) -> FastAPI:
    """The OpenAI-compatible app for one model, ``service`` (which the caller starts and stops),
    answering to ``served_model_name`` (a name, or names: aliases); the options as ``ServedModel``'s
    and ``create_models_app``'s."""
    names = (served_model_name,) if isinstance(served_model_name, str) else tuple(served_model_name)
    model = ServedModel(
        engine=service,
        names=names,
        request_timeout_s=request_timeout_s,
        chat_template=chat_template,
        tool_call_parser=tool_call_parser,
        enable_auto_tool_choice=enable_auto_tool_choice,
        reasoning_parser=reasoning_parser,
    )
    return create_models_app(
        [model],
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        tracer=tracer,
        cors=cors,
        responses_store_size=responses_store_size,
        weight_updates=weight_updates,
        sleep_mode=sleep_mode,
    )


def create_models_app(
    served: Sequence[ServedModel],
    *,
    api_key: str | None = None,
    max_body_bytes: int = 4 * 1024 * 1024,
    tracer: RequestTracer | None = None,
    cors: CORSPolicy | None = None,
    responses_store_size: int = 256,
    weight_updates: bool = False,
    sleep_mode: bool = False,
) -> FastAPI:
    """The app for several models (or one): a request goes to the model its ``model`` names, the
    first model where it names none; they share the API key, the body limit, the CORS policy (None =
    vLLM's default: any origin), the drain, the metrics registry (every series labelled with its
    model), ``tracer`` (``frontend/tracing.py``: a span per generation or embeddings request; None:
    no tracing) and the Responses API's store of ``responses_store_size`` responses (0: none stored);
    ``weight_updates``: serve ``/update_weights_from_disk`` (the engine takes them); ``sleep_mode``:
    serve ``/sleep``, ``/wake_up`` and ``/is_sleeping`` (``engine.enable_sleep_mode``)."""
    state, metrics = ServerState(responses_store_size), Metrics()
    contexts = [
        AppContext(
            m.engine,
            m.names[0],
            aliases=m.names[1:],
            request_timeout_s=m.request_timeout_s,
            chat_template=m.chat_template,
            auto_parser=PARSERS[m.tool_call_parser] if m.enable_auto_tool_choice and m.tool_call_parser else None,
            reasoning=FORMATS[m.reasoning_parser] if m.reasoning_parser else None,
            max_logprobs=m.max_logprobs,
            trust_request_chat_template=m.trust_request_chat_template,
            return_tokens_as_token_ids=m.return_tokens_as_token_ids,
            state=state,
            tracer=tracer,
            app_metrics=metrics,
        )
        for m in served
    ]
    models = ServedModels(contexts)
    clients = [m.engine for m in served if isinstance(m.engine, EngineClient)]

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        for client in clients:  # each core's messages are read in this loop
            await client.receive_in_loop()
        yield
        await state.responses.close()  # background responses end with the app (their streams close)
        for client in clients:
            await client.leave_loop()

    app = FastAPI(
        title="myserve", description="OpenAI-compatible LLM server on JAX", version="0.1.0", lifespan=lifespan
    )
    install_error_handlers(app)
    app.state.models = models
    app.state.context = models.default  # the first model's (run_batch reads its engine)
    app.add_middleware(RequestGuard, max_body_bytes=max_body_bytes, api_key=api_key)
    # Added last, so outermost: preflights are answered before the guard asks for the API key.
    app.add_middleware(CORS, policy=cors or CORSPolicy())
    for router in ROUTERS:
        app.include_router(router)
    if lora.enabled():  # vLLM's opt-in: loading adapters reads files the server can reach
        app.include_router(lora.router)
    if weight_updates:  # likewise opt-in (engine.enable_weight_updates)
        app.include_router(weights.router)
    if sleep_mode:  # vLLM's opt-in too (--enable-sleep-mode)
        app.include_router(sleep.router)
    install_openapi(app, models.engines)
    return app
