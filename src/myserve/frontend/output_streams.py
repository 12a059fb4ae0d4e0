"""Reading a request's engine streams: several prompts' outputs merged as they come (a backlog
coalesced, as a single stream's is), waits bounded by the request's deadline, and their usage summed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from myserve.frontend.coalesce import coalesce_tagged, take_backlog
from myserve.frontend.stream import RequestStream
from myserve.wire.outputs import RequestOutput, Usage


def until[T](deadline: float | None, items: AsyncIterator[T]) -> AsyncIterator[T]:
    """``items`` until ``deadline`` (event-loop time; None = no limit), then TimeoutError.

    Only the waits for the next item are timed: a timeout spanning a ``yield`` would cancel whatever
    the consumer awaits there. An expired wait cancels ``items`` where it awaits (``merged`` then
    closes its streams). Without a deadline (the default) ``items`` itself: a timeout scope per
    streamed token is a measurable share of the front end's CPU at 64 streams."""
    return items if deadline is None else _until(deadline, items)


async def _until[T](deadline: float, items: AsyncIterator[T]) -> AsyncIterator[T]:
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
    queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        async for out in stream:
            await queue.put((i, out))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)  # streams whose final output has not come (a stream ends with it)
        pending: list[tuple[int, RequestOutput]] = []  # taken from the queue, coalesced, not yet yielded
        while remaining:
            if not pending:
                pending.append(await queue.get())
            # The pumps read their streams at once, so a consumer that fell behind finds the backlog
            # here, not in the streams: it is coalesced here too, per stream and choice.
            pending = take_backlog(queue, pending, coalesce_tagged)
            i, out = pending.pop(0)
            if out.final:
                remaining -= 1
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
