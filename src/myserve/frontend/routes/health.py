"""Liveness and metrics: ``/health`` (and ``/healthz``) and ``/metrics``, served without the API key."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from myserve.frontend.app_context import Context
from myserve.frontend.errors import APIError

router = APIRouter()


# 200 while the engine serves; 503 while it loads, after it died, or while the server drains.
@router.get("/health")
@router.get("/healthz")
async def health(context: Context) -> Response:
    if context.engine.dead is not None:
        return APIError(503, "the engine has stopped", code="engine_dead").response()
    if not context.engine.ready.is_set() or context.state.draining:
        return APIError(503, "not ready", code="server_not_ready").response()
    return JSONResponse({"status": "ok"})


# The Prometheus text exposition of the app's metrics (engine gauges refreshed now).
@router.get("/metrics")
async def prometheus(context: Context) -> Response:
    return Response(context.metrics.render(), media_type="text/plain; version=0.0.4")
