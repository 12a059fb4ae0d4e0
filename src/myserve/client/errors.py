"""What a client call raises: the server's OpenAI error envelope, or a transport failure."""

from __future__ import annotations

from typing import Any


class ClientError(Exception):
    """Every error a ``Client`` or ``AsyncClient`` call raises."""


class APIError(ClientError):
    """The server answered with an error: its status and OpenAI's ``{"error": {...}}`` fields.

    ``status`` is the HTTP status; for an error event that ended a stream (the status was already
    200) it is 500 unless the event's ``code`` says otherwise (``request_timeout``: 504).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        code: str | None = None,
        param: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(f"{status} {code or type or 'error'}: {message}")
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.retry_after = retry_after

    @classmethod
    def from_body(cls, status: int, body: Any, retry_after: float | None = None) -> APIError:
        """From a response body: the envelope when it is one, else the body's text as the message."""
        error = body.get("error") if isinstance(body, dict) else None
        if not isinstance(error, dict):
            return cls(status, str(body)[:500], retry_after=retry_after)
        return cls(
            status,
            str(error.get("message", "")),
            type=error.get("type"),
            code=error.get("code"),
            param=error.get("param"),
            retry_after=retry_after,
        )


class TransportError(ClientError):
    """No answer came: the connection failed, dropped, or timed out.

    ``sent`` says whether the request may have reached the server (a read timeout, a connection
    dropped after the request went out): such a request may be running in the engine, so it is
    retried only when the caller allows unsafe retries.
    """

    def __init__(self, message: str, *, sent: bool) -> None:
        super().__init__(message)
        self.sent = sent
