"""The engine core's own process: the deployment, the scheduler loop and the device, fed over ZeroMQ.

``run_core`` is the process's entry point (``serve`` hands it to ``EngineClient``, which starts it
with the spawn method). It loads the deployment, warms up, says ``Ready``, then serves the front
end's messages on its main thread while the ``EngineCore`` thread runs the steps and sends each
iteration's token deltas back.

Failure rules:
- the engine thread dies: every request gets its error (``Outputs``), then ``Died``; the process
  exits 1;
- the front end goes away (its process dies; we are re-parented): the process exits at once, so
  no orphan holds the device. Linux also sends us SIGKILL when the parent dies (``PR_SET_PDEATHSIG``);
- ``Shutdown``: the core aborts what runs and exits 0.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import zmq

from myserve.errors import MyserveError
from myserve.subprocesses import die_with_parent
from myserve.wire import messages as msg

if TYPE_CHECKING:
    from myserve.config import Config
    from myserve.core.engine_core import EngineCore
    from myserve.wire.link import CoreLink

logger = logging.getLogger("myserve.core")

STATS_INTERVAL_S = 0.25
"""Counters ride on outputs at most this often, and on a heartbeat when the core is idle."""


CORE_HOOK_ENV = "MYSERVE_CORE_HOOK"
"""Test-only: ``module:function`` called in the core process before it loads anything (the
supervision tests patch the runner with it to inject device faults)."""


def run_core(config: Config, links: Sequence[CoreLink]) -> None:
    """The core process: load, warm up, serve the front ends of ``links`` until ``Shutdown`` (from
    front end 0, our parent) or the parent's death."""
    parent = os.getppid()
    die_with_parent()
    # The engine thread and this one share the core's GIL: hand it over within 0.5 ms, not 5, when
    # the engine thread comes back from waiting on the device (as serve does in one process).
    sys.setswitchinterval(0.0005)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when we stop (Ctrl-C hits both)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    logging.basicConfig(level=config.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)  # fair-queued over every front end's requests
    outboxes = []
    for link in links:
        inbox.connect(link.to_core)
        outboxes.append(context.socket(zmq.PUSH))
        outboxes[-1].connect(link.from_core)
    send_lock = threading.Lock()

    def send(message: msg.FromCore, front_end: int | None = None) -> None:
        """To one front end, or (None) to all of them."""
        data = msg.encoder.encode(message)
        with send_lock:
            for outbox in outboxes if front_end is None else (outboxes[front_end],):
                if len(data) < 65536:  # zero-copy pays only for large messages
                    outbox.send(data)
                else:
                    outbox.send(data, copy=False)

    hook = os.environ.get(CORE_HOOK_ENV)
    if hook:
        module, _, function = hook.partition(":")
        getattr(importlib.import_module(module), function)()
    try:
        core = _load(config)
    except MyserveError as e:  # a configuration the deployment cannot load: one line, exit 2
        send(msg.Died(str(e), config_error=True))
        _linger(inbox, outboxes)
        os._exit(2)
    except BaseException as e:
        logger.exception("the engine core failed to load")
        send(msg.Died(f"engine failed to load: {type(e).__name__}: {e}"))
        _linger(inbox, outboxes)
        os._exit(1)
    send(
        msg.Loaded(
            core.vocab_size,
            core.max_model_len,
            core.max_waiting,
            core.pooler,
            core.generation_defaults,
            core.adapter_paths,
            core.image_model,
        )
    )
    last_stats = 0.0
    sender: dict[str, int] = {}
    """Request id -> the front end its outputs go to (when there are several)."""

    def sink(outputs: list) -> None:
        nonlocal last_stats
        now = time.monotonic()
        stats = None
        # Due, or a request finished: its caller may read the counters next (tests, metrics).
        if now - last_stats >= STATS_INTERVAL_S or any(o.final for o in outputs):
            stats, last_stats = core.stats(), now
        if len(outboxes) == 1:
            send(msg.Outputs(outputs, stats), 0)
            return
        by_front: list[list] = [[] for _ in outboxes]
        for o in outputs:
            front_end = sender.pop(o.request_id, 0) if o.final else sender.get(o.request_id, 0)
            by_front[front_end].append(o)
        for front_end, its_outputs in enumerate(by_front):
            if its_outputs:
                send(msg.Outputs(its_outputs, stats), front_end)
            elif stats is not None:  # every front end's counters stay as fresh
                send(msg.Heartbeat(stats), front_end)

    died = threading.Event()

    def on_dead(e: BaseException) -> None:
        send(msg.Died(f"engine error: {type(e).__name__}: {e}"))
        died.set()

    core.sink = sink
    core.on_dead = on_dead
    try:
        core.start()
    except BaseException as e:
        logger.exception("warmup failed")
        send(msg.Died(f"warmup failed: {type(e).__name__}: {e}"))
        _linger(inbox, outboxes)
        os._exit(1)
    send(msg.Ready())
    logger.info("engine core ready (pid %d)", os.getpid())
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    code = 0
    while True:
        if died.is_set():
            code = 1
            break
        if os.getppid() != parent:  # the front end died (the death signal covers Linux already)
            logger.error("the front end went away: the engine core exits")
            os._exit(1)
        if not poller.poll(timeout=int(STATS_INTERVAL_S * 1000)):
            if time.monotonic() - last_stats >= STATS_INTERVAL_S:
                last_stats = time.monotonic()
                send(msg.Heartbeat(core.stats()))
            continue
        message = msg.to_core.decode(inbox.recv())
        if isinstance(message, msg.AddRequest):
            if len(outboxes) > 1:
                sender[message.request_id] = message.front_end
            try:
                core.add(message.request_id, message.prompt_ids, message.params, admitted=True, images=message.images)
            except Exception as e:  # validated by the front end already: a race with the core's death
                sender.pop(message.request_id, None)
                send(msg.Outputs([_failed(message.request_id, e)]), message.front_end)
        elif isinstance(message, msg.AbortRequest):
            core.abort(message.request_id, message.choice)
        elif isinstance(message, msg.ResetPrefixCache):
            core.reset_prefix_cache()
        elif isinstance(message, msg.UpdateAdapter):
            core.request_adapter_update(message.name, message.path, _answer(send, message.token))
        elif isinstance(message, msg.UpdateWeights):
            token = message.token

            def weights_done(error: str | None, version: dict[str, object], token: str = token) -> None:
                send(msg.WeightsChanged(token, error, version))  # type: ignore[arg-type]

            core.request_weight_update(message.path, message.version, message.policy, weights_done)
        elif isinstance(message, msg.Sleep):
            sleep_done = _slept(send, message.token)
            if message.level:
                core.request_sleep(message.level, sleep_done)
            else:
                core.request_wake_up(sleep_done)
        else:
            break
    core.shutdown()  # on a multi-host mesh this also ends the followers' loops
    from myserve.runtime import multihost

    multihost.shutdown()
    _linger(inbox, outboxes)
    os._exit(code)


