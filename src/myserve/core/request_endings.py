"""How a request's choices end (finished, aborted, failed) and the request closes: the one path
that releases what a choice holds. A mixin of ``EngineCore`` (which owns ``_requests`` and
``_emit``), kept apart so the loop's module stays about the loop."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from myserve.wire.outputs import RequestOutput, Usage

if TYPE_CHECKING:
    from myserve.core.replica import Request
    from myserve.core.sequence import Sequence as Seq

logger = logging.getLogger(__name__)


class RequestEndings:
    """``_finish_seq``, ``_close``, ``_finish_request`` and ``_fail`` of ``EngineCore``."""

    _requests: dict[str, Request]
    _emit: Callable[[RequestOutput], None]
    """EngineCore's: queue an output for the iteration's sink."""

    def _finish_seq(self, req: Request, seq: Seq, reason: str) -> None:
        """End one choice (any reason: stop, length, abort, error): the one path that releases what
        it holds (pages, penalty slot, grammar state) and closes the request after its last choice."""
        seq.finish_reason = reason
        seq.matcher = seq.pending_matcher = seq.token_filter = None  # its mask state goes with its pages
        try:
            req.replica.scheduler.finish(seq)
        except Exception:
            if reason != "error":
                raise
            # Ending on an engine error: the bookkeeping may be what broke; the client hears anyway.
            logger.debug("could not release %r after the engine error", seq, exc_info=True)
        req.unfinished -= 1
        if req.unfinished == 0:
            self._close(req)

    def _close(self, req: Request) -> None:
        self._requests.pop(req.request_id, None)
        usage = Usage(
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=sum(len(s.output_ids) for s in req.seqs),
            cached_tokens=max((s.num_prefix_hit_tokens for s in req.seqs), default=0),
        )
        self._emit(RequestOutput(req.request_id, -1, usage=usage, error=req.error))

    def _finish_request(self, req: Request, reason: str, choice: int | None = None) -> None:
        """Abort every unfinished choice of ``req`` (or just ``choice``; pages freed now); the
        request is closed once none is left."""
        for seq in req.seqs:
            if seq.finish_reason is None and choice in (None, seq.choice):
                self._emit(RequestOutput(req.request_id, seq.choice, finish_reason=reason))
                self._finish_seq(req, seq, reason)

    def _fail(self, req: Request, message: str) -> None:
        """End a request with an engine error; its sequences' resources go back like any other's."""
        req.error = message
        for seq in req.seqs:
            if seq.finish_reason is None:
                self._emit(RequestOutput(req.request_id, seq.choice, finish_reason="error", error=message))
                self._finish_seq(req, seq, "error")
        if not req.seqs:  # never admitted (no choices yet): closed here
            self._close(req)
