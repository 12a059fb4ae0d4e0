"""One completions or chat response: the engine's outputs collected into JSON or streamed as SSE.

A request becomes one engine stream per prompt (completions accept several); their outputs are
merged as they come and each choice is tagged ``index = prompt_index * n + choice``. Non-streaming
responses watch for the client's disconnect while they wait; streaming ones end when the client
goes away; both end at the request's deadline, if it has one. Either way, closing the streams aborts
whatever has not finished, and the request is counted with the tokens it got.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from myserve.frontend.app_context import AppContext
from myserve.frontend.chat_output import ChoiceMessage, ChoiceParser, finish_reason
from myserve.frontend.errors import APIError
from myserve.frontend.formatting import TokenIdFormatter, usage_json
from myserve.frontend.output_streams import merged, sum_usage, until
from myserve.frontend.request_log import RequestLog
from myserve.frontend.sse import sse_event
from myserve.frontend.stream import RequestStream
from myserve.wire.images import ImageInput
from myserve.wire.outputs import RequestOutput, Usage
from myserve.wire.params import SamplingParams

if TYPE_CHECKING:
    from myserve.frontend.tracing import RequestSpan

SYSTEM_FINGERPRINT = "myserve-0.1.0"
WEIGHTS_HEADER = "X-Weights-Version"
"""The response header naming the version(s) of the weights that produced its tokens."""


def fingerprint(versions: list[str]) -> str:
    """``system_fingerprint``: the server's, with the version(s) of the weights behind the tokens
    (several, in order, when a live update cut the request over to a new one)."""
    return SYSTEM_FINGERPRINT if not versions else f"{SYSTEM_FINGERPRINT}+weights-{'+'.join(versions)}"


_ID_PREFIXES = {
    "chat": "chatcmpl-",
    "completion": "cmpl-",
    "embedding": "embd-",
    "score": "score-",
    "rerank": "rerank-",
}
"""The response id's prefix by ``ResponseContext.kind`` (``resp_`` for the Responses API)."""


@dataclasses.dataclass(frozen=True)
class ResponseContext:
    """What one completions or chat response is about, built once by its route."""

    kind: str
    """``"completion"``, ``"chat"``, ``"responses"`` (a chat answered by the Responses API, whose
    shapes are ``responses_api_output.py``'s), ``"embedding"`` (``embedding_output.py``) or ``"score"``
    and ``"rerank"`` (``score_output.py``): the
    shape of the body and chunks, and the id's prefix."""
    model: str
    """The served model name the response reports."""
    prompts: list[list[int]]
    """Token ids of each prompt (chat: one); each becomes one engine request."""
    params: SamplingParams
    echo_texts: list[str] | None = None
    """Completions with ``echo``: each prompt's text, put before its choices' text."""
    include_usage: bool = False
    """Streaming: send a usage chunk (empty choices) before ``[DONE]`` (``stream_options.include_usage``)."""
    deadline: float | None = None
    """Event-loop time after which the request is aborted (None: never)."""
    choice_parser: Callable[[], ChoiceParser] | None = None
    """Chat: makes each choice's reasoning / tool-call parser (None: the text is the content)."""
    chat_echo: str = ""
    """Chat with ``echo``: the final message's content, put before each choice's content."""
    prompt_logprobs: int | None = None
    """vLLM's ``prompt_logprobs`` field: top logprobs per prompt token in the body (None: not asked)."""
    token_ids_as_text: bool = False
    """Logprobs name tokens ``token_id:<id>`` (``return_tokens_as_token_ids``)."""
    images: tuple[ImageInput, ...] = ()
    """Chat with images: the one prompt's images, its placeholders already expanded."""
    request_id: str = dataclasses.field(init=False)
    """``chatcmpl-…``, ``cmpl-…`` or ``resp_…``; the engine requests are ``<request_id>-<prompt index>``."""
    created: int = dataclasses.field(init=False, default_factory=lambda: int(time.time()))
    t0: float = dataclasses.field(init=False, default_factory=time.perf_counter)
    """When the route built this (``perf_counter``): latencies are measured from it."""

    def __post_init__(self) -> None:
        prefix = _ID_PREFIXES.get(self.kind, "resp_")
        object.__setattr__(self, "request_id", f"{prefix}{uuid.uuid4().hex}")

    @property
    def n(self) -> int:
        """Choices per prompt."""
        return self.params.n


