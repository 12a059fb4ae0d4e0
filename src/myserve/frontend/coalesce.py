"""Coalescing a stream's queued deltas: when the consumer (an HTTP client, through its SSE writer)
reads slower than the engine produces, the deltas that piled up go out as fewer, larger ones.

Text is made before the stream (``OutputProcessor``: detokenizer and stop strings run on every
delta as the core sent it), so merging only concatenates finished pieces: token ids, text and
logprobs stay aligned, and the chat parsers downstream see the same text in fewer pieces. Only what
loses or reorders nothing merges (``merge``); the final ``choice == -1`` output never does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from myserve.wire.outputs import RequestOutput, TokenLogprob


def merge(head: RequestOutput, nxt: RequestOutput) -> RequestOutput | None:
    """``head`` followed by ``nxt`` (the same choice's next delta) as one delta; None where that would
    lose or reorder information, and the two must stay apart."""
    if head.final or nxt.final or head.choice != nxt.choice or head.request_id != nxt.request_id:
        return None
    # A choice's end is its last delta: whatever follows it (never, from the processor) stays after.
    if head.finish_reason is not None or head.stop_reason is not None or head.error is not None:
        return None
    if head.embedding is not None or nxt.embedding is not None:  # an embedding request's one delta
        return None
    if nxt.prompt_logprobs is not None:  # they come before a choice's first token: only a head has them
        return None
    if head.usage is not None or nxt.usage is not None:  # (only the final output carries usage)
        return None
    version = head.weights_version
    if nxt.weights_version is not None:
        if version is not None and version != nxt.weights_version:
            return None  # a live update cut over between them: each version keeps its tokens
        version = nxt.weights_version
    if head.logprobs is not None and nxt.logprobs is not None:
        logprobs: tuple[TokenLogprob, ...] | None = head.logprobs + nxt.logprobs
    elif head.logprobs is None and nxt.logprobs is None:
        logprobs = None
    # One side has logprobs, the other none: fine only if that other has no tokens either (the
    # prompt-logprobs delta before the first token), or logprobs would stop lining up with token ids.
    elif head.logprobs is None and not head.token_ids:
        logprobs = nxt.logprobs
    elif nxt.logprobs is None and not nxt.token_ids:
        logprobs = head.logprobs
    else:
        return None
    return RequestOutput(
        head.request_id, head.choice, head.token_ids + nxt.token_ids, head.text + nxt.text, logprobs,
        nxt.finish_reason, nxt.stop_reason, None, nxt.error, head.prompt_logprobs, None, version,
    )  # fmt: skip


def coalesce_tagged(items: Sequence[tuple[int, RequestOutput]]) -> list[tuple[int, RequestOutput]]:
    """``coalesce`` over outputs of several streams, each tagged with its stream's index: outputs
    merge only within one (stream, choice), never across streams or choices.

    Each merged output takes the place of its first delta; outputs of other choices it passes came
    later than that first one, so each choice's deltas stay in order (the order between choices is
    free: n > 1 interleaves them anyway). A stream's final output is its last, and stays so."""
    out: list[tuple[int, RequestOutput]] = []
    open_at: dict[int, dict[int, int]] = {}  # stream -> choice -> index in ``out`` of its latest output
    for tag, output in items:
        heads = open_at.setdefault(tag, {})
        if output.final:
            heads.clear()  # nothing of the stream merges across its final output
            out.append((tag, output))
            continue
        at = heads.get(output.choice)
        if at is not None:
            merged = merge(out[at][1], output)
            if merged is not None:
                out[at] = (tag, merged)
                continue
        heads[output.choice] = len(out)  # the choice's later deltas merge into this one, or follow it
        out.append((tag, output))
    return out


def coalesce(outputs: Sequence[RequestOutput]) -> list[RequestOutput]:
    """One stream's queued outputs, in order, with each choice's consecutive deltas merged where
    ``merge`` allows: token ids, text and logprobs concatenated, the last delta's finish and stop
    reasons, error and weights version, the first's prompt logprobs. The final output is unchanged."""
    if len(outputs) < 2:
        return list(outputs)
    return [output for _, output in coalesce_tagged([(0, o) for o in outputs])]


class _Backlog[T](Protocol):
    def empty(self) -> bool: ...
    def get_nowait(self) -> T: ...


def take_backlog[T](queue: _Backlog[T], pending: list[T], merge_all: Callable[[list[T]], list[T]]) -> list[T]:
    """``pending`` with whatever else ``queue`` holds now, merged by ``merge_all`` (``coalesce`` or
    ``coalesce_tagged``) when there was any: a consumer that fell behind gets fewer, larger deltas."""
    if queue.empty():
        return pending
    while not queue.empty():
        pending.append(queue.get_nowait())
    return merge_all(pending)
