"""The FastAPI app: OpenAI routes over a GenerationService (or an EngineClient, whose core runs in its own process).

Each route validates (pydantic, the unsupported-field tables, then SamplingParams), renders chat
templates, tokenizes, checks the context length, submits one engine request per prompt and either
collects the outputs into one JSON response or streams them as server-sent events. A client that
disconnects aborts its requests, and so does the per-request deadline (``request_timeout_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from myserve.frontend.chat_output import ChoiceParser
from myserve.frontend.core_client import EngineClient
from myserve.frontend.errors import APIError, install_error_handlers
from myserve.frontend.formatting import LogprobFormatter
from myserve.frontend.guard import RequestGuard
from myserve.frontend.metrics import Metrics
from myserve.frontend.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from myserve.frontend.reasoning import FORMATS, ReasoningParser
from myserve.frontend.responses import CompletionResponse, ServerState
from myserve.frontend.stream import RequestStream
from myserve.frontend.structured import request_grammar
from myserve.frontend.tool_parsers import PARSERS
from myserve.frontend.tools import plan_tools, template_messages
from myserve.grammar import GrammarSpec
from myserve.tokenizer import ChatTemplateError
from myserve.wire.outputs import ContextLengthExceeded, EngineDead, Overloaded
from myserve.wire.params import MAX_TOP_LOGPROBS, InvalidParams, SamplingParams

if TYPE_CHECKING:  # (the front end of a core process never imports the engine, nor JAX)
    from myserve.service import GenerationService


def create_app(
    service: GenerationService | EngineClient,
    *,
    served_model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = 4 * 1024 * 1024,
    request_timeout_s: float | None = None,
    chat_template: str | None = None,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
    reasoning_parser: str | None = None,
) -> FastAPI:
    """The OpenAI-compatible app for ``service`` (which the caller starts and stops).

    ``request_timeout_s``: a generation request still running this long after it reached its handler
    (time queued in the engine included) is aborted: HTTP 504, or an error event ending its stream.
    ``chat_template``: Jinja text replacing the tokenizer's template. ``tool_call_parser`` (a name
    of ``frontend/tool_parsers.py::PARSERS``) reads calls out of ``tool_choice: auto`` outputs when
    ``enable_auto_tool_choice``; ``reasoning_parser`` (``frontend/reasoning.py::FORMATS``) splits off
    ``reasoning_content``.
    """
    if tool_call_parser is not None and tool_call_parser not in PARSERS:
        raise ValueError(f"unknown tool call parser {tool_call_parser!r}; known: {', '.join(PARSERS)}")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("enable_auto_tool_choice needs a tool_call_parser")
    if reasoning_parser is not None and reasoning_parser not in FORMATS:
        raise ValueError(f"unknown reasoning parser {reasoning_parser!r}; known: {', '.join(FORMATS)}")
    auto_parser = PARSERS[tool_call_parser] if enable_auto_tool_choice and tool_call_parser else None
    reasoning = FORMATS[reasoning_parser] if reasoning_parser else None

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if isinstance(service, EngineClient):  # the core's messages are read in this loop
            await service.receive_in_loop()
        yield
        if isinstance(service, EngineClient):
            await service.leave_loop()

    app = FastAPI(
        title="myserve", description="OpenAI-compatible LLM server on JAX", version="0.1.0", lifespan=lifespan
    )
    install_error_handlers(app)
    state = ServerState()
    metrics = Metrics(service)
    fmt = LogprobFormatter(service.tokenizer)
    tokenizer = service.tokenizer
    app.state.server = state
    app.state.metrics = metrics
    model_card = {
        "id": served_model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "myserve",
        "max_model_len": service.max_model_len,
    }

    app.add_middleware(RequestGuard, max_body_bytes=max_body_bytes, api_key=api_key)

    def openapi() -> dict[str, Any]:
        """FastAPI's schema, with the bound of token ids (the vocabulary) once the model has loaded."""
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = FastAPI.openapi(app)
        if not service.ready.is_set():  # a core process's vocabulary is not known yet: ask again later
            app.openapi_schema = None
            return schema
        token_id = {"type": "integer", "minimum": 0, "maximum": service.vocab_size - 1}
        bodies = schema.get("components", {}).get("schemas", {})
        for model, field in TOKEN_ID_FIELDS:
            if field in bodies.get(model, {}).get("properties", {}):
                _bound_integers(bodies[model]["properties"][field], token_id)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]

    def check_ready(model: str | None) -> None:
        if state.draining:
            raise APIError(503, "the server is shutting down", code="server_draining")
        if not service.ready.is_set():
            raise APIError(503, "the model is still loading", code="server_not_ready")
        if model is not None and model != served_model_name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    @app.get("/health")
    @app.get("/healthz")
    async def health() -> Response:
        if service.dead is not None:
            return APIError(503, "the engine has stopped", code="engine_dead").response()
        if not service.ready.is_set() or state.draining:
            return APIError(503, "not ready", code="server_not_ready").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card]}

    # ":path" because served names may contain "/" (e.g. "meta-llama/Llama-3.1-8B-Instruct").
    @app.get("/v1/models/{model:path}")
    async def model_by_id(model: str) -> dict:
        if model != served_model_name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return model_card

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        check_ready(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            ids = render_chat(req.messages, req.add_generation_prompt)
        else:
            ids = tokenizer.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": service.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        check_ready(req.model)
        check_token_ids(req.tokens, "tokens")
        return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}

    def check_token_ids(ids: Iterable[int], param: str) -> None:
        """Token ids a client sent must index the model's vocabulary (its logits' width)."""
        vocab = service.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"{param} token ids must be in [0, {vocab})", param=param, code="invalid_value")

    def render_chat(
        messages: list,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        return tokenizer.encode(
            render_text(messages, add_generation_prompt, tools, template_kwargs), add_special_tokens=False
        )

    def render_text(
        messages: list,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        try:
            # The template writes BOS and friends itself: the text is encoded without adding them.
            return tokenizer.render_chat(
                template_messages(messages),
                add_generation_prompt,
                tools=tools,
                chat_template=chat_template,
                template_kwargs=template_kwargs,
            )
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages") from None

    def sampling(
        req: CompletionRequest | ChatCompletionRequest,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        *,
        grammar: GrammarSpec | None = None,
        grammar_after: tuple[int, ...] = (),
        skip_special_tokens: bool | None = None,
    ) -> SamplingParams:
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=0 if req.top_k is None else req.top_k,
                min_p=req.min_p or 0.0,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                logit_bias=SamplingParams.bias_from_mapping(req.logit_bias),
                seed=req.seed,
                n=req.n,
                stop=stop,
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
                min_tokens=req.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=req.skip_special_tokens if skip_special_tokens is None else skip_special_tokens,
                grammar=grammar,
                grammar_after=grammar_after,
            )
        except InvalidParams as e:
            raise APIError(400, str(e), param=e.param, code="invalid_value") from None
        # logit_bias keys are strings (JSON object keys) until SamplingParams has parsed them.
        check_token_ids((t for t, _ in params.logit_bias), "logit_bias")
        check_token_ids(params.stop_token_ids, "stop_token_ids")
        return params

    def submit_all(
        prompts: list[list[int]], params: SamplingParams, request_id: str, grammar_param: str | None, prompt_param: str
    ) -> list[RequestStream]:
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prompts):
                streams.append(service.submit(ids, params, request_id=f"{request_id}-{i}"))
        except BaseException as e:
            for s in streams:
                s.close()
            if isinstance(e, InvalidParams):
                param = grammar_param if e.param == "grammar" else e.param  # the field that asked for it
                raise APIError(400, str(e), param=param, code="invalid_value") from None
            if isinstance(e, ContextLengthExceeded):
                raise APIError(400, str(e), param=prompt_param, code="context_length_exceeded") from None
            if isinstance(e, Overloaded):
                raise APIError(429, str(e), code="overloaded", headers={"Retry-After": "1"}) from None
            if isinstance(e, EngineDead):
                raise APIError(503, str(e), code="engine_dead") from None
            raise
        return streams

    def deadline() -> float | None:
        """When a request arriving now must be done (event-loop time), or None without a timeout."""
        return None if request_timeout_s is None else asyncio.get_running_loop().time() + request_timeout_s

    def check_supported(req: CompletionRequest | ChatCompletionRequest) -> None:
        refused = req.unsupported()
        if refused is not None:
            raise APIError(400, refused.message, param=refused.field, code="unsupported_parameter")

    async def run(
        request: Request,
        kind: str,
        prompts: list[list[int]],
        params: SamplingParams,
        stream: bool,
        include_usage: bool,
        expires: float | None,
        echo_texts: list[str] | None = None,
        grammar_param: str | None = None,
        choice_parser: Callable[[], ChoiceParser] | None = None,
    ) -> Response:
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        t0 = time.perf_counter()
        prompt_param = "messages" if kind == "chat" else "prompt"  # the field that made the prompt too long
        streams = submit_all(prompts, params, request_id, grammar_param, prompt_param)
        response = CompletionResponse(
            kind=kind,
            request_id=request_id,
            streams=streams,
            prompts=prompts,
            params=params,
            echo_texts=echo_texts,
            model=served_model_name,
            fmt=fmt,
            metrics=metrics,
            state=state,
            t0=t0,
            include_usage=include_usage,
            deadline=expires,
            timeout_s=request_timeout_s,
            choice_parser=choice_parser,
        )
        if not stream:
            return await response.json(request)
        return StreamingResponse(
            response.events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        expires = deadline()
        check_ready(req.model)
        check_supported(req)
        prompts = _completion_prompts(req.prompt, tokenizer.encode)
        if isinstance(req.prompt, list) and not isinstance(req.prompt[0], str):  # the client's token ids,
            check_token_ids((t for p in prompts for t in p), "prompt")  # checked before echo decodes them
        # echo with logprobs scores the prompt; echo with max_tokens 0 returns only the prompt.
        prompt_logprobs = None
        if req.echo and (req.logprobs is not None or req.max_tokens == 0):
            prompt_logprobs = req.logprobs or 0
        grammar = request_grammar(req.response_format, req.structured_outputs)
        params = sampling(req, req.max_tokens, req.logprobs, prompt_logprobs, grammar=grammar)
        echo = [tokenizer.decode(p) for p in prompts] if req.echo else None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await run(
            request, "completion", prompts, params, req.stream, include_usage, expires, echo, _grammar_param(req)
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        expires = deadline()
        check_ready(req.model)
        check_supported(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs", code="invalid_value")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            message = f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}"
            raise APIError(400, message, param="top_logprobs", code="invalid_value")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        grammar = request_grammar(req.response_format, req.structured_outputs)
        plan = plan_tools(req, auto_parser)
        if plan.grammar is not None:
            if grammar is not None:
                raise APIError(
                    400,
                    "a forced tool call (tool_choice required or a named function) cannot be combined with "
                    "response_format or structured_outputs",
                    param="tool_choice",
                    code="invalid_value",
                )
            grammar = plan.grammar
        text = render_text(req.messages, True, plan.template_tools, req.chat_template_kwargs)
        ids = tokenizer.encode(text, add_special_tokens=False)
        state = reasoning.initial_state(text) if reasoning else "content"
        # With a reasoning parser, a grammar constrains only what follows the reasoning block.
        after = tuple(tokenizer.encode(reasoning.end, add_special_tokens=False)) if reasoning else ()
        params = sampling(
            req,
            max_tokens,
            logprobs,
            grammar=grammar,
            grammar_after=after if grammar is not None and state != "content" else (),
            skip_special_tokens=False if plan.keeps_special_tokens else None,
        )
        choice_parser = None
        if reasoning is not None or plan.parser is not None:
            new_tools = plan.parser

            def choice_parser() -> ChoiceParser:
                return ChoiceParser(
                    ReasoningParser(reasoning, state) if reasoning else None,
                    new_tools() if new_tools else None,
                    parallel_tool_calls=req.parallel_tool_calls,
                )

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        param = "tools" if plan.grammar is not None else _grammar_param(req)
        return await run(request, "chat", [ids], params, req.stream, include_usage, expires, None, param, choice_parser)

    return app


TOKEN_ID_FIELDS = (
    ("CompletionRequest", "prompt"),
    ("CompletionRequest", "stop_token_ids"),
    ("ChatCompletionRequest", "stop_token_ids"),
    ("DetokenizeRequest", "tokens"),
)
"""The request fields whose integers are token ids (checked by ``check_token_ids``)."""


def _bound_integers(node: Any, bound: dict[str, Any]) -> None:
    """Every ``{"type": "integer"}`` schema inside ``node`` gets ``bound``'s range."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            node.update(bound)
        for child in node.values():
            _bound_integers(child, bound)
    elif isinstance(node, list):
        for child in node:
            _bound_integers(child, bound)


def _grammar_param(req: CompletionRequest | ChatCompletionRequest) -> str:
    """The request field a grammar came from, for errors about it."""
    return "structured_outputs" if req.structured_outputs is not None else "response_format"


def _completion_prompts(prompt: Any, encode: Any) -> list[list[int]]:
    """OpenAI's four prompt forms as token-id lists."""
    if isinstance(prompt, str):
        return [encode(prompt)]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt", code="invalid_value")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return [encode(p) for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        return [list(p) for p in prompt]
    raise APIError(400, "prompt must be a string, a list of strings, or token ids", param="prompt")
