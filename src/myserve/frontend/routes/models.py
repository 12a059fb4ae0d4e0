"""The model list: ``/v1/models`` and ``/v1/models/{model}`` (the one served model)."""

from __future__ import annotations

from fastapi import APIRouter

from myserve.frontend.app_context import Context, model_not_found

router = APIRouter()


# The served model's card, as OpenAI's list.
@router.get("/v1/models")
async def models(context: Context) -> dict:
    return {"object": "list", "data": [context.model_card()]}


# The served model's card; 404 for any other name.
# ":path" because served names may contain "/" (e.g. "meta-llama/Llama-3.1-8B-Instruct").
@router.get("/v1/models/{model:path}")
async def model_by_id(model: str, context: Context) -> dict:
    if model != context.served_model_name:
        raise model_not_found(model)
    return context.model_card()