class CompletionResponse:
    """The answer to one submitted completions (``kind="completion"``) or chat request."""

    def __init__(self, ctx: ResponseContext, streams: list[RequestStream], server: AppContext):
        self.ctx, self.streams, self.server = ctx, streams, server
        self.fmt = TokenIdFormatter(server.tokenizer) if ctx.token_ids_as_text else server.fmt
        """Logprobs' shapes (the server's, cached per token; or tokens as ids, for this response)."""
        self._parsers: dict[int, ChoiceParser] = {}
        """Each choice's parser (chat with a reasoning or tool-call parser), made at its first output."""
        self.log = RequestLog(ctx.request_id, sum(len(p) for p in ctx.prompts), ctx.t0)
        self._offsets: dict[int, int] = {}
        """Streamed completions: the text offset of each choice, for logprobs."""
        self.span: RequestSpan | None = None
        """The request's trace span, which ``respond`` starts when the server traces."""
        self.weights: list[str] = []
        """The versions of the weights that produced the outputs seen so far, in order."""
        self._chunk_base = self._envelope("chat.completion.chunk" if ctx.kind == "chat" else "text_completion")
        """The fields every streamed chunk shares (its fingerprint names the weights of the latest output)."""
        server.state.in_flight += 1

    def _envelope(self, obj: str) -> dict[str, Any]:
        """The fields every body and chunk of this response shares."""
        return {
            "id": self.ctx.request_id,
            "object": obj,
            "created": self.ctx.created,
            "model": self.ctx.model,
            "system_fingerprint": fingerprint(self.weights),
        }

    def _saw(self, out: RequestOutput) -> None:
        """Note an output: the request log's counts, and the version of the weights behind it."""
        self.log.saw(out)
        version = out.weights_version
        if version is not None and version not in self.weights:
            self.weights.append(version)
            self._chunk_base["system_fingerprint"] = fingerprint(self.weights[-1:])

    def _finished(self, status: str, usage: Usage | None = None) -> None:
        """Close the streams (aborting what still runs), then count and log the request once.

        Without the engine's ``usage`` (the request was cut short: disconnect, timeout, error) it
        counts its prompts and every token the outputs seen so far carried."""
        for s in self.streams:
            s.close()
        usage = usage or self.log.usage()
        self.server.state.in_flight -= 1
        self.server.metrics.requests.labels(self.ctx.kind, status).inc()
        # vLLM counts each engine request (a choice of a prompt) by why it finished; a choice cut
        # short has no reason of its own: the request was aborted (client gone, deadline) or failed.
        reasons = self.log.finish_reasons
        unfinished = len(self.ctx.prompts) * self.ctx.n - len(reasons)
        for reason in [*reasons, *["error" if status == "error" else "abort"] * unfinished]:
            self.server.metrics.success.labels(reason).inc()
        self.server.metrics.e2e.observe(time.perf_counter() - self.ctx.t0)
        self.server.metrics.prompt_tokens.inc(usage.prompt_tokens)
        self.server.metrics.generation_tokens.inc(usage.completion_tokens)
        self.log.done(status, usage)
        if self.span is not None:
            self.span.end(status, usage, self.log)

    def _parser(self, index: int) -> ChoiceParser | None:
        """Choice ``index``'s parser, made when its first output comes."""
        if self.ctx.choice_parser is None:
            return None
        parser = self._parsers.get(index)
        if parser is None:
            parser = self._parsers[index] = self.ctx.choice_parser()
        return parser

    def _timeout_error(self) -> APIError:
        message = f"the request did not finish within {self.server.request_timeout_s:g} s"
        return APIError(504, message, code="request_timeout")

    # -- one JSON body ------------------------------------------------------------------------
    async def json(self, request: Request) -> Response:
        """Wait for every choice (or the client's disconnect: 499; or the deadline: 504); the JSON body."""
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        collect = asyncio.ensure_future(self._collect())
        disconnected = False
        try:
            await asyncio.wait({watcher, collect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not collect.done():  # the client went away (or the server is cancelling this handler)
                disconnected = True
                collect.cancel()
                self._finished("disconnected")
        if disconnected:
            return Response(status_code=499)
        started = time.perf_counter()
        body = self._final_body(collect)
        response = JSONResponse(body, headers={WEIGHTS_HEADER: ",".join(self.weights)} if self.weights else None)
        self.server.metrics.frontend_seconds.inc(time.perf_counter() - started)
        return response

    def _final_body(self, collect: asyncio.Future[list[tuple[int, RequestOutput]]]) -> dict[str, Any]:
        """The JSON body once ``collect`` (``_collect``) is done, the request counted: 504 if it met
        the deadline, 500 for an engine error."""
        try:
            outputs = collect.result()
        except TimeoutError:
            self._finished("timeout")
            raise self._timeout_error() from None
        error = next((out.error for _, out in outputs if out.final and out.error), None)
        if error:
            self._finished("error")
            raise APIError(500, error, code="engine_error")
        usage = sum_usage([out.usage for _, out in outputs if out.final])
        body = self._body(outputs, usage)
        self._finished("ok", usage)
        return body

    def _body(self, outputs: list[tuple[int, RequestOutput]], usage: Usage) -> dict[str, Any]:
        """The JSON body of every output (engine errors already answered)."""
        choices: dict[int, dict[str, Any]] = {}
        for i, out in outputs:
            if out.final:
                continue
            index = i * self.ctx.n + out.choice
            c = choices.setdefault(
                index, {"text": "", "logprobs": [], "finish": None, "first": None, "prompt": None, "message": None}
            )
            if out.prompt_logprobs is not None:
                c["prompt"] = out.prompt_logprobs
            if c["first"] is None and out.token_ids:
                c["first"] = time.perf_counter()
            c["text"] += out.text
            parser = self._parser(index)
            if parser is not None:
                c["message"] = c["message"] or ChoiceMessage()
                c["message"].add(parser.feed(out.text, final=out.finish_reason is not None))
            c["logprobs"].extend(out.logprobs or ())
            c["finish"] = out.finish_reason or c["finish"]
        body_choices = [self._json_choice(index, choices[index]) for index in sorted(choices)]
        firsts = [c["first"] for c in choices.values() if c["first"] is not None]
        if firsts:
            self.server.metrics.ttft.observe(min(firsts) - self.ctx.t0)
        obj = "chat.completion" if self.ctx.kind == "chat" else "text_completion"
        body = {**self._envelope(obj), "choices": body_choices, "usage": usage_json(usage)}
        if self.ctx.kind == "chat" and self.ctx.prompt_logprobs is not None:  # vLLM's: one prompt, in the body
            body["prompt_logprobs"] = self._prompt_logprobs(0, next((c["prompt"] for c in choices.values()), None))
        return body

    def _prompt_logprobs(self, prompt: int, scores: Any) -> list | None:
        """vLLM's ``prompt_logprobs`` of prompt ``prompt`` (None if the engine sent none)."""
        assert self.ctx.prompt_logprobs is not None
        if scores is None:
            return None
        return self.fmt.prompt_logprobs(self.ctx.prompts[prompt], scores, self.ctx.prompt_logprobs)

    async def _collect(self) -> list[tuple[int, RequestOutput]]:
        """Every output of every stream, noted as it comes (a request cut short counts what it got);
        TimeoutError at the deadline."""
        outputs = []
        async for item in until(self.ctx.deadline, merged(self.streams)):
            self._saw(item[1])
            outputs.append(item)
        return outputs

    def _json_choice(self, index: int, c: dict[str, Any]) -> dict[str, Any]:
        logprobs_on = self.ctx.params.logprobs is not None
        if self.ctx.kind == "chat":
            parser = self._parsers.get(index)
            message = c["message"].json(parser) if c["message"] else {"role": "assistant", "content": c["text"]}
            if self.ctx.chat_echo and message.get("content") is not None:
                message["content"] = self.ctx.chat_echo + message["content"]
            return {
                "index": index,
                "message": message,
                "logprobs": self.fmt.chat(c["logprobs"]) if logprobs_on else None,
                "finish_reason": finish_reason(c["finish"], parser),
            }
        prefix = self.ctx.echo_texts[index // self.ctx.n] if self.ctx.echo_texts else ""
        logprobs_json = None
        if logprobs_on:
            prompt = self.ctx.prompts[index // self.ctx.n]
            items = self.fmt.prompt_items(prompt, c["prompt"], self.ctx.params.logprobs) if c["prompt"] else []
            generated = [(e.token_id, e.logprob, e.top) for e in c["logprobs"]]
            logprobs_json = self.fmt.completion_items(items + generated, 0 if items else len(prefix))
        choice = {"index": index, "text": prefix + c["text"], "logprobs": logprobs_json, "finish_reason": c["finish"]}
        if self.ctx.prompt_logprobs is not None:  # vLLM's, on each choice
            choice["prompt_logprobs"] = self._prompt_logprobs(index // self.ctx.n, c["prompt"])
        return choice

    # -- server-sent events -------------------------------------------------------------------
    async def events(self) -> AsyncIterator[bytes]:
        """SSE events: ``_opening_events``, each output's ``_output_events``, ``_closing_events``; an
        engine error or the deadline sends ``_error_event`` and ends the stream."""
        usages: list[Usage | None] = []
        last_token_t: float | None = None
        # Until the stream ends otherwise, it ends because the client went away: the server then
        # cancels this generator where it awaits, or closes it where it yields.
        status = "disconnected"
        try:
            for event in self._opening_events():
                yield event
            outputs = until(self.ctx.deadline, merged(self.streams))
            while True:
                try:
                    i, out = await anext(outputs)
                    got = time.perf_counter()  # front-end work on this output starts (metrics)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    status = "timeout"
                    yield self._error_event(self._timeout_error())
                    return
                self._saw(out)
                if out.final:
                    usages.append(out.usage)
                    if out.error:
                        status = "error"
                        yield self._error_event(APIError(500, out.error, code="engine_error"))
                        return
                    continue
                if out.token_ids:
                    now = time.perf_counter()
                    if last_token_t is None:
                        self.server.metrics.ttft.observe(now - self.ctx.t0)
                    else:
                        self.server.metrics.itl.observe(now - last_token_t)
                    last_token_t = now
                events = self._output_events(i, out)
                self.server.metrics.frontend_seconds.inc(time.perf_counter() - got)
                for event in events:
                    yield event
            closing = self._closing_events(sum_usage(usages))
            for event in closing[:-1]:
                yield event
            status = "ok"  # (a client gone while the last event is sent was answered in full)
            yield closing[-1]
        finally:
            complete = len(usages) == len(self.ctx.prompts)
            self._finished(status, sum_usage(usages) if complete and status == "ok" else None)

    def _chunk(self, choices: list[dict[str, Any]]) -> bytes:
        """One chat or completions chunk."""
        return sse_event({**self._chunk_base, "choices": choices})

    def _opening_events(self) -> list[bytes]:
        """Events sent before any output."""
        return [self._chunk([chunk]) for chunk in self._opening_chunks(self._offsets)]

    def _output_events(self, prompt: int, out: RequestOutput) -> list[bytes]:
        """The chunks of one output of prompt ``prompt``."""
        index = prompt * self.ctx.n + out.choice
        events = []
        if out.prompt_logprobs is not None and self.ctx.echo_texts and self.ctx.kind == "completion":
            events.append(self._chunk([self._scored_echo(prompt, index, out, self._offsets)]))
        choice = self._delta(index, out, self._offsets)
        if choice.get("delta") or choice.get("text") or out.finish_reason or choice["logprobs"]:
            events.append(self._chunk([choice]))
        return events

    def _closing_events(self, usage: Usage) -> list[bytes]:
        """The optional usage chunk (empty choices), then ``[DONE]`` (at least one event)."""
        events = []
        if self.ctx.include_usage:
            events.append(sse_event({**self._chunk_base, "choices": [], "usage": usage_json(usage)}))
        return [*events, b"data: [DONE]\n\n"]

    def _error_event(self, error: APIError) -> bytes:
        """The event that ends a stream with an error (OpenAI's error envelope)."""
        return sse_event(error.body())

    def _opening_chunks(self, offsets: dict[int, int]) -> list[dict[str, Any]]:
        """Chat: each choice's ``role`` delta. Completions with echo (no logprobs): each prompt's text."""
        indices = range(len(self.ctx.prompts) * self.ctx.n)
        if self.ctx.kind == "chat":
            delta = {"role": "assistant", "content": self.ctx.chat_echo}
            return [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None} for i in indices]
        if self.ctx.echo_texts and self.ctx.params.logprobs is None:  # with logprobs: sent with the prompt's scores
            for i in indices:
                offsets[i] = len(self.ctx.echo_texts[i // self.ctx.n])
            return [
                {"index": i, "text": self.ctx.echo_texts[i // self.ctx.n], "logprobs": None, "finish_reason": None}
                for i in indices
            ]
        return []

    def _scored_echo(self, prompt: int, index: int, out: RequestOutput, offsets: dict[int, int]) -> dict[str, Any]:
        """Completions echo with prompt logprobs: the prompt's text and scores, once per choice."""
        assert self.ctx.echo_texts is not None and out.prompt_logprobs is not None
        echo = self.ctx.echo_texts[prompt]
        offsets[index] = len(echo)
        items = self.fmt.prompt_items(self.ctx.prompts[prompt], out.prompt_logprobs, self.ctx.params.logprobs)
        lp_json = self.fmt.completion_items(items) if self.ctx.params.logprobs is not None else None
        return {"index": index, "text": echo, "logprobs": lp_json, "finish_reason": None}

    def _delta(self, index: int, out: RequestOutput, offsets: dict[int, int]) -> dict[str, Any]:
        lp = list(out.logprobs or ())
        with_logprobs = self.ctx.params.logprobs is not None and bool(lp)
        if self.ctx.kind == "chat":
            parser = self._parser(index)
            if parser is None:
                delta = {"content": out.text} if out.text else {}
            else:
                delta = parser.feed(out.text, final=out.finish_reason is not None).json()
            return {
                "index": index,
                "delta": delta,
                "logprobs": self.fmt.chat(lp) if with_logprobs else None,
                "finish_reason": finish_reason(out.finish_reason, parser),
            }
        start = offsets.get(index, 0)
        offsets[index] = start + len(out.text)
        return {
            "index": index,
            "text": out.text,
            "logprobs": self.fmt.completion(lp, start) if with_logprobs else None,
            "finish_reason": out.finish_reason,
        }


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client goes away (the ASGI server sends http.disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
