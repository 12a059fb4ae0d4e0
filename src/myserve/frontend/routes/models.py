"""The model list: ``/v1/models`` and ``/v1/models/{model}`` (every served model, aliases included)."""

from __future__ import annotations

from fastapi import APIRouter

from myserve.frontend.app_context import model_loading
from myserve.frontend.served_models import Models

router = APIRouter()


# One card per name of each loaded model, as OpenAI's list; 503 while none has loaded (as a vLLM
# server, which listens only once its model serves: a client that waits for the list may send).
@router.get("/v1/models")
async def models(served: Models) -> dict:
    if not any(engine.ready.is_set() for engine in served.engines):
        raise model_loading()
    return {"object": "list", "data": served.cards()}


# The card of the model served under that name; 404 for any other name, 503 while it loads.
# ":path" because served names may contain "/" (e.g. "meta-llama/Llama-3.1-8B-Instruct").
@router.get("/v1/models/{model:path}")
async def model_by_id(model: str, served: Models) -> dict:
    context = served.resolve(model)
    if not context.engine.ready.is_set():
        raise model_loading()
    return context.model_card(model)
