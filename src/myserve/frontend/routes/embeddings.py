"""``/v1/embeddings``: one engine request per input, each a prefill-only sequence whose final
hidden states are pooled into a vector (``docs/design/core.md``, "Embeddings")."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Request
from fastapi.responses import Response

from myserve.frontend.app_context import AppContext
from myserve.frontend.embedding_output import EmbeddingResponse
from myserve.frontend.errors import APIError
from myserve.frontend.generation import admit, respond
from myserve.frontend.protocol import MAX_EMBEDDING_INPUTS, EmbeddingRequest
from myserve.frontend.responses import ResponseContext
from myserve.frontend.routes.completions import completion_prompts
from myserve.frontend.served_models import Models
from myserve.wire.params import SamplingParams
from myserve.wire.pooling import Pooler, PoolingParams

router = APIRouter()


# Validate, tokenize and truncate the inputs, submit them; the vectors in input order.
@router.post("/v1/embeddings")
async def embeddings(req: EmbeddingRequest, request: Request, models: Models) -> Response:
    context = models.resolve(req.model)
    expires = admit(context, req, request)
    pooler = check_embeds(context)
    if req.dimensions is not None and (why := pooler.check_dimensions(req.dimensions)):
        raise APIError(400, why, param="dimensions", code="invalid_value")
    inputs = embedding_inputs(context, req.input, req.truncate_prompt_tokens, "input")
    params = SamplingParams(pooling=PoolingParams(dimensions=req.dimensions, normalize=req.normalize))
    response = ResponseContext(
        kind="embedding", model=req.model or context.served_model_name, prompts=inputs, params=params, deadline=expires
    )
    answer = functools.partial(EmbeddingResponse, encoding_format=req.encoding_format)
    return await respond(context, request, response, False, None, answer)


def check_embeds(context: AppContext) -> Pooler:
    """The model's pooler; 400 for a model that serves no embeddings."""
    if context.engine.pooler is None:
        message = "this model does not serve embeddings (serve it with model.task: embed or generate+embed)"
        raise APIError(400, message, param="model", code="model_not_supported")
    return context.engine.pooler


def embedding_inputs(
    context: AppContext, raw: str | list[str] | list[int] | list[list[int]], keep: int | None, field: str
) -> list[list[int]]:
    """Texts or token ids to embed, tokenized (with special tokens) and checked: at most
    ``MAX_EMBEDDING_INPUTS``, none empty, ids inside the vocabulary, and each cut to its last
    ``keep`` tokens (``truncate_prompt_tokens``; -1: the context length). 400 naming ``field``."""
    encode = functools.partial(context.tokenizer.encode, add_special_tokens=True)
    inputs = completion_prompts(raw, encode, field)
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        raise APIError(400, f"at most {MAX_EMBEDDING_INPUTS} inputs per request", param=field, code="invalid_value")
    if isinstance(raw, list) and raw and not isinstance(raw[0], str):
        context.check_token_ids((t for ids in inputs for t in ids), field)
    if any(not ids for ids in inputs):
        raise APIError(400, "an input must contain at least one token", param=field, code="invalid_value")
    return context.truncate(inputs, keep)
