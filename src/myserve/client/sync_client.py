"""``Client``: the blocking client (threads, scripts, the CLI)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import httpx

from myserve.client.calls import (
    Call,
    Messages,
    SseReader,
    chat_body,
    completion_body,
    embeddings_body,
    error_of,
    update_weights_body,
)
from myserve.client.calls import first_model as _first_model
from myserve.client.retry import RetryPolicy, transport_error
from myserve.client.setup import DEFAULT_URL, http_options
from myserve.client.types import Chunk, Completion, Embeddings


class Client:
    """A blocking client of an OpenAI-compatible server.

    ``base_url`` is the server's root (a trailing ``/v1`` is accepted); ``model`` the default
    model of every call (else the server's first); ``timeout`` seconds for connecting, writing and
    each read (a stream's reads each get it, not the whole stream); ``retry`` when to try again
    (``RetryPolicy``). Use it as a context manager, or ``close()`` it.
    """

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        *,
        api_key: str | None = None,
        model: str | None = None,
        timeout: float = 60.0,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.model = model
        self.retry = retry or RetryPolicy()
        self._http = httpx.Client(**http_options(base_url, api_key, timeout))

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connections."""
        self._http.close()

    def chat(
        self,
        messages: Messages,
        *,
        model: str | None = None,
        system: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        timeout: float | None = None,
        retry_unsafe: bool | None = None,
        **extra: Any,
    ) -> Completion:
        """A chat completion. ``messages``: OpenAI messages, or one user message's text; ``extra``:
        any other request field (``seed``, ``stop``, ``n``, ``tools``, ``response_format``...)."""
        body = chat_body(
            self._model(model), messages, system=system, max_tokens=max_tokens, temperature=temperature,
            stream=False, extra=extra,
        )  # fmt: skip
        return Completion.from_json(self._json(Call("POST", "/v1/chat/completions", body, timeout, retry_unsafe)))

    def chat_stream(
        self,
        messages: Messages,
        *,
        model: str | None = None,
        system: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        timeout: float | None = None,
        retry_unsafe: bool | None = None,
        **extra: Any,
    ) -> Iterator[Chunk]:
        """A chat completion streamed: one ``Chunk`` per event, the last with ``usage``."""
        body = chat_body(
            self._model(model), messages, system=system, max_tokens=max_tokens, temperature=temperature,
            stream=True, extra=extra,
        )  # fmt: skip
        return self._chunks(Call("POST", "/v1/chat/completions", body, timeout, retry_unsafe))

    def complete(
        self,
        prompt: str | Sequence[int],
        *,
        model: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        timeout: float | None = None,
        retry_unsafe: bool | None = None,
        **extra: Any,
    ) -> Completion:
        """A text completion of ``prompt`` (text or token ids)."""
        body = completion_body(
            self._model(model), prompt, max_tokens=max_tokens, temperature=temperature, stream=False, extra=extra
        )
        return Completion.from_json(self._json(Call("POST", "/v1/completions", body, timeout, retry_unsafe)))

    def complete_stream(
        self,
        prompt: str | Sequence[int],
        *,
        model: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        timeout: float | None = None,
        retry_unsafe: bool | None = None,
        **extra: Any,
    ) -> Iterator[Chunk]:
        """A text completion streamed: one ``Chunk`` per event, the last with ``usage``."""
        body = completion_body(
            self._model(model), prompt, max_tokens=max_tokens, temperature=temperature, stream=True, extra=extra
        )
        return self._chunks(Call("POST", "/v1/completions", body, timeout, retry_unsafe))

    def embed(
        self,
        inputs: str | Sequence[str],
        *,
        model: str | None = None,
        timeout: float | None = None,
        retry_unsafe: bool | None = None,
        **extra: Any,
    ) -> Embeddings:
        """Embeddings of ``inputs`` (for a model the server serves embeddings of; else a 400)."""
        body = embeddings_body(self._model(model), inputs, extra)
        return Embeddings.from_json(self._json(Call("POST", "/v1/embeddings", body, timeout, retry_unsafe)))

    def update_weights(
        self, model_path: str, *, version: str | None = None, policy: str = "finish", timeout: float | None = None
    ) -> dict[str, Any]:
        """Serve the weights at ``model_path`` (a checkpoint the server can read) from now on, as
        version ``version``; ``policy`` ``"finish"`` lets running requests end on the old version,
        ``"cut"`` moves them over. Returns once the new version serves: ``{"success", "message",
        "version", "loaded_at", ...}``; a refused update raises ``APIError`` (400), and the old
        version serves on. Needs a server started with ``--enable-weight-updates``."""
        body = update_weights_body(model_path, version, policy)
        return dict(self._json(Call("POST", "/update_weights_from_disk", body, timeout, False)))

    def models(self) -> list[str]:
        """The ids the server serves (aliases included)."""
        return [str(m["id"]) for m in self._json(Call("GET", "/v1/models")).get("data", [])]

    def wait_ready(self, timeout: float = 120.0, *, interval: float = 0.25) -> None:
        """Return once ``/health`` answers 200; while it answers 503 or refuses connections, poll
        every ``interval`` seconds. Raises ``TimeoutError`` after ``timeout`` seconds, and
        ``APIError`` for any other answer (not a myserve server, or a wrong path)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                response = self._http.get("/health", timeout=max(0.1, min(left, 5.0)))
                if response.status_code == 200:
                    return
                if response.status_code != 503:
                    raise error_of(response)
            except httpx.TransportError:
                pass  # not listening yet, or busy: the same as not ready
            if time.monotonic() + interval > deadline:
                raise TimeoutError(f"{self._http.base_url}health was not ready within {timeout} s")
            time.sleep(interval)

    def _model(self, model: str | None) -> str:
        if model is None and self.model is None:
            # Asked once: the default model is the server's first.
            self.model = _first_model(self._json(Call("GET", "/v1/models")))
        return model or self.model or ""

    def _json(self, call: Call) -> Any:
        response = self._open(call, stream=False)
        return response.json()

    def _chunks(self, call: Call) -> Iterator[Chunk]:
        response = self._open(call, stream=True)
        reader = SseReader()
        try:
            for line in response.iter_lines():
                if (event := reader.event(line)) is not None:
                    yield Chunk.from_json(event)
                if reader.done:
                    return
        except httpx.TransportError as e:
            raise transport_error(e) from e
        finally:
            response.close()
        reader.finish()

    def _open(self, call: Call, *, stream: bool) -> httpx.Response:
        """Send ``call`` with its retries; a 2xx answer (its body unread when ``stream``)."""
        timeout = call.timeout if call.timeout is not None else self._http.timeout
        request = self._http.build_request(call.method, call.path, json=call.body, timeout=timeout)
        attempt = 0
        while True:
            try:
                response = self._http.send(request, stream=stream)
            except httpx.TransportError as e:
                error = transport_error(e)
                wait = self.retry.after_error(attempt, error, call.retry_unsafe)
                if wait is None:
                    raise error from e
            else:
                if response.is_success:
                    return response
                response.read()
                response.close()
                api_error = error_of(response)
                wait = self.retry.after_status(attempt, api_error.status, api_error.code, api_error.retry_after)
                if wait is None:
                    raise api_error
            time.sleep(wait)
            attempt += 1
