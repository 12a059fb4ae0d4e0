"""vLLM's sleep mode: ``POST /sleep?level=1|2``, ``POST /wake_up``, ``GET /is_sleeping``
(``core/engine_sleep.py``).

Served only on a server started with ``--enable-sleep-mode`` (``engine.enable_sleep_mode``), behind
the API key like every route. A sleep applies to every model the server serves (each engine, in
turn) and answers once all are asleep: the requests they held finish first, new ones are refused
with a 503 meanwhile. The answers carry the sleep state: ``{"is_sleeping", "level"}`` and the
device bytes of the engine's arrays before and after its last sleep."""

from __future__ import annotations

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from myserve.frontend.errors import APIError
from myserve.frontend.served_models import Models

router = APIRouter()


@router.post("/sleep")
async def sleep(models: Models, level: int = Query(1)) -> JSONResponse:
    """Free the devices: level 1 keeps the weights in host memory, level 2 reads them again on wake-up."""
    if level not in (1, 2):
        raise APIError(400, f"level must be 1 or 2, got {level}", param="level", code="invalid_value")
    states = []
    for engine in models.engines:
        error, state = await engine.sleep(level)
        if error is not None:
            raise APIError(400, error, param="level", code="invalid_value")
        states.append(state)
    return JSONResponse(states[0] if len(states) == 1 else {"is_sleeping": True, "models": states})


@router.post("/wake_up")
async def wake_up(models: Models) -> JSONResponse:
    """Fill the devices again and admit requests (or cancel a sleep still waiting for its requests)."""
    states = []
    for engine in models.engines:
        error, state = await engine.wake_up()
        if error is not None:
            raise APIError(400, error, code="invalid_value")
        states.append(state)
    return JSONResponse(states[0] if len(states) == 1 else {"is_sleeping": False, "models": states})


@router.get("/is_sleeping")
async def is_sleeping(models: Models) -> JSONResponse:
    """``{"is_sleeping": bool}``: asleep, or going to sleep (requests refused)."""
    return JSONResponse({"is_sleeping": any(bool(e.sleep_state.get("is_sleeping")) for e in models.engines)})
