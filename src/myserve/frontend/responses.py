"""One completions or chat response: the engine's outputs collected into JSON or streamed as SSE.

A request becomes one engine stream per prompt (completions accept several); their outputs are
merged as they come and each choice is tagged ``index = prompt_index * n + choice``. Non-streaming
responses watch for the client's disconnect while they wait; streaming ones end when the client
goes away; both end at the request's deadline, if it has one. Either way, closing the streams aborts
whatever has not finished, and the request is counted with the tokens it got.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from myserve.frontend.chat_output import ChoiceMessage, ChoiceParser, finish_reason
from myserve.frontend.errors import APIError
from myserve.frontend.formatting import LogprobFormatter, usage_json
from myserve.frontend.metrics import Metrics
from myserve.frontend.stream import RequestStream
from myserve.wire.outputs import RequestOutput, Usage
from myserve.wire.params import SamplingParams

logger = logging.getLogger("myserve.requests")

SYSTEM_FINGERPRINT = "myserve-0.1.0"

_T = TypeVar("_T")


class ServerState:
    """Mutable server-wide state: draining flag for graceful shutdown, requests in flight."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0


class CompletionResponse:
    """The answer to one submitted completions (``kind="completion"``) or chat request."""

    def __init__(
        self,
        *,
        kind: str,
        request_id: str,
        streams: list[RequestStream],
        prompts: list[list[int]],
        params: SamplingParams,
        echo_texts: list[str] | None,
        model: str,
        fmt: LogprobFormatter,
        metrics: Metrics,
        state: ServerState,
        t0: float,
        include_usage: bool = False,
        deadline: float | None = None,
        timeout_s: float | None = None,
        choice_parser: Callable[[], ChoiceParser] | None = None,
    ):
        self.kind, self.request_id, self.streams, self.prompts = kind, request_id, streams, prompts
        self.params, self.n, self.echo_texts, self.fmt = params, params.n, echo_texts, fmt
        self.metrics, self.state, self.t0 = metrics, state, t0
        self.include_usage = include_usage
        """Streaming: send a usage chunk (empty choices) before ``[DONE]`` (``stream_options.include_usage``)."""
        self.deadline, self.timeout_s = deadline, timeout_s
        """Event-loop time after which the request is aborted (None: never), and the timeout it came from."""
        self._new_parser = choice_parser
        """Chat: makes each choice's reasoning / tool-call parser (None: the text is the content)."""
        self._parsers: dict[int, ChoiceParser] = {}
        self.created = int(time.time())
        self.model = model
        self.log = _RequestLog(request_id, sum(len(p) for p in prompts), t0)
        state.in_flight += 1

    def _envelope(self, obj: str) -> dict[str, Any]:
        """The fields every body and chunk of this response shares."""
        return {
            "id": self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
        }

    def _finished(self, status: str, usage: Usage | None = None) -> None:
        """Close the streams (aborting what still runs), then count and log the request once.

        Without the engine's ``usage`` (the request was cut short: disconnect, timeout, error) it
        counts its prompts and every token the outputs seen so far carried."""
        for s in self.streams:
            s.close()
        usage = usage or self.log.usage()
        self.state.in_flight -= 1
        self.metrics.requests.labels(self.kind, status).inc()
        self.metrics.e2e.observe(time.perf_counter() - self.t0)
        self.metrics.prompt_tokens.inc(usage.prompt_tokens)
        self.metrics.generation_tokens.inc(usage.completion_tokens)
        self.log.done(status, usage)

    def _parser(self, index: int) -> ChoiceParser | None:
        """Choice ``index``'s parser, made when its first output comes."""
        if self._new_parser is None:
            return None
        parser = self._parsers.get(index)
        if parser is None:
            parser = self._parsers[index] = self._new_parser()
        return parser

    def _timeout_error(self) -> APIError:
        return APIError(504, f"the request did not finish within {self.timeout_s:g} s", code="request_timeout")

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
        try:
            outputs = collect.result()
        except TimeoutError:
            self._finished("timeout")
            raise self._timeout_error() from None
        started = time.perf_counter()
        choices: dict[int, dict[str, Any]] = {}
        usages = []
        for i, out in outputs:
            if out.final:
                usages.append(out.usage)
                if out.error:
                    self._finished("error")
                    raise APIError(500, out.error, code="engine_error")
                continue
            index = i * self.n + out.choice
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
        usage = sum_usage(usages)
        body_choices = [self._json_choice(index, choices[index]) for index in sorted(choices)]
        firsts = [c["first"] for c in choices.values() if c["first"] is not None]
        if firsts:
            self.metrics.ttft.observe(min(firsts) - self.t0)
        self._finished("ok", usage)
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        response = JSONResponse({**self._envelope(obj), "choices": body_choices, "usage": usage_json(usage)})
        self.metrics.frontend_seconds.inc(time.perf_counter() - started)
        return response

    async def _collect(self) -> list[tuple[int, RequestOutput]]:
        """Every output of every stream, noted as it comes (a request cut short counts what it got);
        TimeoutError at the deadline."""
        outputs = []
        async for item in until(self.deadline, merged(self.streams)):
            self.log.saw(item[1])
            outputs.append(item)
        return outputs

    def _json_choice(self, index: int, c: dict[str, Any]) -> dict[str, Any]:
        logprobs_on = self.params.logprobs is not None
        if self.kind == "chat":
            parser = self._parsers.get(index)
            message = c["message"].json(parser) if c["message"] else {"role": "assistant", "content": c["text"]}
            return {
                "index": index,
                "message": message,
                "logprobs": self.fmt.chat(c["logprobs"]) if logprobs_on else None,
                "finish_reason": finish_reason(c["finish"], parser),
            }
        prefix = self.echo_texts[index // self.n] if self.echo_texts else ""
        logprobs_json = None
        if logprobs_on:
            items = self.fmt.prompt_items(self.prompts[index // self.n], c["prompt"]) if c["prompt"] else []
            generated = [(e.token_id, e.logprob, e.top) for e in c["logprobs"]]
            logprobs_json = self.fmt.completion_items(items + generated, 0 if items else len(prefix))
        return {"index": index, "text": prefix + c["text"], "logprobs": logprobs_json, "finish_reason": c["finish"]}

    # -- server-sent events -------------------------------------------------------------------
    async def events(self) -> AsyncIterator[bytes]:
        """SSE chunks: chat role deltas (or completion echoes), content deltas with finish reasons,
        an optional usage chunk, ``[DONE]``; an engine error or the deadline sends an error event and
        ends the stream."""
        base = self._envelope("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        usages: list[Usage | None] = []
        last_token_t: float | None = None
        # Until the stream ends otherwise, it ends because the client went away: the server then
        # cancels this generator where it awaits, or closes it where it yields.
        status = "disconnected"
        offsets: dict[int, int] = {}  # completions: text offset of each choice, for logprobs
        try:
            for chunk in self._opening_chunks(offsets):
                yield _sse({**base, "choices": [chunk]})
            outputs = until(self.deadline, merged(self.streams))
            while True:
                try:
                    i, out = await anext(outputs)
                    got = time.perf_counter()  # front-end work on this output starts (metrics)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    status = "timeout"
                    yield _sse(self._timeout_error().body())
                    return
                self.log.saw(out)
                if out.final:
                    usages.append(out.usage)
                    if out.error:
                        status = "error"
                        yield _sse(APIError(500, out.error, code="engine_error").body())
                        return
                    continue
                index = i * self.n + out.choice
                if out.prompt_logprobs is not None and self.echo_texts:
                    yield _sse({**base, "choices": [self._scored_echo(i, index, out, offsets)]})
                if out.token_ids:
                    now = time.perf_counter()
                    if last_token_t is None:
                        self.metrics.ttft.observe(now - self.t0)
                    else:
                        self.metrics.itl.observe(now - last_token_t)
                    last_token_t = now
                choice = self._delta(index, out, offsets)
                if choice.get("delta") or choice.get("text") or out.finish_reason or choice["logprobs"]:
                    event = _sse({**base, "choices": [choice]})
                    self.metrics.frontend_seconds.inc(time.perf_counter() - got)
                    yield event
                else:
                    self.metrics.frontend_seconds.inc(time.perf_counter() - got)
            if self.include_usage:
                yield _sse({**base, "choices": [], "usage": usage_json(sum_usage(usages))})
            status = "ok"
            yield b"data: [DONE]\n\n"
        finally:
            complete = len(usages) == len(self.prompts)
            self._finished(status, sum_usage(usages) if complete and status == "ok" else None)

    def _opening_chunks(self, offsets: dict[int, int]) -> list[dict[str, Any]]:
        """Chat: each choice's ``role`` delta. Completions with echo (no logprobs): each prompt's text."""
        indices = range(len(self.prompts) * self.n)
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""}
            return [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None} for i in indices]
        if self.echo_texts and self.params.logprobs is None:  # with logprobs: sent with the prompt's scores
            for i in indices:
                offsets[i] = len(self.echo_texts[i // self.n])
            return [
                {"index": i, "text": self.echo_texts[i // self.n], "logprobs": None, "finish_reason": None}
                for i in indices
            ]
        return []

    def _scored_echo(self, prompt: int, index: int, out: RequestOutput, offsets: dict[int, int]) -> dict[str, Any]:
        """Completions echo with prompt logprobs: the prompt's text and scores, once per choice."""
        assert self.echo_texts is not None and out.prompt_logprobs is not None
        echo = self.echo_texts[prompt]
        offsets[index] = len(echo)
        items = self.fmt.prompt_items(self.prompts[prompt], out.prompt_logprobs)
        lp_json = self.fmt.completion_items(items) if self.params.logprobs is not None else None
        return {"index": index, "text": echo, "logprobs": lp_json, "finish_reason": None}

    def _delta(self, index: int, out: RequestOutput, offsets: dict[int, int]) -> dict[str, Any]:
        lp = list(out.logprobs or ())
        with_logprobs = self.params.logprobs is not None and bool(lp)
        if self.kind == "chat":
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


def until(deadline: float | None, items: AsyncIterator[_T]) -> AsyncIterator[_T]:
    """``items`` until ``deadline`` (event-loop time; None = no limit), then TimeoutError.

    Only the waits for the next item are timed: a timeout spanning a ``yield`` would cancel whatever
    the consumer awaits there. An expired wait cancels ``items`` where it awaits (``merged`` then
    closes its streams). Without a deadline (the default) ``items`` itself: a timeout scope per
    streamed token is a measurable share of the front end's CPU at 64 streams."""
    return items if deadline is None else _until(deadline, items)


async def _until(deadline: float, items: AsyncIterator[_T]) -> AsyncIterator[_T]:
    while True:
        try:
            async with asyncio.timeout_at(deadline):
                item = await anext(items)
        except StopAsyncIteration:
            return
        yield item


async def merged(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with their prompt index; closes them at the end."""
    if len(streams) == 1:  # the common request: read the stream itself, without a pump task per token
        try:
            async for only in streams[0]:
                yield 0, only
        finally:
            streams[0].close()
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        async for out in stream:
            await queue.put((i, out))
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, out = await queue.get()
            if out is None:
                remaining -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.close()  # aborts whatever has not finished (client gone, or an error)


def sum_usage(usages: Sequence[Usage | None]) -> Usage:
    """The usage of several prompts' requests together."""
    present = [u for u in usages if u is not None]
    return Usage(
        prompt_tokens=sum(u.prompt_tokens for u in present),
        completion_tokens=sum(u.completion_tokens for u in present),
        cached_tokens=sum(u.cached_tokens for u in present),
    )


_encode = msgspec.json.Encoder().encode


_LINE_BREAKS = ((b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"), (b"\xc2\x85", b"\\u0085"))
"""Characters that JSON may leave raw but ``str.splitlines`` (httpx's ``iter_lines``, many SSE
clients) takes for line ends: escaped, or one token's text (a model emits U+2028 now and then) cuts
a ``data:`` line in two for such a client. In UTF-8 these byte runs stand for nothing else."""


def _sse(payload: dict) -> bytes:
    # msgspec: UTF-8 as is (``ensure_ascii=False``), non-finite floats as null (valid JSON, where
    # ``json.dumps`` writes ``-Infinity``), and several times faster per streamed token.
    data = _encode(payload)
    if b"\xe2\x80" in data or b"\xc2\x85" in data:
        for raw, escaped in _LINE_BREAKS:
            data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client goes away (the ASGI server sends http.disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _RequestLog:
    """One structured log line per finished request: id, tokens, TTFT, total time, finish reasons."""

    def __init__(self, request_id: str, prompt_tokens: int, t0: float):
        self.request_id, self.prompt_tokens, self.t0 = request_id, prompt_tokens, t0
        self.first_token: float | None = None
        self.finish_reasons: list[str] = []
        self.completion_tokens = 0
        """Tokens of every choice in the deltas seen so far."""

    def saw(self, out: RequestOutput) -> None:
        """Note a delta: its tokens, the first token's time, and each choice's finish reason."""
        self.completion_tokens += len(out.token_ids)
        if out.token_ids and self.first_token is None:
            self.first_token = time.perf_counter()
        if out.finish_reason:
            self.finish_reasons.append(out.finish_reason)

    def usage(self) -> Usage:
        """The usage of what was seen: for a request cut short, which never gets the engine's."""
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens)

    def done(self, status: str, usage: Usage) -> None:
        """Log the line."""
        ttft = f"{self.first_token - self.t0:.3f}" if self.first_token is not None else "-"
        logger.info(
            "request_id=%s status=%s prompt_tokens=%d completion_tokens=%d ttft_s=%s total_s=%.3f finish=%s",
            self.request_id,
            status,
            self.prompt_tokens,
            usage.completion_tokens,
            ttft,
            time.perf_counter() - self.t0,
            ",".join(self.finish_reasons) or ("abort" if status in ("disconnected", "timeout") else "-"),
        )
