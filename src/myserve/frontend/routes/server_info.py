"""vLLM's and SageMaker's small endpoints: ``/version``, ``/ping``, ``/invocations``,
``/server_info`` and ``/reset_prefix_cache`` (``/flush_cache``)."""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from myserve.frontend.errors import APIError
from myserve.frontend.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from myserve.frontend.routes.chat import chat_completions
from myserve.frontend.routes.completions import completions
from myserve.frontend.routes.embeddings import embeddings
from myserve.frontend.routes.health import health
from myserve.frontend.served_models import Models

router = APIRouter()


def myserve_version() -> str:
    """The installed package's version."""
    try:
        return version("myserve")
    except PackageNotFoundError:
        return "0+unknown"


# The server's version (no key needed, as /health).
@router.get("/version")
async def server_version() -> Response:
    return JSONResponse({"version": myserve_version()})


# SageMaker's health check: /health's answer.
@router.get("/ping")
@router.post("/ping", include_in_schema=False)
async def ping(models: Models) -> Response:
    return await health(models)


# SageMaker's one inference route: a body with messages is a chat completion, with prompt a
# completion, with input an embeddings request.
@router.post("/invocations")
async def invocations(request: Request, models: Models) -> Response:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError(400, "the request body is not valid JSON", code="invalid_value") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_value")
    if "messages" in body:
        return await chat_completions(_parse(ChatCompletionRequest, body), request, models)
    if "prompt" in body:
        return await completions(_parse(CompletionRequest, body), request, models)
    if "input" in body:
        return await embeddings(_parse(EmbeddingRequest, body), request, models)
    raise APIError(400, "an invocation body has messages (chat), prompt (completion) or input (embeddings)")


def _parse[T: BaseModel](cls: type[T], body: dict[str, Any]) -> T:
    """``body`` as ``cls``; a validation error is the app's 400, as on the endpoint itself."""
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None


# What is served: the version and each model's names, context length, vocabulary and request defaults.
@router.get("/server_info")
async def server_info(models: Models) -> Response:
    served = [
        {
            "names": list(context.names),
            "max_model_len": context.engine.max_model_len,
            "vocab_size": context.engine.vocab_size,
            "embeddings": context.engine.pooler is not None,
            "generation_defaults": context.engine.generation_defaults,
        }
        for context in models.contexts
    ]
    return JSONResponse({"version": myserve_version(), "models": served})


# Forget every cached prompt prefix of every model (vLLM's; e.g. between benchmark runs). Also
# under sglang's name, which vllm-router fans out to every backend on its own /flush_cache.
@router.post("/reset_prefix_cache")
@router.post("/flush_cache")
async def reset_prefix_cache(models: Models) -> Response:
    for engine in models.engines:
        engine.reset_prefix_cache()
    return Response(status_code=200)
