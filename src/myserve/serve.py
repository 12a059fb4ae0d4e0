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

from myserve.errors import ConfigError, MyserveError
from myserve.frontend.front_end_process import GIL_SWITCH_INTERVAL_S
from myserve.frontend.request_log import set_log_levels
from myserve.hub import fetch_checkpoints
from myserve.memory_check import check_mesh_fits
from myserve.serve_args import add_config_flags, add_models, config_from_args, parse_args

__all__ = ["add_config_flags", "add_models", "config_from_args", "main", "parse_args", "served_model_names"]

if TYPE_CHECKING:
    from myserve.config import Config
    from myserve.frontend.core_client import EngineClient
    from myserve.frontend.engine import Engine
    from myserve.service import GenerationService

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
        check_mesh_fits(config)  # before a download that the mesh would make useless
        config = fetch_checkpoints(config)  # hub ids downloaded now, before any process reads them
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


def load_engine(config: Config, front_ends: int = 1) -> GenerationService | EngineClient | int:
    """The loaded (not yet warmed up) engine ``config`` asks for: a core process and its client
    (``server.engine_process``), or the engine in this process; or a multi-host follower's exit
    status. Raises ``MyserveError`` (a ``ConfigError`` for a bad combination)."""
    from myserve.core.process import run_core
    from myserve.frontend.core_client import EngineClient

    # A multi-host leader's core (process 0) broadcasts its steps from its own process; a
    # follower has no front end, and a process that learns its id from JAX runs in one process.
    if config.server.engine_process and config.mesh.role() in ("single", "leader"):
        # The core loads the model and owns the device; this process only needs the tokenizer
        # (it never imports the engine, nor JAX).
        load_tokenizer = functools.partial(front_tokenizer, config)
        client = EngineClient(config, load_tokenizer, core_main=run_core, front_ends=front_ends)
        try:
            client.wait_loaded()  # the core's verdict on the configuration first
        except BaseException:
            client.shutdown()
            raise
        return client
    if front_ends > 1:
        raise ConfigError("server.api_server_count > 1 needs mesh.process_id on a multi-host mesh")
    return _in_process(config)


def load_engines(configs: Sequence[Config], names: Sequence[tuple[str, ...]]) -> list[EngineClient]:
    """Several models: check that they fit in memory together, then start every model's core
    process at once (their loading and warmup overlap) and wait until each has loaded. If one
    fails, all are stopped and its error is raised (a ``ConfigError`` for a configuration)."""
    from myserve.core.process import run_core
    from myserve.frontend.core_client import EngineClient
    from myserve.memory_check import check_memory

    seen: dict[str, int] = {}
    for i, model_names in enumerate(names):
        for name in model_names:
            if name in seen:
                raise ConfigError(f"models {seen[name]} and {i} are both served as {name!r}: set served_model_name")
            seen[name] = i
    check_memory(configs, [n[0] for n in names])
    # Several processes share the GPU: none may take XLA's default 75 % of its memory at start.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    clients: list[EngineClient] = []
    try:
        for one, model_names in zip(configs, names, strict=True):
            clients.append(EngineClient(one, functools.partial(front_tokenizer, one), core_main=run_core))
            assert clients[-1].process is not None
            logger.info("model %s: engine core process %d", model_names[0], clients[-1].process.pid)
        for client in clients:
            client.wait_loaded()
    except BaseException:
        for client in clients:
            client.shutdown()
        raise
    return clients


def served_model_names(config: Config) -> tuple[str, ...]:
    """The ``model`` values the one model of ``config`` answers to: ``server.served_model_name``
    (a name or a list of aliases), else the checkpoint's name."""
    from myserve.bundled import BUNDLED_MODEL_NAME

    names = config.server.served_model_name
    if names:
        return (names,) if isinstance(names, str) else tuple(names)
    checkpoint = config.model.checkpoint
    return (BUNDLED_MODEL_NAME if checkpoint is None else os.path.basename(checkpoint.rstrip("/")),)


def served_model_name(config: Config) -> str:
    """The name the one model of ``config`` reports (the first of ``served_model_names``)."""
    return served_model_names(config)[0]


def _in_process(config: Config) -> GenerationService | int:
    """The engine in this process: the service, or a multi-host follower's exit status."""
    import jax

    from myserve.runtime import multihost
    from myserve.runtime.deployment import Deployment
    from myserve.runtime.host_memory import keep_freed_memory
    from myserve.runtime.kv_sizing import use_gpu_share
    from myserve.service import GenerationService

    use_gpu_share(config.engine)
    multihost.initialize(config.mesh)  # before anything touches a JAX backend
    if jax.default_backend() == "cpu":
        keep_freed_memory()  # the steps' temporaries live in host memory: reuse it
    dep = Deployment.load(config, prebuild=True)  # step executables build while the weights load
    if not multihost.is_leader():
        return _follow(dep)
    return GenerationService.from_deployment(dep)


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


def front_tokenizer(config: Config):  # noqa: ANN201 - a Tokenizer
    """The tokenizer the front end needs, loaded as the deployment would (no weights, no device).

    Here, in the assembly, because it resolves the checkpoint with model code: the front ends get
    it as a (picklable) loader and import nothing of ``models/``."""
    from myserve.models.checkpoint import resolve_checkpoint
    from myserve.tokenizer import Tokenizer

    source = config.model.tokenizer or resolve_checkpoint(config.model.checkpoint).path
    return Tokenizer.load(source, chat_template=config.model.chat_template)


def _follow(dep) -> int:
    """A process other than 0 of a multi-host deployment: run the leader's steps until it stops."""
    import jax

    from myserve.core.build import make_executors
    from myserve.runtime import multihost
    from myserve.runtime.step_channel import StepChannelError

    executors = make_executors(dep)
    logger.info("process %d: following process 0's steps", jax.process_index())
    try:
        applied = multihost.follow(executors)
    except StepChannelError as e:
        logger.error("process %d: %s; this follower stops", jax.process_index(), e)
        return 1
    logger.info("process %d: the leader stopped after %d steps; exiting", jax.process_index(), applied)
    multihost.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
