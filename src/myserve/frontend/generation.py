"""What completions and chat share once a route has its prompts: the request's sampling
parameters, submitting one engine request per prompt, and the response (JSON or SSE)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Protocol

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from myserve.frontend.app_context import AppContext
from myserve.frontend.errors import APIError
from myserve.frontend.protocol import ChatCompletionRequest, CompletionRequest, Unsupported
from myserve.frontend.responses import WEIGHTS_HEADER, CompletionResponse, ResponseContext
from myserve.frontend.stream import RequestStream
from myserve.grammar import GrammarSpec
from myserve.wire.outputs import ContextLengthExceeded, EngineDead, EngineSleeping, Overloaded
from myserve.wire.params import InvalidParams, SamplingParams

logger = logging.getLogger(__name__)

GenerationRequest = CompletionRequest | ChatCompletionRequest
"""The two request bodies that generate text."""


class Admitted(Protocol):
    """A request body ``admit`` checks: the model it names and the fields it refuses."""

    @property
    def model(self) -> str | None:
        """The served model it names (None: the default)."""
        ...

    def unsupported(self) -> Unsupported | None:
        """The first refused field it sets, if any."""
        ...

    @property
    def ignored_fields(self) -> tuple[str, ...]:
        """Body fields no field reads."""
        ...


def admit(context: AppContext, req: Admitted, request: Request | None = None) -> float | None:
    """The checks every generation route starts with: 503 unless ready, 404 for another model's
    name, 400 for a field this server accepts but does not implement (the protocol's tables).
    Fields the body holds that no field reads are logged once and named in the response's
    ``guard.IGNORED_FIELDS_HEADER`` (through ``request``'s state: ``guard.py`` writes the header).
    Returns the request's deadline, which runs from its arrival."""
    expires = context.deadline()
    context.check_ready(req.model)
    refused = req.unsupported()
    if refused is not None:
        raise APIError(400, refused.message, param=refused.field, code="unsupported_parameter")
    ignored = req.ignored_fields
    if ignored:
        path = request.url.path if request is not None else "request"
        logger.warning("%s: the following fields were present in the request but ignored: %s", path, ignored)
        if request is not None:
            request.state.ignored_fields = ignored
    return expires


def max_tokens_of(req: GenerationRequest, given: int | None, field: str = "max_tokens") -> int | None:
    """The request's output limit: ``given`` (its ``field``), else llama-server's ``n_predict`` (-1:
    up to the context length), else ``given``'s default."""
    if req.n_predict is not None and field not in req.model_fields_set:
        return None if req.n_predict < 0 else max(req.n_predict, 1)
    return given


def _bad_words_ids(words: list[str], encode: Callable[[str], list[int]]) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of ``bad_words``: each word as written (leading blanks dropped) and with one
    leading space, the second kept only when it is another token sequence of the same length (the
    word's word-initial form, not the same word split otherwise)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(encode(word.lstrip()))
        if bare:
            out.append(bare)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
            out.append(spaced)
    return tuple(dict.fromkeys(out))


def grammar_param(req: GenerationRequest) -> str:
    """The request field a grammar came from, for errors about it."""
    for field in ("structured_outputs", "grammar", "json_schema"):
        if getattr(req, field) is not None:
            return field
    return "response_format"


def sampling_params(
    context: AppContext,
    req: GenerationRequest,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    *,
    grammar: GrammarSpec | None = None,
    grammar_after: tuple[int, ...] = (),
    skip_special_tokens: bool | None = None,
) -> SamplingParams:
    """The request's ``SamplingParams`` with OpenAI's defaults; 400 naming the field it refuses.

    ``prompt_logprobs``: what the route needs scored (completions' echo); the request's own
    ``prompt_logprobs`` field asks too (the larger of the two is computed)."""
    if req.prompt_logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, req.prompt_logprobs)
    for asked, field in ((logprobs, "logprobs"), (prompt_logprobs, "prompt_logprobs")):
        if asked is not None and asked > context.max_logprobs:
            message = f"{field} ({asked}) exceeds the server's max_logprobs ({context.max_logprobs})"
            raise APIError(400, message, param=field, code="invalid_value")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    # What the request leaves out: the model's generation config, else OpenAI's defaults.
    # (max_new_tokens applies per prompt, within its context: ``_submit_all``.)
    default = context.engine.generation_defaults
    context.check_token_ids(req.allowed_token_ids or (), "allowed_token_ids")
    encode = functools.partial(context.tokenizer.encode, add_special_tokens=False)
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=default.get("temperature", 1.0) if req.temperature is None else req.temperature,
            top_p=default.get("top_p", 1.0) if req.top_p is None else req.top_p,
            top_k=int(default.get("top_k", 0)) if req.top_k is None else req.top_k,
            min_p=default.get("min_p", 0.0) if req.min_p is None else req.min_p,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=default.get("repetition_penalty", 1.0)
            if req.repetition_penalty is None
            else req.repetition_penalty,
            logit_bias=SamplingParams.bias_from_mapping(req.logit_bias),
            seed=req.seed,
            n=req.n,
            stop=stop,
            include_stop_str_in_output=req.include_stop_str_in_output,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            allowed_token_ids=tuple(dict.fromkeys(req.allowed_token_ids or ())),
            bad_words_ids=_bad_words_ids(req.bad_words or [], encode),
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens if skip_special_tokens is None else skip_special_tokens,
            grammar=grammar,
            grammar_after=grammar_after,
            adapter=context.adapter_of(req.model),
        )
    except InvalidParams as e:
        raise APIError(400, str(e), param=e.param, code="invalid_value") from None
    # logit_bias keys are strings (JSON object keys) until SamplingParams has parsed them.
    context.check_token_ids((t for t, _ in params.logit_bias), "logit_bias")
    context.check_token_ids(params.stop_token_ids, "stop_token_ids")
    return params


Answer = Callable[[ResponseContext, list[RequestStream], AppContext], CompletionResponse]
"""Makes the answer to submitted streams: ``CompletionResponse`` or a subclass with other shapes."""


async def respond(
    context: AppContext,
    request: Request,
    response: ResponseContext,
    stream: bool,
    grammar_field: str | None,
    answer_class: Answer = CompletionResponse,
) -> Response:
    """Submit ``response``'s prompts, then answer with one JSON body or a stream of SSE events.

    ``grammar_field``: the request field named by errors about the grammar."""
    answer = submit_answer(context, request, response, grammar_field, answer_class)
    if not stream:
        return await answer.json(request)
    # (The version new requests run on as the stream opens; each chunk's fingerprint names its own.)
    headers = {"Cache-Control": "no-cache", WEIGHTS_HEADER: context.engine.stats().weights_version}
    return StreamingResponse(answer.events(), media_type="text/event-stream", headers=headers)


def submit_answer[A: CompletionResponse](
    context: AppContext,
    request: Request,
    response: ResponseContext,
    grammar_field: str | None,
    answer_class: Callable[[ResponseContext, list[RequestStream], AppContext], A],
) -> A:
    """Submit ``response``'s prompts; the answer that reads their outputs (its trace span started).
    ``respond`` answers with it at once; a background Responses request reads it in a task of its own."""
    streams = _submit_all(context, response, grammar_field)
    answer = answer_class(response, streams, context)
    if context.tracer is not None:
        answer.span = context.tracer.start(request.headers, response)
    return answer


def _submit_all(context: AppContext, response: ResponseContext, grammar_field: str | None) -> list[RequestStream]:
    """One engine request per prompt; if one is refused, the others are closed (aborted) and the
    refusal becomes its HTTP error."""
    streams: list[RequestStream] = []
    max_new = context.engine.generation_defaults.get("max_new_tokens")
    try:
        for i, ids in enumerate(response.prompts):
            params = response.params
            if max_new is not None and params.pooling is None and params.max_tokens != 0:
                # vLLM's bound: the smallest of the request's max_tokens (completions' default 16
                # included), the generation config's max_new_tokens and, when the request sets
                # none, what the context leaves (0 stays 0: completions' echo scores the prompt alone).
                room = context.engine.max_model_len - len(ids)
                bound = min(int(max_new), room) if params.max_tokens is None else min(int(max_new), params.max_tokens)
                params = dataclasses.replace(params, max_tokens=max(1, bound))
            request_id = f"{response.request_id}-{i}"
            if response.images:  # (a chat: one prompt, which holds them)
                streams.append(context.engine.submit(ids, params, request_id=request_id, images=response.images))
            else:
                streams.append(context.engine.submit(ids, params, request_id=request_id))
    except BaseException as e:
        for s in streams:
            s.close()
        prompt_field = {"chat": "messages", "completion": "prompt"}.get(response.kind, "input")
        if isinstance(e, InvalidParams):  # named by the field that asked for it
            param = {"grammar": grammar_field, "prompt": prompt_field}.get(e.param, e.param)
            raise APIError(400, str(e), param=param, code="invalid_value") from None
        if isinstance(e, ContextLengthExceeded):  # named by the field that made the prompt too long
            raise APIError(400, str(e), param=prompt_field, code="context_length_exceeded") from None
        if isinstance(e, Overloaded):
            raise APIError(429, str(e), code="overloaded", headers={"Retry-After": "1"}) from None
        if isinstance(e, EngineDead):
            raise APIError(503, str(e), code="engine_dead") from None
        if isinstance(e, EngineSleeping):
            raise APIError(503, str(e), code="engine_sleeping", headers={"Retry-After": "1"}) from None
        raise
    return streams