def _slept(send: Callable[[msg.FromCore], None], token: str) -> Callable[[str | None, dict[str, object]], None]:
    """Tells every front end how the sleep or wake-up ``token`` went, and the sleep state now."""

    def done(error: str | None, state: dict[str, object]) -> None:
        send(msg.SleepChanged(token, error, state))  # type: ignore[arg-type]

    return done


def _answer(send: Callable[[msg.FromCore], None], token: str) -> Callable[[str | None, dict[str, str]], None]:
    """Tells every front end how the adapter update ``token`` went, and the adapters served now."""

    def done(error: str | None, adapters: dict[str, str]) -> None:
        send(msg.AdaptersChanged(token, error, adapters))

    return done


def _failed(request_id: str, error: Exception):  # noqa: ANN202 - a RequestOutput
    from myserve.wire.outputs import RequestOutput, Usage

    return RequestOutput(request_id, -1, usage=Usage(0, 0), error=f"{type(error).__name__}: {error}")


def _linger(inbox: zmq.Socket, outboxes: Sequence[zmq.Socket]) -> None:
    """Let queued messages leave before the process exits (bounded): closing the outboxes with a
    linger and terminating the context waits for them (every socket must be closed for that)."""
    inbox.close(linger=0)
    for outbox in outboxes:
        outbox.close(linger=2000)
    inbox.context.term()


def _load(config: Config) -> EngineCore:
    import jax

    from myserve.core.engine_core import EngineCore
    from myserve.runtime import multihost
    from myserve.runtime.cpu_threads import single_threaded_dots_on_small_hosts
    from myserve.runtime.deployment import Deployment
    from myserve.runtime.host_memory import keep_freed_memory
    from myserve.runtime.kv_sizing import use_gpu_share

    use_gpu_share(config.engine)  # before JAX's backend starts
    single_threaded_dots_on_small_hosts()
    multihost.initialize(config.mesh)
    if jax.default_backend() == "cpu":
        keep_freed_memory()  # the steps' temporaries live in host memory: reuse it
    dep = Deployment.load(config, prebuild=True)
    return EngineCore.from_deployment(dep)
