"""``/v1/completions``: one engine request per prompt (OpenAI's four prompt forms), with ``echo``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from myserve.frontend.errors import APIError
from myserve.frontend.generation import admit, grammar_param, max_tokens_of, respond, sampling_params
from myserve.frontend.protocol import CompletionRequest
from myserve.frontend.responses import ResponseContext
from myserve.frontend.served_models import Models
from myserve.frontend.structured import request_grammar

router = APIRouter()


# Validate, tokenize the prompts, submit them; JSON or SSE.
@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request, models: Models) -> Response:
    context = models.resolve(req.model)
    expires = admit(context, req, request)
    tokenizer = context.tokenizer
    prompts = completion_prompts(req.prompt, tokenizer.encode, "prompt")
    if isinstance(req.prompt, list) and not isinstance(req.prompt[0], str):  # the client's token ids,
        context.check_token_ids((t for p in prompts for t in p), "prompt")  # checked before echo decodes them
    prompts = context.truncate(prompts, req.truncate_prompt_tokens)
    max_tokens = max_tokens_of(req, req.max_tokens)
    # echo with logprobs scores the prompt; echo with max_tokens 0 returns only the prompt.
    prompt_logprobs = None
    if req.echo and (req.logprobs is not None or max_tokens == 0):
        prompt_logprobs = req.logprobs or 0
    grammar = request_grammar(req)
    params = sampling_params(context, req, max_tokens, req.logprobs, prompt_logprobs, grammar=grammar)
    response = ResponseContext(
        kind="completion",
        model=req.model,
        prompts=prompts,
        params=params,
        echo_texts=[tokenizer.decode(p) for p in prompts] if req.echo else None,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        deadline=expires,
        prompt_logprobs=req.prompt_logprobs,
        token_ids_as_text=req.return_tokens_as_token_ids or context.return_tokens_as_token_ids,
    )
    return await respond(context, request, response, req.stream, grammar_param(req))


def completion_prompts(prompt: Any, encode: Callable[[str], list[int]], param: str) -> list[list[int]]:
    """OpenAI's four prompt forms (text, texts, token ids, lists of token ids) as token-id lists;
    ``param`` names the field in errors (completions' ``prompt``, embeddings' ``input``)."""
    if isinstance(prompt, str):
        return [encode(prompt)]
    if not prompt:
        raise APIError(400, f"{param} must not be empty", param=param, code="invalid_value")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return [encode(p) for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        return [list(p) for p in prompt]
    raise APIError(400, f"{param} must be a string, a list of strings, or token ids", param=param)
