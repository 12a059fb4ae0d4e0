"""``python -m myserve.serve``: the OpenAI-compatible server. No arguments: bundled SmolLM2 on 127.0.0.1:8000.

Flags use vLLM's spelling where vLLM has one; ``--set section.key=value`` overrides any config field.
``--add-model KEY=VALUE,...`` (repeatable) serves another model beside the one the other flags
describe, each with its own engine core process; requests pick one by ``model``.
The HTTP socket opens at once (``/health`` answers 503), the engine compiles its buckets, then the
server reports ready. SIGTERM/SIGINT stop admission (503), let in-flight requests finish within
``server.drain_timeout_s``, then exit 0. If the engine dies or warmup fails, requests in flight get
the engine's error, the traceback is logged once, and the process exits 1 within seconds, so that a
supervisor restarts it.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING

from myserve.entrypoints.engine_loading import (
    front_tokenizer,
    load_engine,
    load_engines,
    served_model_name,
    served_model_names,
)
from myserve.entrypoints.hub import fetch_checkpoints
from myserve.entrypoints.memory_check import check_mesh_fits
from myserve.entrypoints.serve_args import add_config_flags, add_models, config_from_args, parse_args
from myserve.errors import MyserveError
from myserve.frontend.front_end_process import GIL_SWITCH_INTERVAL_S
from myserve.frontend.request_log import set_log_levels

__all__ = [
    "add_config_flags",
    "add_models",
    "config_from_args",
    "front_tokenizer",
    "load_engine",
    "load_engines",
    "main",
    "parse_args",
    "served_model_name",
    "served_model_names",
]

if TYPE_CHECKING:
    from myserve.config import Config
    from myserve.frontend.core_client import EngineClient
    from myserve.frontend.engine import Engine

logger = logging.getLogger("myserve.serve")


def main(argv: Sequence[str] | None = None, prog: str = "python -m myserve.serve") -> int:
    """Load, warm up, serve until signalled; returns the exit code."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    args = parse_args(argv, prog, __doc__)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    metrics_dir = None
    try:
        config = config_from_args(args)
        set_log_levels(config.server.log_level, config.server.log_requests)
        if not config.ray.enabled:  # (a Ray replica's devices are on its own node, not here)
            check_mesh_fits(config)  # before a download that the mesh would make useless
        config = fetch_checkpoints(config)  # hub ids downloaded now, before any process reads them
        if config.ray.enabled:  # the replicas load the model, each in its own Ray actor
            from myserve.ray.launch import run

            return run(config)
        front_ends = config.server.api_server_count
        if front_ends > 1:
            metrics_dir = _shared_metrics_dir()  # before prometheus_client is imported

        from myserve.frontend.core_client import EngineClient
        from myserve.frontend.http_server import serve_http, served_model

        configs = config.per_model()
        names = [served_model_names(one) for one in configs]
        if len(configs) > 1:
            engines: list[Engine] = list(load_engines(configs, names))
            service: Engine = engines[0]
        else:
            loaded = load_engine(config, front_ends)
            if isinstance(loaded, int):
                return loaded  # a follower's exit status
            service, engines = loaded, [loaded]
    except MyserveError as e:
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)
        print(f"error: {e}", file=sys.stderr)
        return 2

    try:
        if front_ends == 1:
            code = serve_http(config, [served_model(*m) for m in zip(configs, engines, names, strict=True)])
        else:
            assert isinstance(service, EngineClient)
            code = _serve_front_ends(config, service, names[0])
    finally:
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    if not isinstance(service, EngineClient):  # the front end of a core process has no JAX backend
        from myserve.runtime import multihost

        multihost.shutdown()
    return code


def _serve_front_ends(config: Config, service: EngineClient, names: tuple[str, ...]) -> int:
    """``--api-server-count N``: this process and N-1 spawned ones serve one port."""
    import multiprocessing

    from myserve.frontend.front_end_process import run_front_end
    from myserve.frontend.http_server import serve_http, served_model

    address = (config.server.host, config.server.port)
    if not hasattr(socket, "SO_REUSEPORT"):
        service.shutdown()
        logger.error("server.api_server_count > 1 needs SO_REUSEPORT (Linux)")
        return 1
    try:
        socket.create_server(address).close()  # the port is free (not another server's group)?
        # One SO_REUSEPORT group: the kernel spreads new connections evenly over its sockets. Each
        # other front end joins it once it can serve (a connection routed to a socket waits for it).
        sock = socket.create_server(address, reuse_port=True)
    except OSError as e:
        service.shutdown()
        logger.error("cannot listen on %s:%d: %s", *address, e)
        return 1
    spawn = multiprocessing.get_context("spawn")
    siblings = [
        spawn.Process(
            target=run_front_end,
            args=(config, link, address, names, functools.partial(front_tokenizer, config)),
            name=f"myserve-front-{link.index}",
        )
        for link in service.links[1:]
    ]
    for sibling in siblings:
        sibling.start()
    logger.info("%d front-end processes share %s:%d", len(siblings) + 1, *address)
    return serve_http(config, [served_model(config, service, names)], sockets=[sock], siblings=siblings)


def _shared_metrics_dir() -> str | None:
    """Several front ends: prometheus_client's multiprocess mode merges their figures on a scrape
    (each process writes its own files there). Returns the directory made for this run (removed at
    the end), or None when the environment names one (used as it is)."""
    if "prometheus_client" in sys.modules:
        raise RuntimeError("prometheus_client was imported before its multiprocess directory was set")
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None
    path = tempfile.mkdtemp(prefix="myserve-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path  # inherited by the spawned front ends
    return path


if __name__ == "__main__":
    sys.exit(main())
