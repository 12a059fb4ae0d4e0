"""The FastAPI app: OpenAI routes over an engine (an in-process ``GenerationService``, or an
``EngineClient`` whose core runs in its own process).

``create_app`` assembles it: one ``AppContext`` (engine, served model, options, metrics) in
``app.state.context``, the request guard (body size, API key), OpenAI-shaped errors, the routers of
``frontend/routes/`` and the schema of ``frontend/openapi.py``. Each generation route validates
(pydantic, the unsupported-field tables, then SamplingParams), renders chat templates, tokenizes,
submits one engine request per prompt and either collects the outputs into one JSON response or
streams them as server-sent events. A client that disconnects aborts its requests, and so does the
per-request deadline (``request_timeout_s``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI

from myserve.frontend.app_context import AppContext
from myserve.frontend.core_client import EngineClient
from myserve.frontend.engine import Engine
from myserve.frontend.errors import install_error_handlers
from myserve.frontend.guard import RequestGuard
from myserve.frontend.openapi import install_openapi
from myserve.frontend.reasoning import FORMATS
from myserve.frontend.routes import ROUTERS
from myserve.frontend.tool_parsers import PARSERS


def create_app(
    service: Engine,
    *,
    served_model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = 4 * 1024 * 1024,
    request_timeout_s: float | None = None,
    chat_template: str | None = None,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
    reasoning_parser: str | None = None,
) -> FastAPI:
    """The OpenAI-compatible app for ``service`` (which the caller starts and stops).

    ``request_timeout_s``: a generation request still running this long after it reached its handler
    (time queued in the engine included) is aborted: HTTP 504, or an error event ending its stream.
    ``chat_template``: Jinja text replacing the tokenizer's template. ``tool_call_parser`` (a name
    of ``frontend/tool_parsers.py::PARSERS``) reads calls out of ``tool_choice: auto`` outputs when
    ``enable_auto_tool_choice``; ``reasoning_parser`` (``frontend/reasoning.py::FORMATS``) splits off
    ``reasoning_content``.
    """
    if tool_call_parser is not None and tool_call_parser not in PARSERS:
        raise ValueError(f"unknown tool call parser {tool_call_parser!r}; known: {', '.join(PARSERS)}")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("enable_auto_tool_choice needs a tool_call_parser")
    if reasoning_parser is not None and reasoning_parser not in FORMATS:
        raise ValueError(f"unknown reasoning parser {reasoning_parser!r}; known: {', '.join(FORMATS)}")
    context = AppContext(
        service,
        served_model_name,
        request_timeout_s=request_timeout_s,
        chat_template=chat_template,
        auto_parser=PARSERS[tool_call_parser] if enable_auto_tool_choice and tool_call_parser else None,
        reasoning=FORMATS[reasoning_parser] if reasoning_parser else None,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if isinstance(service, EngineClient):  # the core's messages are read in this loop
            await service.receive_in_loop()
        yield
        if isinstance(service, EngineClient):
            await service.leave_loop()

    app = FastAPI(
        title="myserve", description="OpenAI-compatible LLM server on JAX", version="0.1.0", lifespan=lifespan
    )
    install_error_handlers(app)
    app.state.context = context
    app.add_middleware(RequestGuard, max_body_bytes=max_body_bytes, api_key=api_key)
    for router in ROUTERS:
        app.include_router(router)
    install_openapi(app, service)
    return app
