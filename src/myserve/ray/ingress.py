"""The ingress of the Ray Serve application: every HTTP request Ray Serve's proxy receives comes
here and is relayed, whole, to an engine replica chosen by ``ray/router.py``.

The ingress does not parse OpenAI requests (the replica's own app does, with its errors and
headers); it only reads a request's text for prefix routing. Its own routes: ``/metrics`` (every
replica's metrics, each series labelled ``replica``) and ``/ray/replicas`` (each replica's id,
process and engine state). When a replica dies, what it was serving ends with an OpenAI-shaped
error: a 503 if nothing was sent yet, else an error event that ends the stream (a JSON body is cut
short, which clients report as an error), never a hang.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import cast

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from myserve.config import Config
from myserve.frontend.errors import APIError
from myserve.frontend.guard import key_refusal
from myserve.frontend.sse import sse_event
from myserve.ray.affinity import ASSIGNED, ROUTERS, RouteHint, routing_text
from myserve.ray.http_call import HttpCall, ResponseStart
from myserve.ray.metrics_merge import merge_metrics

logger = logging.getLogger("myserve.ray")

METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
FANOUT_TIMEOUT_S = 10.0
"""How long ``/metrics`` and ``/ray/replicas`` wait for each replica."""
LIVENESS_CHECK_S = 1.0
"""While a response waits for its next part, how often the ingress checks that its replica is
still among the live ones: a replica killed mid-response is not always reported to the caller (over
Ray Serve's gRPC transport its stream just stops), and a request must never hang."""


class ReplicaGone(Exception):
    """The replica serving a request left the live replicas before the response ended."""


@serve.ingress()
class Ingress:
    """Relays each request to an engine replica (Ray Serve deployment class)."""

    def __init__(self, engine: DeploymentHandle, config: Config) -> None:
        self.engine = engine
        self.app_name = serve.get_replica_context().app_name
        self.prefix_routing = config.ray.routing == "prefix"
        self.max_body_bytes = config.server.max_body_bytes
        self.api_key = config.server.api_key

    def __serve_build_asgi_app__(self) -> FastAPI:
        """The ingress's app, built in its replica (Ray calls this after the constructor)."""
        app = FastAPI(title="myserve on Ray Serve", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        app.add_api_route("/ray/replicas", self.replicas, methods=["GET"])
        app.add_api_route("/{path:path}", self.relay, methods=METHODS)
        return app

    async def metrics(self) -> Response:
        """Every replica's Prometheus metrics, each series labelled with its replica's id."""
        texts = {}
        for replica, result in await self._each_replica(lambda hint: self._collect(hint, HttpCall("GET", "/metrics"))):
            if isinstance(result, bytes):
                texts[replica] = result.decode("utf-8")
        return Response(merge_metrics(texts), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def replicas(self, request: Request) -> Response:
        """Each replica's id, process id and engine state (behind the API key, when there is one)."""
        if self.api_key is not None and (denied := key_refusal(request.headers.get("authorization", ""), self.api_key)):
            return denied.response()
        handle = self.engine.options(stream=False)
        found = await self._each_replica(lambda hint: handle.info.remote(hint))
        return JSONResponse({"replicas": [r for _, r in found if isinstance(r, dict)]})

    async def relay(self, request: Request, path: str) -> Response:
        """Any other request: to the replica the router picks, streamed back as it comes."""
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            message = f"request body exceeds {self.max_body_bytes} bytes"
            return APIError(413, message, code="request_too_large").response()
        body = await request.body()
        call = HttpCall(
            method=request.method,
            path=request.url.path,
            query=request.url.query.encode("latin-1"),
            headers=tuple(request.scope["headers"]),
            body=body,
            client=tuple(request.scope["client"]) if request.scope.get("client") else None,  # type: ignore[arg-type]
        )
        text = routing_text(call.path, body) if self.prefix_routing else None
        hint = RouteHint(text=text, request=uuid.uuid4().hex)
        parts = cast(DeploymentResponseGenerator, self.engine.options(stream=True).forward.remote(hint, call))
        try:
            start = await self._next(parts, hint)
        except (RayError, ReplicaGone, StopAsyncIteration) as e:
            logger.warning("request to %s failed before its response began: %r", call.path, e)
            ASSIGNED.pop(hint.request or "", None)
            parts.cancel()
            return APIError(503, "the replica serving this request stopped; retry it", code="replica_failed").response()
        assert isinstance(start, ResponseStart)
        headers = dict(start.headers)
        event_stream = headers.get(b"content-type", b"").startswith(b"text/event-stream")
        response = StreamingResponse(self._relay(parts, hint, event_stream), status_code=start.status)
        response.raw_headers = list(start.headers)
        return response

    async def _next(self, parts: DeploymentResponseGenerator, hint: RouteHint) -> object:
        """The response's next part; ``ReplicaGone`` once its replica is no longer alive."""
        waiting = asyncio.ensure_future(parts.__anext__())
        try:
            while True:
                done, _ = await asyncio.wait({waiting}, timeout=LIVENESS_CHECK_S)
                if done:
                    return waiting.result()
                replica, router = ASSIGNED.get(hint.request or ""), ROUTERS.get(self.app_name)
                if replica is not None and router is not None and replica not in router.replica_ids():
                    raise ReplicaGone(replica)
        finally:
            if not waiting.done():
                waiting.cancel()

    async def _relay(
        self, parts: DeploymentResponseGenerator, hint: RouteHint, event_stream: bool
    ) -> AsyncIterator[bytes]:
        """The body's chunks; if the replica dies mid-way, an error event ends an event stream."""
        try:
            while True:
                try:
                    part = await self._next(parts, hint)
                except StopAsyncIteration:
                    return
                if isinstance(part, bytes):
                    yield part
        except (RayError, ReplicaGone) as e:
            logger.warning("a replica stopped mid-response: %r", e)
            if event_stream:
                error = APIError(503, "the replica serving this request stopped; retry it", code="replica_failed")
                yield sse_event(error.body())
                yield b"data: [DONE]\n\n"
            else:
                raise  # the body is cut short: the client sees an incomplete response
        finally:
            ASSIGNED.pop(hint.request or "", None)
            parts.cancel()

    async def _each_replica(self, call) -> list[tuple[str, object]]:  # type: ignore[no-untyped-def]
        """``call(hint)`` for every replica at once (its result, or the exception), by replica id."""
        router = ROUTERS.get(self.app_name)
        if router is None:  # the handle makes its router on first use
            await self.engine.options(stream=False).info.remote(RouteHint())
            router = ROUTERS.get(self.app_name)
        ids = router.replica_ids() if router is not None else []
        results = await asyncio.gather(
            *(asyncio.wait_for(call(RouteHint(replica=r)), FANOUT_TIMEOUT_S) for r in ids),
            return_exceptions=True,
        )
        return list(zip(ids, results, strict=True))

    async def _collect(self, hint: RouteHint, call: HttpCall) -> bytes:
        """The whole body of ``call`` served by the replica ``hint`` names."""
        chunks = []
        async for part in cast(
            DeploymentResponseGenerator, self.engine.options(stream=True).forward.remote(hint, call)
        ):
            if isinstance(part, bytes):
                chunks.append(part)
        return b"".join(chunks)
