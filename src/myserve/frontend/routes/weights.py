"""sglang's live weight update: ``POST /update_weights_from_disk`` (``core/engine_weights.py``).

Served only on an engine started with ``--enable-weight-updates`` (``engine.enable_weight_updates``:
an update reads files the server can reach, so it is opt-in), behind the API key like every route.
The body is sglang's, ``{"model_path": DIR}``, with our optional ``version`` label and ``policy``
(``"finish"``: every running request finishes on the version it started on; ``"cut"``: they go on
with the new one). The answer comes once the new version serves: ``{"success": true, "message",
"version", "loaded_at"}``; a refused update is a 400 (the old version serves on) whose body is an
OpenAI error with sglang's ``success: false`` and ``message`` beside it. The update goes to the
default model's engine (the first served)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from myserve.frontend.errors import APIError
from myserve.frontend.protocol import _Request
from myserve.frontend.served_models import Models

router = APIRouter()


class UpdateWeightsRequest(_Request):
    """``POST /update_weights_from_disk``."""

    model_path: str
    version: str | None = None
    policy: Literal["finish", "cut"] = "finish"


# Read a new version of the weights and serve it (400: unreadable, or not the served model's shape).
@router.post("/update_weights_from_disk")
async def update_weights_from_disk(req: UpdateWeightsRequest, models: Models) -> JSONResponse:
    context = models.default
    context.check_ready()
    if not req.model_path:
        raise APIError(400, "model_path must name a checkpoint", param="model_path", code="invalid_value")
    if req.version is not None and not (0 < len(req.version) <= 64 and req.version.isprintable()):
        raise APIError(400, "version must be 1 to 64 printable characters", param="version", code="invalid_value")
    error, version = await context.engine.update_weights(req.model_path, req.version, req.policy)
    if error is not None:
        refused = APIError(400, error, param="model_path", code="invalid_value")
        return JSONResponse({"success": False, "message": error, **refused.body()}, status_code=400)
    message = f"weights version {version['version']} from {req.model_path} serves (policy {req.policy})"
    return JSONResponse({"success": True, "message": message, **version, "num_paused_requests": 0})
