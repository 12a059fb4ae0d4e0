"""Running one HTTP front end: the app on uvicorn, draining on a signal, exiting 1 when an engine dies.

``serve_http`` is what ``python -m myserve.serve`` runs in its own process, and what each extra
front-end process of ``--api-server-count`` runs (``frontend/front_end_process.py``) on the listening
socket they share. Rules: the first SIGTERM/SIGINT refuses new requests (503) and lets in-flight
ones finish within ``server.drain_timeout_s`` (every model's); a second one exits at once. A dead
engine (any model's; or a failed warmup, or a sibling front end that died) ends the server with
status 1 after open responses had ``FATAL_GRACE_S`` to end.
"""

from __future__ import annotations

import logging
import multiprocessing.process
import os
import signal
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI

from myserve.errors import ConfigError
from myserve.frontend.app import ServedModel, create_models_app
from myserve.frontend.core_client import EngineClient
from myserve.frontend.cors import CORSPolicy
from myserve.frontend.engine import Engine
from myserve.frontend.served_models import ServedModels

if TYPE_CHECKING:
    from myserve.config import Config
    from myserve.frontend.tracing import RequestTracer

logger = logging.getLogger("myserve.serve")

FATAL_GRACE_S = 3
"""Seconds open responses get to end once the server exits after a fatal engine error."""


def served_model(config: Config, engine: Engine, names: str | Sequence[str]) -> ServedModel:
    """The model of ``config`` (a one-model config: an item of ``Config.per_model()``), served by
    ``engine`` under ``names``, with the server options its config gives it."""
    return ServedModel(
        engine=engine,
        names=(names,) if isinstance(names, str) else tuple(names),
        request_timeout_s=config.server.request_timeout_s,
        tool_call_parser=config.server.tool_call_parser,
        enable_auto_tool_choice=config.server.enable_auto_tool_choice,
        reasoning_parser=config.server.reasoning_parser,
        max_logprobs=config.server.max_logprobs,
        trust_request_chat_template=config.server.trust_request_chat_template,
        return_tokens_as_token_ids=config.server.return_tokens_as_token_ids,
    )


def app_for(config: Config, service: Engine, name: str | Sequence[str]) -> FastAPI:
    """The app ``config`` describes around ``service``, serving one model as ``name`` (or names):
    what ``python -m myserve.run_batch`` sends each line through."""
    return app_for_models(config, [served_model(config, service, name)])


def app_for_models(config: Config, served: Sequence[ServedModel]) -> FastAPI:
    """The app serving ``served`` with ``config``'s server-wide options: what ``serve_http`` serves."""
    s = config.server
    tracer = otlp_tracer(s.otlp_traces_endpoint) if s.otlp_traces_endpoint else None
    cors = CORSPolicy(
        allowed_origins=s.allowed_origins,
        allowed_methods=s.allowed_methods,
        allowed_headers=s.allowed_headers,
        allow_credentials=s.allow_credentials,
    )
    return create_models_app(
        served,
        api_key=s.api_key,
        max_body_bytes=s.max_body_bytes,
        tracer=tracer,
        cors=cors,
        responses_store_size=s.responses_store_size,
        weight_updates=config.engine.enable_weight_updates,
        sleep_mode=config.engine.enable_sleep_mode,
    )


def otlp_tracer(endpoint: str) -> RequestTracer:
    """The tracer sending each request's span to ``endpoint``; ``ConfigError`` without the SDK."""
    try:  # only here: a server that does not trace never loads OpenTelemetry's SDK
        from myserve.frontend import tracing

        return tracing.otlp_tracer(endpoint)
    except (ImportError, ValueError) as e:
        raise ConfigError(f"server.otlp_traces_endpoint: {e} (pip install 'myserve[otel]')") from None


