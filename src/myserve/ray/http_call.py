"""An HTTP request carried to a replica over Ray, and its run through the replica's own app.

Ray Serve's HTTP proxy hands each request to the ingress (``ray/ingress.py``), which chooses a
replica and sends it an ``HttpCall``: the method, path, headers and whole body. The replica runs it
through the same FastAPI app ``python -m myserve.serve`` serves (every route, error and header
alike) by calling the app in-process as an ASGI server would, and streams back what the app sends:
one ``ResponseStart``, then the body's chunks as they come (a stream's server-sent events one by
one). httpx's ``ASGITransport`` would do the call but buffers the whole body, so a stream would
arrive all at once at its end; hence this small bridge.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

ASGIApp = Callable[
    [MutableMapping[str, Any], Callable[[], Awaitable[dict]], Callable[[MutableMapping[str, Any]], Awaitable[None]]],
    Awaitable[None],
]

CANCEL_AFTER_S = 5.0
"""How long the app may take to notice that the caller went away before its call is cancelled."""


@dataclasses.dataclass(frozen=True)
class HttpCall:
    """One HTTP request, as the ingress received it."""

    method: str
    path: str
    query: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    """Lower-case names, as ASGI has them."""
    body: bytes = b""
    client: tuple[str, int] | None = None
    """The caller's address (the app logs it)."""


@dataclasses.dataclass(frozen=True)
class ResponseStart:
    """The status and headers of a response: the first thing a replica yields."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]


_END = object()


async def call_app(app: ASGIApp, call: HttpCall) -> AsyncIterator[ResponseStart | bytes]:
    """Run ``call`` through ``app``: yields its ``ResponseStart``, then each non-empty body chunk.
    An exception of the app is raised here. Closing the iterator early (the caller went away) tells
    the app the client disconnected, as a dropped connection would, so it aborts the generation;
    the app's call is cancelled if it has not ended ``CANCEL_AFTER_S`` later."""
    messages: asyncio.Queue[Any] = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        await messages.put(message)

    async def run() -> None:
        try:
            await app(_scope(call), receive, send)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            await messages.put(e)
            return
        await messages.put(_END)

    task = asyncio.create_task(run())
    try:
        while True:
            message = await messages.get()
            if message is _END:
                return
            if isinstance(message, BaseException):
                raise message
            if message["type"] == "http.response.start":
                yield ResponseStart(int(message["status"]), tuple(map(tuple, message.get("headers", ()))))
            elif message["type"] == "http.response.body":
                if chunk := message.get("body", b""):
                    yield bytes(chunk)
                if not message.get("more_body", False):
                    return
    finally:
        gone.set()
        if not task.done():
            asyncio.get_running_loop().call_later(CANCEL_AFTER_S, task.cancel)


def _scope(call: HttpCall) -> dict[str, Any]:
    path = call.path or "/"
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": call.method.upper(),
        "scheme": "http",
        "path": path,
        "raw_path": path.encode("utf-8"),
        "query_string": call.query,
        "root_path": "",
        "headers": [(bytes(k).lower(), bytes(v)) for k, v in call.headers],
        "client": call.client,
        "server": ("ray-serve", 0),
    }


class Lifespan:
    """Runs an app's ASGI lifespan (startup now, shutdown later) as a server would. A replica's
    startup and shutdown happen in different calls (its constructor, then its teardown), so the
    lifespan is a task of its own rather than a context manager bound to one task, as the
    ``asgi-lifespan`` package's is."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app
        self._to_app: asyncio.Queue[dict] = asyncio.Queue()
        self._from_app: asyncio.Queue[MutableMapping[str, Any]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def startup(self) -> None:
        """Start the app; raises ``RuntimeError`` if its startup failed."""
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}

        async def run() -> None:
            await self._app(scope, self._to_app.get, self._from_app.put)

        self._task = asyncio.create_task(run())
        await self._step("lifespan.startup")

    async def shutdown(self) -> None:
        """Stop the app (once started; a second call does nothing)."""
        if self._task is None:
            return
        if not self._task.done():
            await self._step("lifespan.shutdown")
        self._task = None

    async def _step(self, kind: str) -> None:
        """Send ``kind``; wait for the app's answer. An app that ends instead of answering does not
        support the lifespan protocol (ASGI lets it), so there is nothing to wait for."""
        assert self._task is not None
        await self._to_app.put({"type": kind})
        answer = asyncio.ensure_future(self._from_app.get())
        await asyncio.wait([answer, self._task], return_when=asyncio.FIRST_COMPLETED)
        if not answer.done():
            answer.cancel()
            if not self._task.cancelled():
                self._task.exception()  # retrieved: the app merely has no lifespan
            return
        message = answer.result()
        if message["type"] == f"{kind}.failed":
            if self._task.done() and not self._task.cancelled():
                self._task.exception()  # (the same failure, re-raised by the app: reported below)
            raise RuntimeError(f"the app's {kind.split('.')[1]} failed: {message.get('message', '')}")
