"""What both clients send and how they read the answers: request bodies, error answers and the
SSE lines of a stream. No I/O here: ``sync_client.py`` and ``async_client.py`` only move bytes."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import httpx

from myserve.client.errors import APIError, TransportError
from myserve.client.retry import retry_after_seconds

Messages = str | Sequence[dict[str, Any]]
"""A chat: a list of OpenAI messages, or one user message's text."""


@dataclasses.dataclass(frozen=True)
class Call:
    """One HTTP request of a client method, before its retries."""

    method: str
    path: str
    body: dict[str, Any] | None = None
    timeout: float | None = None
    """Seconds for each of connecting, writing and each read; None: the client's."""
    retry_unsafe: bool | None = None
    """Per-call override of ``RetryPolicy.retry_unsafe``."""


def update_weights_body(model_path: str, version: str | None, policy: str) -> dict[str, Any]:
    """``POST /update_weights_from_disk``'s body (sglang's, with our version label and policy)."""
    body: dict[str, Any] = {"model_path": model_path, "policy": policy}
    return body if version is None else {**body, "version": version}


def _sampling(max_tokens: int | None, temperature: float | None, extra: dict[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature}
    return {k: v for k, v in fields.items() if v is not None} | extra


def chat_body(
    model: str,
    messages: Messages,
    *,
    system: str | None,
    max_tokens: int | None,
    temperature: float | None,
    stream: bool,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """A ``/v1/chat/completions`` body; ``extra`` adds any other field (``seed``, ``stop``, tools...)."""
    listed = [{"role": "user", "content": messages}] if isinstance(messages, str) else list(messages)
    if system is not None:
        listed.insert(0, {"role": "system", "content": system})
    return {"model": model, "messages": listed, **_stream_fields(stream), **_sampling(max_tokens, temperature, extra)}


def completion_body(
    model: str,
    prompt: str | Sequence[int],
    *,
    max_tokens: int | None,
    temperature: float | None,
    stream: bool,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """A ``/v1/completions`` body (one prompt: text or token ids)."""
    text = prompt if isinstance(prompt, str) else [int(t) for t in prompt]
    return {"model": model, "prompt": text, **_stream_fields(stream), **_sampling(max_tokens, temperature, extra)}


def embeddings_body(model: str, inputs: str | Sequence[str], extra: dict[str, Any]) -> dict[str, Any]:
    """A ``/v1/embeddings`` body asking for floats."""
    listed = [inputs] if isinstance(inputs, str) else list(inputs)
    return {"model": model, "input": listed, "encoding_format": "float", **extra}


def _stream_fields(stream: bool) -> dict[str, Any]:
    # A stream asks for usage: its last event then says how many tokens the answer took.
    return {"stream": True, "stream_options": {"include_usage": True}} if stream else {}


def error_of(response: httpx.Response) -> APIError:
    """An error answer (its body already read) as an ``APIError``."""
    try:
        body: Any = response.json()
    except ValueError:
        body = response.text
    return APIError.from_body(response.status_code, body, retry_after_seconds(response.headers))


def first_model(body: dict[str, Any]) -> str:
    """The first model id of a ``/v1/models`` answer."""
    data = body.get("data") or []
    if not data:
        raise APIError(404, "the server lists no models", code="model_not_found")
    return str(data[0]["id"])


class SseReader:
    """Reads a stream's ``data:`` lines into JSON events until ``data: [DONE]``.

    An error event (OpenAI's envelope, sent when the engine failed or the deadline passed after
    the 200 went out) raises ``APIError``; ``finish`` raises if the stream ended without ``[DONE]``.
    """

    def __init__(self) -> None:
        self.done = False

    def event(self, line: str) -> dict[str, Any] | None:
        """The event on ``line``, or None for other lines (blank, comments, ``[DONE]``)."""
        if not line.startswith("data:"):
            return None
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return None
        payload = json.loads(data)
        if isinstance(payload, dict) and "error" in payload:
            code = (payload["error"] or {}).get("code") if isinstance(payload["error"], dict) else None
            raise APIError.from_body(504 if code == "request_timeout" else 500, payload)
        return payload

    def finish(self) -> None:
        """Raise unless ``[DONE]`` was seen: the answer was cut off."""
        if not self.done:
            raise TransportError("the stream ended before data: [DONE]", sent=True)
