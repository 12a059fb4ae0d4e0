"""RequestStream: the deltas of one request, handed from the engine thread to an asyncio or plain consumer."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Callable, Iterator

from myserve.frontend.coalesce import coalesce, take_backlog
from myserve.wire.outputs import RequestOutput


class RequestStream:
    """Iterate (``async for`` or ``for``) over a request's ``RequestOutput``s; ends after the final one.

    Created inside a running event loop it is fed with ``loop.call_soon_threadsafe`` into an
    ``asyncio.Queue``; created outside one it is a blocking queue for synchronous callers.

    Either way, a consumer that finds more than one output waiting gets them coalesced
    (``coalesce.py``): each choice's waiting deltas as one, so a slow reader gets fewer, larger
    deltas (SSE chunks) with the same tokens and text, instead of falling further behind.
    """

    def __init__(self, request_id: str, on_close: Callable[[str], None] | None = None):
        self.request_id = request_id
        self._on_close = on_close
        self.closed = False
        self.finished = False
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._async_queue: asyncio.Queue[RequestOutput] | None = asyncio.Queue() if self._loop else None
        self._queue: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()

    def put(self, output: RequestOutput) -> None:
        """Deliver one output (engine thread)."""
        if self._loop is None:
            self._queue.put(output)
            return
        assert self._async_queue is not None
        try:
            self._loop.call_soon_threadsafe(self._async_queue.put_nowait, output)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
            pass

    @staticmethod
    def put_many(items: list[tuple[RequestStream, RequestOutput]]) -> None:
        """Deliver several outputs (engine thread, or a loop): one wake-up per event loop, not one
        per output, and none for the loop this runs in."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        for stream, output in items:
            if stream._loop is None:
                stream._queue.put(output)
            else:
                by_loop.setdefault(stream._loop, []).append((stream, output))
        if not by_loop:
            return
        try:
            here = asyncio.get_running_loop()  # (a front end reading the core's messages in its loop)
        except RuntimeError:
            here = None
        for loop, batch in by_loop.items():
            if loop is here:
                _put_all(batch)
                continue
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the consumers' loop is closed: nobody is listening any more
                pass

    def close(self) -> None:
        """The consumer is gone (client disconnect): abort the request unless it already finished."""
        if not self.closed:
            self.closed = True
            if not self.finished and self._on_close is not None:
                self._on_close(self.request_id)

    def _seen(self, output: RequestOutput) -> RequestOutput:
        if output.final:
            self.finished = True
        return output

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[RequestOutput]:
        if self._async_queue is None:
            raise RuntimeError("this stream was created outside an event loop; iterate it with a plain for")
        q = self._async_queue
        pending: list[RequestOutput] = []  # taken from the queue, coalesced, not yet yielded
        while not self.finished:
            if not pending:
                pending.append(await q.get())
            pending = take_backlog(q, pending, coalesce)  # (a consumer that fell behind: fewer deltas)
            yield self._seen(pending.pop(0))

    def __iter__(self) -> Iterator[RequestOutput]:
        if self._async_queue is not None:
            raise RuntimeError("this stream belongs to an event loop; iterate it with async for")
        q = self._queue
        pending: list[RequestOutput] = []  # as in _aiter
        while not self.finished:
            if not pending:
                pending.append(q.get())
            pending = take_backlog(q, pending, coalesce)
            yield self._seen(pending.pop(0))


def _put_all(batch: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, output in batch:
        assert stream._async_queue is not None
        stream._async_queue.put_nowait(output)


def settle[T](future: asyncio.Future[T], value: T) -> None:
    """Give ``future`` its result unless it is already done (cancelled by a caller that left)."""
    if not future.done():
        future.set_result(value)
