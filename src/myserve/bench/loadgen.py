"""The async load generator: streamed OpenAI requests, timed per chunk, at a bounded concurrency.

Every request streams (``stream: true`` with ``stream_options.include_usage``), so one parser
serves both our server and peers such as vLLM or llama.cpp's ``llama-server``. Timing follows
vLLM's ``benchmark_serving``: TTFT is the time to the first chunk carrying generated text, and one
inter-token latency is recorded per such chunk after it (a chunk may hold several tokens).

httpx is imported lazily: it comes with the ``bench`` extra, not with the server.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

# The text a chunk may carry; reasoning models stream their thinking first, and it is output too.
_CHAT_TEXT_KEYS = ("content", "reasoning_content", "reasoning")


def import_httpx() -> Any:
    """httpx, or a one-line explanation of how to install it."""
    try:
        import httpx
    except ImportError as e:
        raise ImportError('the load generator needs httpx: pip install -e ".[bench]" (or pip install httpx)') from e
    return httpx


@dataclass(frozen=True)
class RequestRecord:
    """What one request did, with times from ``time.perf_counter`` (seconds).

    ``error`` is None for a success, else its kind: ``http_<status>``, ``timeout``, ``connection``,
    ``stream_error`` (an error event in the stream), ``incomplete_stream`` (it ended before
    ``[DONE]`` or a finish reason), ``bad_chunk`` (not JSON) or ``bad_response``. ``usage_reported`` is False when
    the server sent no usage; ``output_tokens`` then counts content chunks instead (a lower bound).
    """

    start: float
    end: float
    error: str | None = None
    error_detail: str = ""
    ttft_s: float | None = None
    itl_s: tuple[float, ...] = ()
    prompt_tokens: int | None = None
    output_tokens: int = 0
    usage_reported: bool = False
    content_chunks: int = 0

    @property
    def ok(self) -> bool:
        """The request completed."""
        return self.error is None

    @property
    def e2e_s(self) -> float:
        """End-to-end latency: send to the end of the stream."""
        return self.end - self.start


class StreamError(Exception):
    """The stream itself reported or showed a failure; ``kind`` names it."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


@dataclass
class StreamParser:
    """Consumes the SSE lines of one streamed completion (``n`` = 1) and times its text chunks.

    ``feed`` takes each line with the time it arrived; ``finish`` turns what was seen into a record.
    """

    start: float
    done: bool = False
    finished: bool = False  # a finish_reason arrived: complete even if [DONE] never does
    first_text: float | None = None
    last_text: float | None = None
    itl: list[float] = field(default_factory=list)
    chunks: int = 0
    usage: dict[str, Any] | None = None

    def feed(self, line: str, now: float) -> None:
        """One line of the event stream; raises ``StreamError`` on an error event or a bad chunk."""
        # SSE: "data:" with an optional space; comments (":"), "event:", "id:" and blanks carry no data.
        if not line.startswith("data:"):
            return
        data = line[5:].removeprefix(" ").strip()
        if data == "[DONE]":
            self.done = True
            return
        try:
            payload = json.loads(data)
        except json.JSONDecodeError as e:
            raise StreamError("bad_chunk", f"not JSON: {data[:200]}") from e
        if not isinstance(payload, dict):
            raise StreamError("bad_chunk", f"not an object: {data[:200]}")
        if "error" in payload:
            error = payload["error"]
            message = error.get("message", error) if isinstance(error, dict) else error
            raise StreamError("stream_error", str(message)[:500])
        if isinstance(payload.get("usage"), dict):
            self.usage = payload["usage"]  # the last one wins (some servers repeat it per chunk)
        for choice in payload.get("choices") or ():
            if _chunk_text(choice):
                self._text_at(now)
            if choice.get("finish_reason"):
                self.finished = True

    def _text_at(self, now: float) -> None:
        self.chunks += 1
        if self.first_text is None:
            self.first_text = now
        else:
            assert self.last_text is not None
            self.itl.append(now - self.last_text)
        self.last_text = now

    def finish(self, now: float) -> RequestRecord:
        """The record of a stream that ended at ``now``."""
        if not (self.done or self.finished):
            return self.failed(now, "incomplete_stream", "the stream ended before [DONE] or a finish_reason")
        usage = self.usage or {}
        prompt_tokens, output_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
        return RequestRecord(
            start=self.start,
            end=now,
            ttft_s=None if self.first_text is None else self.first_text - self.start,
            itl_s=tuple(self.itl),
            prompt_tokens=prompt_tokens if isinstance(prompt_tokens, int) else None,
            output_tokens=output_tokens if isinstance(output_tokens, int) else self.chunks,
            usage_reported=isinstance(output_tokens, int),
            content_chunks=self.chunks,
        )

    def failed(self, now: float, kind: str, detail: str) -> RequestRecord:
        """The record of this request failing with ``kind`` at ``now``."""
        return RequestRecord(
            start=self.start, end=now, error=kind, error_detail=detail[:500], content_chunks=self.chunks
        )


