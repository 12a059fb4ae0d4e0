"""vLLM's runtime adapter endpoints: ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

Served only where vLLM serves them: with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`` in the
environment (loading an adapter reads files the server can reach, so it is opt-in), on an engine
started with ``--enable-lora``. Requests already queued with an unloaded adapter still run; new
ones naming it get a 404. The adapter goes to the default model's engine (the first served)."""

from __future__ import annotations

import os

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from myserve.frontend.errors import APIError
from myserve.frontend.protocol import _Request
from myserve.frontend.served_models import Models

ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
"""The environment variable that turns these endpoints on (vLLM's)."""

router = APIRouter()


def enabled() -> bool:
    """Whether the environment asks for runtime adapter updates."""
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes")


class LoadLoraAdapterRequest(_Request):
    """``POST /v1/load_lora_adapter``."""

    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(_Request):
    """``POST /v1/unload_lora_adapter``."""

    lora_name: str


# Read a PEFT adapter and serve it under lora_name (400: already loaded, unreadable or unservable).
@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(req: LoadLoraAdapterRequest, models: Models) -> str:
    context = models.default
    context.check_ready()
    if not req.lora_name or not req.lora_path:
        raise APIError(400, "both lora_name and lora_path must be given", param="lora_name", code="invalid_value")
    if req.lora_name in context.names:
        message = f"'{req.lora_name}' is the name of a served model"
        raise APIError(400, message, param="lora_name", code="invalid_value")
    error = await context.engine.update_adapter(req.lora_name, req.lora_path)
    if error is not None:
        raise APIError(400, error, param="lora_path", code="invalid_value")
    return f"Success: LoRA adapter '{req.lora_name}' added successfully."


# Stop serving an adapter (404 when it is not loaded).
@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(req: UnloadLoraAdapterRequest, models: Models) -> str:
    context = models.default
    context.check_ready()
    error = await context.engine.update_adapter(req.lora_name, None)
    if error is not None:
        code = 404 if "cannot be found" in error else 400
        raise APIError(code, error, param="lora_name", code="not_found" if code == 404 else "invalid_value")
    return f"Success: LoRA adapter '{req.lora_name}' removed successfully."
