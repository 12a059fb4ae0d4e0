"""When to try a request again, and after how long: shared by ``Client`` and ``AsyncClient``.

Safe to repeat, because the server refused the request before it reached the engine: 429 (the
waiting queue is full; ``Retry-After`` says when to come back), 503 (loading or draining; not
``engine_dead``, which no wait cures), and a connection that never opened (connect errors and
timeouts, a full connection pool). Not safe: a read timeout or a connection dropped after the
request went out, since the engine may be generating it (and another try would generate it
twice); those are retried only with ``retry_unsafe``.
"""

from __future__ import annotations

import dataclasses
import email.utils
import time

import httpx

from myserve.client.errors import TransportError

# Errors raised before a byte of the request left: the server cannot have seen it.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.UnsupportedProtocol)


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How many times, and how long to wait, before giving up on a request."""

    max_retries: int = 2
    """Tries after the first; 0 never retries."""
    max_wait_s: float = 30.0
    """The longest single wait: a larger ``Retry-After`` is cut to this."""
    backoff_s: float = 0.5
    """Without ``Retry-After``, the wait is ``backoff_s * 2**attempt`` (capped by ``max_wait_s``)."""
    retry_unsafe: bool = False
    """Also retry failures after the request was sent (read timeouts, dropped connections)."""

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.max_wait_s < 0 or self.backoff_s < 0:
            raise ValueError(f"a RetryPolicy takes non-negative numbers, not {self}")

    def _backoff(self, attempt: int) -> float:
        return min(self.backoff_s * 2**attempt, self.max_wait_s)

    def after_status(self, attempt: int, status: int, code: str | None, retry_after: float | None) -> float | None:
        """Seconds to wait before another try after an error answer, or None to give up.
        ``attempt`` counts the tries made so far minus one (0 after the first)."""
        if attempt >= self.max_retries:
            return None
        if status == 429 or (status == 503 and code != "engine_dead"):
            return min(retry_after, self.max_wait_s) if retry_after is not None else self._backoff(attempt)
        return None

    def after_error(self, attempt: int, error: TransportError, retry_unsafe: bool | None = None) -> float | None:
        """Seconds to wait before another try after ``error``, or None to give up. ``retry_unsafe``
        (when not None) overrides the policy's for one call."""
        unsafe_ok = self.retry_unsafe if retry_unsafe is None else retry_unsafe
        if attempt >= self.max_retries or (error.sent and not unsafe_ok):
            return None
        return self._backoff(attempt)


def transport_error(error: httpx.TransportError) -> TransportError:
    """httpx's error as ours, with whether the request may have been sent."""
    sent = not isinstance(error, _NOT_SENT)
    return TransportError(f"{type(error).__name__}: {error}", sent=sent)


def retry_after_seconds(headers: httpx.Headers) -> float | None:
    """``Retry-After`` as seconds: delta-seconds or an HTTP date; None when absent or unreadable."""
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())
