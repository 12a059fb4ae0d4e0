"""Loading the engine a config describes: a core process and its client, or the engine in this
process (or a multi-host follower's loop), and the names a model answers to. ``python -m
myserve.serve``, ``run_batch`` and each Ray Serve replica (``ray/replica.py``) load theirs here."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from myserve.errors import ConfigError

if TYPE_CHECKING:
    from myserve.config import Config
    from myserve.entrypoints.service import GenerationService
    from myserve.frontend.core_client import EngineClient

logger = logging.getLogger("myserve.serve")


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
    from myserve.entrypoints.memory_check import check_memory
    from myserve.frontend.core_client import EngineClient

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

    from myserve.entrypoints.service import GenerationService
    from myserve.runtime import multihost
    from myserve.runtime.cpu_threads import single_threaded_dots_on_small_hosts
    from myserve.runtime.deployment import Deployment
    from myserve.runtime.host_memory import keep_freed_memory
    from myserve.runtime.kv_sizing import use_gpu_share

    use_gpu_share(config.engine)
    single_threaded_dots_on_small_hosts()
    multihost.initialize(config.mesh)  # before anything touches a JAX backend
    if jax.default_backend() == "cpu":
        keep_freed_memory()  # the steps' temporaries live in host memory: reuse it
    dep = Deployment.load(config, prebuild=True)  # step executables build while the weights load
    if not multihost.is_leader():
        return _follow(dep)
    return GenerationService.from_deployment(dep)


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
