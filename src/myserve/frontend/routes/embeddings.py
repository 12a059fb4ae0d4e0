"""``/v1/embeddings``: one engine request per input, each a prefill-only sequence whose final
hidden states are pooled into a vector (``docs/design/core.md``, "Embeddings")."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Request
from fastapi.responses import Response

from myserve.frontend.embedding_output import EmbeddingResponse
from myserve.frontend.errors import APIError
from myserve.frontend.generation import admit, respond
from myserve.frontend.protocol import MAX_EMBEDDING_INPUTS, EmbeddingRequest
from myserve.frontend.responses import ResponseContext
from myserve.frontend.routes.completions import completion_prompts
from myserve.frontend.served_models import Models
from myserve.wire.params import SamplingParams
from myserve.wire.pooling import PoolingParams

router = APIRouter()


# Validate, tokenize and truncate the inputs, submit them; the vectors in input order.
@router.post("/v1/embeddings")
async def embeddings(req: EmbeddingRequest, request: Request, models: Models) -> Response:
    context = models.resolve(req.model)
    expires = admit(context, req)
    pooler = context.engine.pooler
    if pooler is None:
        message = "this model does not serve embeddings (serve it with model.task: embed or generate+embed)"
        raise APIError(400, message, param="model", code="model_not_supported")
    if req.dimensions is not None and (why := pooler.check_dimensions(req.dimensions)):
        raise APIError(400, why, param="dimensions", code="invalid_value")
    encode = functools.partial(context.tokenizer.encode, add_special_tokens=True)
    inputs = completion_prompts(req.input, encode, "input")
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        raise APIError(400, f"at most {MAX_EMBEDDING_INPUTS} inputs per request", param="input", code="invalid_value")
    if isinstance(req.input, list) and not isinstance(req.input[0], str):
        context.check_token_ids((t for ids in inputs for t in ids), "input")
    if any(not ids for ids in inputs):
        raise APIError(400, "an input must contain at least one token", param="input", code="invalid_value")
    keep = req.truncate_prompt_tokens
    if keep is not None:
        limit = context.engine.max_model_len
        if keep > limit:
            message = f"truncate_prompt_tokens ({keep}) exceeds the model's context length ({limit})"
            raise APIError(400, message, param="truncate_prompt_tokens", code="invalid_value")
        keep = limit if keep == -1 else keep
        inputs = [ids[-keep:] if keep else ids for ids in inputs]
    params = SamplingParams(pooling=PoolingParams(dimensions=req.dimensions, normalize=req.normalize))
    response = ResponseContext(
        kind="embedding", model=req.model or context.served_model_name, prompts=inputs, params=params, deadline=expires
    )
    answer = functools.partial(EmbeddingResponse, encoding_format=req.encoding_format)
    return await respond(context, request, response, False, None, answer)
