"""Liveness and metrics: ``/health`` (and ``/healthz``) and ``/metrics``, served without the API key."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from myserve.frontend.errors import APIError
from myserve.frontend.served_models import Models

router = APIRouter()


# 200 while every model's engine serves; 503 while one loads, after one died, or while the server drains.
@router.get("/health")
@router.get("/healthz")
async def health(models: Models) -> Response:
    engines = models.engines
    if any(engine.dead is not None for engine in engines):
        return APIError(503, "the engine has stopped", code="engine_dead").response()
    if not all(engine.ready.is_set() for engine in engines) or models.state.draining:
        return APIError(503, "not ready", code="server_not_ready").response()
    return JSONResponse({"status": "ok"})


# The Prometheus text exposition of the app's metrics, every series labelled with its model
# (engine gauges refreshed now).
@router.get("/metrics")
async def prometheus(models: Models) -> Response:
    return Response(models.default.metrics.render(), media_type="text/plain; version=0.0.4")
