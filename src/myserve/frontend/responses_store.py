"""Stored Responses API objects: what ``store``, ``GET``/``DELETE /v1/responses/{id}``,
``previous_response_id`` and ``background`` read and write.

One ``ResponseStore`` per app (``ServerState.responses``: a response id names no model, so the
models of one app share it), in memory, bounded by count (``server.responses_store_size``): past
the bound the oldest response (by creation) is dropped. Each front-end process has its own, so with
``server.api_server_count`` > 1 a response is found only through the process that made it.

A background response's generation is an asyncio task the store keeps referenced (the event loop
holds tasks only weakly) until it ends; dropping or deleting a response cancels its task (nobody
could read what it makes), and so does ``close`` at the app's shutdown.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import OrderedDict
from collections.abc import Coroutine
from typing import Any


@dataclasses.dataclass
class StoredResponse:
    """One stored response; a background one's fields are replaced as its generation advances."""

    response: dict[str, Any]
    """The response object, as ``GET /v1/responses/{id}`` returns it."""
    conversation: list[dict[str, Any]]
    """Chat messages: the conversation it continued, its input, then (once done) its output; what a
    request naming it as ``previous_response_id`` continues. Instructions are left out: OpenAI does not
    carry them over to the next response."""
    task: asyncio.Task[None] | None = None
    """A background response's generation (None: it was answered in the request)."""

    @property
    def running(self) -> bool:
        """Whether its background generation has not ended yet."""
        return self.task is not None and not self.task.done()


class ResponseStore:
    """Response id -> ``StoredResponse``, at most ``size`` of them (0: storage is off)."""

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"a response store holds >= 0 responses, got {size}")
        self.size = size
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def enabled(self) -> bool:
        """Whether responses are stored at all."""
        return self.size > 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, or None (never stored, dropped or deleted)."""
        return self._entries.get(response_id)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        """Store ``entry``, dropping the oldest responses beyond the bound."""
        if not self.enabled:
            return
        self._entries[response_id] = entry
        while len(self._entries) > self.size:
            _, dropped = self._entries.popitem(last=False)
            _stop(dropped)

    def pop(self, response_id: str) -> StoredResponse | None:
        """Delete a response (cancelling its generation if it still runs); None if it is not stored."""
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            _stop(entry)
        return entry

    def run(self, entry: StoredResponse, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Start ``entry``'s background generation, held here until it ends."""
        task = asyncio.get_running_loop().create_task(work)
        entry.task = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        """Cancel every background generation still running (the app's shutdown) and wait for them."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _stop(entry: StoredResponse) -> None:
    if entry.task is not None:
        entry.task.cancel()
