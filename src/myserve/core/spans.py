"""A scheduled chunk as the span of the flat batch a step lays out (``runtime/step_layout.py``)."""

from __future__ import annotations

from myserve.core.images import rope_offset
from myserve.core.scheduler import ScheduledChunk
from myserve.core.sequence import Sequence as Seq
from myserve.runtime.step_layout import Span


def span_of(chunk: ScheduledChunk, inflight_rows: dict[Seq, int]) -> Span:
    """A scheduled chunk as a span of the flat batch. Its last token may still be in flight (a
    decode planned while the step sampling its token runs): the device feeds it from that step's
    sampling row, ``inflight_rows[seq]``."""
    seq, start, n = chunk.seq, chunk.start, chunk.num_tokens
    adapter = -1 if seq.adapter_slot is None else seq.adapter_slot
    if chunk.draft:  # its known last token, then the draft: every position samples
        tokens = [*seq.tokens(start, start + 1), *chunk.draft]
        return Span(tokens, start, seq.pages, True, adapter=adapter, sample_count=chunk.sample_count)
    tokens = seq.tokens(start, start + n)
    feed = -1
    if len(tokens) < n:
        # (A several-token call may have more in flight, but their positions were computed by it.)
        assert len(tokens) == n - 1 and seq.num_inflight >= 1, "only the span's last token can be in flight"
        tokens, feed = [*tokens, 0], inflight_rows[seq]
    following = seq.tokens(start + 1, start + n + 1) if seq.scores_prompt(start) else None
    pool = seq.pool_range(start, n) if seq.pool_type is not None else None
    rope = rope_offset(seq.images, start) if seq.images else 0
    return Span(tokens, start, seq.pages, chunk.samples, following, feed, pool, adapter, rope_offset=rope)
