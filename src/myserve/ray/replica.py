"""One engine replica on Ray Serve: a whole myserve engine (its core process, or in this process
with ``server.engine_process: false``) and the very app ``python -m myserve.serve`` serves.

Ray Serve starts each replica as an actor with the resources ``ray/deployment.py`` asks for (its
mesh's GPUs or TPU chips). The constructor loads the model and warms the engine up, so Ray counts a
replica as running only once it can serve. The ingress sends each request as an ``HttpCall``; the
replica runs it through its app in-process and streams the response back. Ray asks
``check_health`` every ``ray.health_check_period_s``: a dead engine fails it, and Ray replaces the
replica (its requests in flight end with the engine's error).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import AsyncIterator

from ray import serve

from myserve.config import Config
from myserve.errors import MyserveError
from myserve.ray.affinity import RouteHint
from myserve.ray.http_call import HttpCall, Lifespan, ResponseStart, call_app

logger = logging.getLogger("myserve.ray")

REPLICA_HEADER = b"x-myserve-replica"
"""Response header naming the replica (its Ray Serve unique id) that served a request."""


class EngineReplica:
    """A Ray Serve deployment class (``serve.deployment`` is applied by ``ray/deployment.py``)."""

    async def __init__(self, config: Config) -> None:  # type: ignore[misc]  # Ray awaits it
        from myserve.entrypoints.engine_loading import load_engine, served_model_names
        from myserve.frontend.front_end_process import GIL_SWITCH_INTERVAL_S
        from myserve.frontend.http_server import app_for_models, served_model

        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.pid = os.getpid()
        engine = await asyncio.to_thread(load_engine, config)
        if isinstance(engine, int):  # a multi-host follower: RayConfig rules these out
            raise MyserveError("a Ray Serve replica's mesh must be one host")
        self.engine = engine
        await asyncio.to_thread(engine.start)  # compiles, or loads the compiled steps from the cache
        self.app = app_for_models(config, [served_model(config, engine, served_model_names(config))])
        self.lifespan = Lifespan(self.app)
        await self.lifespan.startup()
        logger.info("replica %s (pid %d) ready", self.replica_id, self.pid)

    async def forward(self, hint: RouteHint, call: HttpCall) -> AsyncIterator[ResponseStart | bytes]:
        """Serve ``call`` (``hint`` was the router's): its ``ResponseStart`` (naming this replica in
        ``x-myserve-replica``), then its body's chunks."""
        async for part in call_app(self.app, call):
            if isinstance(part, ResponseStart):
                part = ResponseStart(part.status, (*part.headers, (REPLICA_HEADER, self.replica_id.encode())))
            yield part

    async def info(self, hint: RouteHint) -> dict[str, object]:
        """This replica's id, process and engine state (the ingress's ``/ray/replicas``)."""
        return {
            "replica": self.replica_id,
            "pid": self.pid,
            "ready": self.engine.ready.is_set(),
            "dead": None if self.engine.dead is None else repr(self.engine.dead),
        }

    def check_health(self) -> None:
        """Ray Serve's health check: raises once the engine has died, so the replica is replaced."""
        if self.engine.dead is not None:
            raise RuntimeError(f"the engine of replica {self.replica_id} stopped: {self.engine.dead!r}")

    async def __del__(self) -> None:
        """Ray Serve's teardown of the replica: stop the app, then the engine (and its core)."""
        try:
            await self.lifespan.shutdown()
        finally:
            self.engine.shutdown()
