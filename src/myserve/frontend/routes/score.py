"""``/v1/score`` and ``/v1/rerank`` (also ``/score``, ``/rerank`` and ``/v2/rerank``, as vLLM):
similarities of texts by the cosine of their embeddings, for a model that serves embeddings."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Request
from fastapi.responses import Response

from myserve.frontend.errors import APIError
from myserve.frontend.generation import admit, respond
from myserve.frontend.responses import ResponseContext
from myserve.frontend.routes.embeddings import check_embeds, embedding_inputs
from myserve.frontend.score_output import RerankResponse, ScoreResponse
from myserve.frontend.score_protocol import RerankRequest, ScoreRequest
from myserve.frontend.served_models import Models
from myserve.wire.params import SamplingParams
from myserve.wire.pooling import PoolingParams

router = APIRouter()

_PARAMS = SamplingParams(pooling=PoolingParams(normalize=True))


# text_1 against each of text_2 (one to many), or pair by pair (two lists of one length).
@router.post("/v1/score")
@router.post("/score", include_in_schema=False)
async def score(req: ScoreRequest, request: Request, models: Models) -> Response:
    context = models.resolve(req.model)
    expires = admit(context, req, request)
    check_embeds(context)
    first = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    second = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    if not first or not second:
        raise APIError(400, "text_1 and text_2 must not be empty", param="text_1", code="invalid_value")
    if len(first) > 1 and len(first) != len(second):
        message = f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many as text_2"
        raise APIError(400, message, param="text_2", code="invalid_value")
    inputs = embedding_inputs(context, [*first, *second], req.truncate_prompt_tokens, "text_1")
    n = len(first)
    pairs = [(0 if n == 1 else k, n + k) for k in range(len(second))]
    response = ResponseContext(
        kind="score", model=req.model or context.served_model_name, prompts=inputs, params=_PARAMS, deadline=expires
    )
    return await respond(context, request, response, False, None, functools.partial(ScoreResponse, pairs=pairs))


# The documents ordered by the cosine of their embedding with the query's, best first.
@router.post("/v1/rerank")
@router.post("/rerank", include_in_schema=False)
@router.post("/v2/rerank", include_in_schema=False)
async def rerank(req: RerankRequest, request: Request, models: Models) -> Response:
    context = models.resolve(req.model)
    expires = admit(context, req, request)
    check_embeds(context)
    if not req.documents:
        raise APIError(400, "documents must not be empty", param="documents", code="invalid_value")
    inputs = embedding_inputs(context, [req.query, *req.documents], req.truncate_prompt_tokens, "documents")
    response = ResponseContext(
        kind="rerank", model=req.model or context.served_model_name, prompts=inputs, params=_PARAMS, deadline=expires
    )
    answer = functools.partial(
        RerankResponse, documents=req.documents, top_n=req.top_n, return_documents=req.return_documents
    )
    return await respond(context, request, response, False, None, answer)
