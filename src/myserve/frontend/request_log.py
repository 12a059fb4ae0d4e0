"""The log line of each finished completions or chat request (logger ``myserve.requests``)."""

from __future__ import annotations

import logging
import time

from myserve.wire.outputs import RequestOutput, Usage

logger = logging.getLogger("myserve.requests")


def set_log_levels(level: str, log_requests: bool) -> None:
    """A server process's log levels: ``level`` (``server.log_level``), and the request lines'
    logger quiet unless ``log_requests`` (``--disable-log-requests``)."""
    logging.getLogger().setLevel(level.upper())
    logger.setLevel(logging.NOTSET if log_requests else logging.WARNING)


class RequestLog:
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
            ",".join(self.finish_reasons) or ("abort" if status in ("disconnected", "timeout", "cancelled") else "-"),
        )