def _chunk_text(choice: dict[str, Any]) -> str:
    """The generated text a streamed choice carries: chat ``delta`` fields, or completion ``text``."""
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return "".join(v for k in _CHAT_TEXT_KEYS if isinstance(v := delta.get(k), str))
    text = choice.get("text")
    return text if isinstance(text, str) else ""


@dataclass(frozen=True)
class Target:
    """Where and how to send requests: the endpoint URL, headers, and the per-request time limit."""

    url: str
    headers: dict[str, str]
    timeout_s: float


async def send_request(client: httpx.AsyncClient, target: Target, body: dict[str, Any]) -> RequestRecord:
    """POST one streaming request and time it; never raises for a failed request (it is recorded)."""
    httpx = import_httpx()
    parser = StreamParser(start=time.perf_counter())
    try:
        async with asyncio.timeout(target.timeout_s):  # the whole request, not just each read
            async with client.stream("POST", target.url, json=body, headers=target.headers) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode("utf-8", "replace")
                    return parser.failed(time.perf_counter(), f"http_{response.status_code}", text)
                async for line in response.aiter_lines():
                    parser.feed(line, time.perf_counter())
                    if parser.done:
                        break
    except TimeoutError:
        return parser.failed(time.perf_counter(), "timeout", f"no complete answer within {target.timeout_s:g}s")
    except httpx.TimeoutException as e:
        return parser.failed(time.perf_counter(), "timeout", repr(e))
    except httpx.TransportError as e:
        return parser.failed(time.perf_counter(), "connection", repr(e))
    except httpx.HTTPError as e:  # e.g. an undecodable body: the server answered, but not usably
        return parser.failed(time.perf_counter(), "bad_response", repr(e))
    except StreamError as e:
        return parser.failed(time.perf_counter(), e.kind, str(e))
    return parser.finish(time.perf_counter())


@dataclass(frozen=True)
class LevelRun:
    """The records of one concurrency level, in submission order."""

    concurrency: int
    records: list[RequestRecord]

    @property
    def wall_s(self) -> float:
        """First send to last finish (0 with no records)."""
        if not self.records:
            return 0.0
        return max(r.end for r in self.records) - min(r.start for r in self.records)


async def run_level(
    client: httpx.AsyncClient,
    target: Target,
    bodies: Sequence[dict[str, Any]],
    concurrency: int,
    request_rate: float = math.inf,
    rng: random.Random | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> LevelRun:
    """Send ``bodies`` with at most ``concurrency`` in flight.

    With a finite ``request_rate`` arrivals are a Poisson process (exponential gaps); a request
    that arrives while ``concurrency`` are in flight waits for a slot, as a real client would.
    """
    rng = rng or random.Random(0)
    slots = asyncio.Semaphore(concurrency)

    async def one(body: dict[str, Any]) -> RequestRecord:
        async with slots:
            record = await send_request(client, target, body)
        if on_done is not None:
            on_done(record)
        return record

    tasks = []
    for i, body in enumerate(bodies):
        if i and math.isfinite(request_rate):
            await asyncio.sleep(rng.expovariate(request_rate))
        tasks.append(asyncio.create_task(one(body)))
    return LevelRun(concurrency, list(await asyncio.gather(*tasks)))


def make_client(max_connections: int, timeout_s: float) -> httpx.AsyncClient:
    """An async HTTP client with a connection pool large enough for ``max_connections`` streams."""
    httpx = import_httpx()
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 30.0)),
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
    )


def first_model_id(base_url: str, headers: dict[str, str], timeout_s: float = 30.0) -> str:
    """The first model id that ``GET /v1/models`` lists."""
    httpx = import_httpx()
    url = f"{base_url}/v1/models"
    try:
        response = httpx.get(url, headers=headers, timeout=timeout_s)
        response.raise_for_status()
        data = response.json().get("data") or []
        return str(data[0]["id"])
    except (httpx.HTTPError, ValueError, LookupError, AttributeError) as e:
        raise RuntimeError(f"cannot take a model id from {url} ({e!r}); pass --model") from e