def serve_http(
    config: Config,
    served: Sequence[ServedModel],
    *,
    sockets: Sequence[socket.socket] | None = None,
    siblings: Sequence[multiprocessing.process.BaseProcess] = (),
    follows_parent: bool = False,
) -> int:
    """Serve the ``served`` models over HTTP until signalled or fatal; returns the exit status (0 or 1).

    Each model's engine is loaded (its tokenizer at hand); this starts their warmups, each on a
    thread of its own, and stops them all at the end. Any engine that dies (or fails to warm up)
    ends the server with status 1; a signal drains every model's requests. ``sockets``: listening
    sockets to serve on (shared with ``siblings``, the extra front-end processes, which get every
    signal this process gets, are watched, and are waited for before the engine stops).
    ``follows_parent``: an extra front end, which ignores SIGINT (Ctrl-C reaches every process of
    the group; the first front end forwards what it decides).
    """
    app = app_for_models(config, served)
    models: ServedModels = app.state.models
    state = models.state
    url = f"http://{config.server.host}:{config.server.port}"

    told = 0  # signals forwarded to the siblings: the first drains them, a second ends them

    def tell_siblings() -> None:
        nonlocal told
        told += 1
        for sibling in siblings:
            if sibling.is_alive() and sibling.pid is not None:
                try:
                    os.kill(sibling.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    class DrainingServer(uvicorn.Server):
        """First signal: refuse new requests, wait for in-flight ones (bounded), then exit."""

        draining = False

        def handle_exit(self, sig: int, frame: object) -> None:
            if follows_parent and sig == signal.SIGINT:
                return
            tell_siblings()
            if self.draining:
                self.should_exit = True
                return
            self.draining = True
            state.draining = True
            logger.info("signal %d: draining (up to %.0fs)", sig, config.server.drain_timeout_s)

            def drain() -> None:
                deadline = time.monotonic() + config.server.drain_timeout_s
                while state.in_flight > 0 and time.monotonic() < deadline:
                    time.sleep(0.05)
                self.should_exit = True

            threading.Thread(target=drain, daemon=True).start()

    server = DrainingServer(
        uvicorn.Config(
            app,
            host=config.server.host,
            port=config.server.port,
            log_level=config.server.log_level,
            ssl_keyfile=config.server.ssl_keyfile,
            ssl_certfile=config.server.ssl_certfile,
            ssl_ca_certs=config.server.ssl_ca_certs,
            # A CA file is for checking client certificates: then every client must present one.
            ssl_cert_reqs=ssl.CERT_REQUIRED if config.server.ssl_ca_certs else ssl.CERT_NONE,
            # Bounds the exit after a fatal error (or a drain that timed out): open responses get
            # this long to end before their connections are closed.
            timeout_graceful_shutdown=FATAL_GRACE_S,
        )
    )
    failed = threading.Event()

    def fatal(what: str) -> None:
        """The engine cannot serve any more: stop serving and exit non-zero (any thread)."""
        failed.set()
        logger.error("%s: exiting with status 1 so that a supervisor can restart the server", what)
        server.should_exit = True

    def on_dead(name: str) -> Callable[[BaseException], None]:
        # Runs on the engine thread after it has failed every request (the traceback is logged there).
        many = len(served) > 1
        return lambda e: fatal(f"the engine{f' of {name}' if many else ''} stopped ({type(e).__name__})")

    def warm(model: ServedModel) -> None:
        service = model.engine
        try:
            service.start()
        except BaseException as e:
            if isinstance(service, EngineClient):  # the core process logged its traceback
                logger.error("warmup failed (%s): %s", model.names[0], e)
            else:
                logger.exception("warmup failed")
            service.dead = e  # /health answers 503 until the exit
            fatal(f"warmup failed ({type(e).__name__})")
            return
        if not follows_parent:
            logger.info("model %s ready on %s", model.names[0], url)

    def watch(sibling: multiprocessing.process.BaseProcess) -> None:
        sibling.join()
        if not server.should_exit and not server.draining:
            fatal(f"front end {sibling.name} exited (code {sibling.exitcode})")

    for model in served:
        model.engine.on_dead = on_dead(model.names[0])
        threading.Thread(target=warm, args=(model,), name=f"warmup-{model.names[0]}", daemon=True).start()
    for sibling in siblings:
        threading.Thread(target=watch, args=(sibling,), name=f"watch-{sibling.name}", daemon=True).start()
    server.run(sockets=list(sockets) if sockets else None)
    if not told:  # (a fatal error, not a signal) they drain too
        tell_siblings()
    for sibling in siblings:  # they drain their own requests before the engine stops
        sibling.join(timeout=config.server.drain_timeout_s + 2 * FATAL_GRACE_S)
        if sibling.is_alive():
            sibling.kill()
        elif sibling.exitcode:
            failed.set()
    for model in served:
        model.engine.shutdown()  # on a multi-host mesh this also ends the followers' loops
    return 1 if failed.is_set() else 0
