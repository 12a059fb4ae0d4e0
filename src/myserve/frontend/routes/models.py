"""The model list: ``/v1/models`` and ``/v1/models/{model}`` (every served model, aliases included)."""

from __future__ import annotations

from fastapi import APIRouter

from myserve.frontend.served_models import Models

router = APIRouter()


# One card per served name, as OpenAI's list.
@router.get("/v1/models")
async def models(served: Models) -> dict:
    return {"object": "list", "data": served.cards()}


# The card of the model served under that name; 404 for any other name.
# ":path" because served names may contain "/" (e.g. "meta-llama/Llama-3.1-8B-Instruct").
@router.get("/v1/models/{model:path}")
async def model_by_id(model: str, served: Models) -> dict:
    return served.resolve(model).model_card(model)
