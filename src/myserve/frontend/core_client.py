"""EngineClient: the HTTP front end's handle on an engine core running in its own process.

It has the face of ``GenerationService`` that the app, the metrics and ``serve`` use (``submit``,
``abort``, ``stats``, ``ready``, ``dead``, ``on_dead``, ``start``, ``shutdown``, ``tokenizer``,
``max_model_len``, ``vocab_size``), and keeps the front half of generation in this process:
requests are validated here (token ranges, context length, grammars: compiled here to be checked,
and again in the core, which holds the matchers), and the core's token deltas become text in an
``OutputProcessor`` on a receiver thread, which also watches the core: if its process dies, every
open request ends with an engine error, ``dead`` is set and ``on_dead`` runs, within a second.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import multiprocessing.process
import os
import select
import shutil
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import zmq

from myserve.errors import ConfigError
from myserve.frontend.core_admin import CoreAdmin
from myserve.frontend.images import ImageSupport
from myserve.frontend.output_processor import OutputProcessor
from myserve.frontend.peer_guard import PeerGuard
from myserve.frontend.stream import RequestStream, settle
from myserve.grammar import LazyGrammars
from myserve.tokenizer import Tokenizer
from myserve.validation import validate_request
from myserve.wire import messages as msg
from myserve.wire.images import ImageInput, ImageModel
from myserve.wire.link import CoreLink
from myserve.wire.outputs import EngineDead, EngineSleeping, EngineStats, Overloaded, RequestOutput, Usage
from myserve.wire.params import SamplingParams
from myserve.wire.pooling import Pooler

if TYPE_CHECKING:
    from myserve.config import Config

logger = logging.getLogger(__name__)

_WATCH_S = 0.2
"""How often the receiver checks that the core process is alive while no message comes."""

CoreMain = Callable[["Config", Sequence[CoreLink]], None]
"""The core process's entry point (``myserve.core.process.run_core``). The assembly (``serve``,
``myserve.testing``) passes it in, so that the front end imports nothing of the core: the spawned
process imports it when it unpickles its target."""


class EngineClient(CoreAdmin):
    """A ``GenerationService`` look-alike whose engine core runs in a child process.

    ``EngineClient(config, load_tokenizer, core_main=run_core, front_ends=N)`` starts the core for N
    front ends and is front end 0; ``links[i]`` are the others', which ``EngineClient.attach`` uses in their processes.
    """

    def __init__(
        self,
        config: Config,
        load_tokenizer: Callable[[], Tokenizer],
        *,
        core_main: CoreMain | None = None,
        front_ends: int = 1,
        link: CoreLink | None = None,
    ):
        """Start the core process running ``core_main`` (or, given the ``link`` of a core started
        elsewhere, attach to it); ``load_tokenizer`` runs on a thread meanwhile (``wait_loaded`` joins
        both)."""
        if (core_main is None) == (link is None):
            raise TypeError("EngineClient needs core_main (to start a core) or link (to attach to one)")
        self.config = config
        self.ready = threading.Event()
        self.dead: BaseException | None = None
        self.on_dead: Callable[[BaseException], None] | None = None
        """Called once (receiver thread) after the core died and every open request was failed."""
        self.vocab_size = 0
        self.max_model_len = 0
        self.pooler: Pooler | None = None
        """How the model makes embeddings, as the core said on loading (None: it makes none)."""
        self.generation_defaults: dict[str, float] = {}
        """Request defaults from the model's generation config, as the core said on loading."""
        self._adapters: dict[str, str] = {}
        self._answers: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
        self.sleep_state = {"is_sleeping": False, "level": 0}
        self.max_waiting = config.engine.max_waiting
        self._stats: EngineStats | None = None
        self._added_since_stats = 0
        self._send_lock = threading.Lock()
        self._owner = link is None
        # Linux: abstract socket names, which vanish with their processes (a SIGKILL leaves no
        # files behind); elsewhere files in a 0700 temporary directory, removed on shutdown. Either
        # way only the core process may connect (PeerGuard).
        self._dir = "" if link is not None or sys.platform.startswith("linux") else tempfile.mkdtemp(prefix="myserve-")
        base = f"{self._dir}/" if self._dir else f"@myserve-{os.getpid()}-{uuid.uuid4().hex[:12]}-"
        self.links = [
            CoreLink(i, f"ipc://{base}to-core-{i}", f"ipc://{base}from-core-{i}")
            for i in range(front_ends if link is None else 0)
        ]
        self.link = link or self.links[0]
        self._context = zmq.Context()
        self._context.setsockopt(zmq.LINGER, 0)  # nothing to deliver to a core that has gone
        # No send limit: a send never waits on a live core. A send with no core connected (it died,
        # or has not connected yet) fails at once instead of blocking (_send).
        self._context.setsockopt(zmq.SNDHWM, 0)
        self._guard = PeerGuard(self._context)
        self._out = self._context.socket(zmq.PUSH)
        self._guard.protect(self._out)
        self._out.bind(self.link.to_core)
        self._in = self._context.socket(zmq.PULL)
        self._guard.protect(self._in)
        self._in.bind(self.link.from_core)
        self._open: dict[str, RequestStream] = {}
        self._open_lock = threading.Lock()
        self._stopping = False
        self._loaded = threading.Event()
        self._started = threading.Event()
        self._startup_error: BaseException | None = None
        self._tokenizer: Tokenizer | None = None
        self.images: ImageSupport | None = None  # a vision-language model's image input (wait_loaded)
        self._image_model: ImageModel | None = None  # what the core's Loaded said of it
        self._tokenizer_error: BaseException | None = None

        def load() -> None:
            try:
                self._tokenizer = load_tokenizer()
            except BaseException as e:  # reported by wait_loaded, after the core's own verdict
                self._tokenizer_error = e

        self._tokenizer_thread = threading.Thread(target=load, name="tokenizer", daemon=True)
        self._tokenizer_thread.start()
        self.process: multiprocessing.process.BaseProcess | None = None
        self._core_fd: int | None = None
        if core_main is not None:
            self.process = multiprocessing.get_context("spawn").Process(
                target=core_main, args=(config, self.links), name="myserve-core", daemon=True
            )
            self.process.start()
            assert self.process.pid is not None
            self._guard.allow(self.process.pid)
            self.links = [dataclasses.replace(x, core_pid=self.process.pid) for x in self.links]
            self.link = self.links[0]
        else:
            self._guard.allow(self.link.core_pid)
            # Not our child: a pidfd turns readable when the core ends (Linux); os.kill otherwise.
            try:
                self._core_fd = os.pidfd_open(self.link.core_pid)
            except (AttributeError, OSError):
                self._core_fd = None
        self._in_loop: asyncio.AbstractEventLoop | None = None
        self._reader_stop: Callable[[], None] | None = None
        self._watch: asyncio.TimerHandle | None = None
        self._receiver = threading.Thread(target=self._receive, name="myserve-core-client", daemon=True)
        self._receiver.start()

    @classmethod
    def attach(cls, config: Config, load_tokenizer: Callable[[], Tokenizer], link: CoreLink) -> EngineClient:
        """A further front end of a core that another process started (``--api-server-count``)."""
        return cls(config, load_tokenizer, link=link)

    def _core_alive(self) -> bool:
        if self.process is not None:
            return self.process.is_alive()
        if self._core_fd is not None:
            return not select.select([self._core_fd], [], [], 0)[0]
        try:
            os.kill(self.link.core_pid, 0)
        except ProcessLookupError:
            return False
        return True

    def _exit_note(self) -> str:
        if self.process is not None:
            return f"code {self.process.exitcode}"
        return f"pid {self.link.core_pid}"

    # -- lifecycle ----------------------------------------------------------------------------
    def wait_loaded(self) -> None:
        """Wait until the core has loaded the deployment (warmup goes on) and the tokenizer is here.
        Raises the core's ``ConfigError`` for a configuration it cannot load, ``RuntimeError`` if it
        failed otherwise."""
        self._loaded.wait()
        if self._startup_error is not None:
            raise self._startup_error
        self._tokenizer_thread.join()
        if self._tokenizer_error is not None:
            raise self._tokenizer_error
        self.images = ImageSupport.load(self._image_model, self.config.model)
        self.processor = OutputProcessor(self.tokenizer, abort_choice=self.abort)
        # Validation only: the core compiles each grammar again for its matchers.
        self.grammars = LazyGrammars(self.tokenizer.hf, self.vocab_size, self.tokenizer.eos_token_ids)

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (this process's copy)."""
        assert self._tokenizer is not None, "wait_loaded() first"
        return self._tokenizer

    def start(self, **_: object) -> None:
        """Wait until the core is warmed up (``ready``); raises if it failed to start."""
        self._started.wait()
        if self.dead is not None:
            raise self.dead

    def shutdown(self) -> None:
        """Stop the core (in-flight requests are aborted) and wait for its exit; an attached front
        end only lets go of it."""
        self._stopping = True
        if self.process is not None and self.process.is_alive():
            try:
                self._send(msg.Shutdown())
            except EngineDead:
                pass
            self.process.join(timeout=30)
        if self.process is not None and self.process.is_alive():
            self.process.kill()
        self._receiver.join(timeout=5)
        self._out.close(linger=0)
        self._in.close(linger=0)
        self._context.term()
        if self._core_fd is not None:
            os.close(self._core_fd)
        self.close_sockets_dir()

    # -- front (any thread) -------------------------------------------------------------------
    @property
    def adapter_paths(self) -> dict[str, str]:
        """The LoRA adapters the core serves (name -> path), as it said when loaded."""
        return dict(self._adapters)

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        images: Sequence[ImageInput] = (),
    ) -> RequestStream:
        """Queue a request (and its prompt's images); its stream of deltas. Raises on invalid or excess requests."""
        if self.dead is not None:
            raise EngineDead(f"engine stopped: {self.dead}")
        if self.sleep_state.get("is_sleeping"):
            raise EngineSleeping("the engine is sleeping: POST /wake_up first")
        prompt = [int(t) for t in prompt_ids]
        validate_request(
            prompt,
            params,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            grammars=self.grammars,
            pooler=self.pooler,
        )
        waiting = self._stats.waiting if self._stats is not None else 0
        if waiting + self._added_since_stats >= self.max_waiting:
            raise Overloaded(f"the waiting queue is full ({self.max_waiting} requests)")
        request_id = request_id or f"req-{uuid.uuid4().hex[:16]}"
        stream = RequestStream(request_id, on_close=self.abort)
        self.processor.track(request_id, prompt, params, stream)
        with self._open_lock:
            self._open[request_id] = stream
        self._added_since_stats += 1
        self._send(msg.AddRequest(request_id, prompt, params, self.link.index, list(images)))
        return stream

    def abort(self, request_id: str, choice: int | None = None) -> None:
        """Abort a request (or one choice) in the core."""
        if self.dead is None and not self._stopping:
            try:
                self._send(msg.AbortRequest(request_id, choice))
            except EngineDead:
                pass  # the core is gone, and the request with it

    def reset_prefix_cache(self) -> None:
        """Ask the core to forget every cached prompt prefix."""
        self._send(msg.ResetPrefixCache())

    def stats(self) -> EngineStats:
        """The core's counters as of its last report (at most ``STATS_INTERVAL_S`` old)."""
        return self._stats if self._stats is not None else EngineStats(0, 0, 0, 0, 0, 0.0, 0, 0, 0, 0, 0, 0, 0, 0)

    def _send(self, message: msg.ToCore) -> None:
        data = msg.encoder.encode(message)
        try:
            with self._send_lock:
                self._out.send(data, flags=zmq.NOBLOCK)
        except zmq.Again:
            raise EngineDead("the engine core is not connected") from None

    # -- receiving: a thread, or the front end's event loop ---------------------------------------
    async def receive_in_loop(self) -> None:
        """Move the reading of the core's messages onto the running event loop (the app's startup
        calls this): each message is read, detokenized and put on its streams in the loop that
        serves them, with one wake-up instead of a receiver thread's plus the loop's. One loop at
        a time; ``leave_loop`` (the app's shutdown) hands it back to a thread."""
        if self._in_loop is not None or self.dead is not None or self._stopping:
            return
        self._in_loop = asyncio.get_running_loop()
        # The thread sees _in_loop within _WATCH_S and stops: one reader at a time.
        await asyncio.to_thread(self._receiver.join)
        if self.dead is None and not self._stopping:
            self._start_reader()

    async def leave_loop(self) -> None:
        """Hand the reading back to a thread (the loop that took it is shutting down)."""
        if self._in_loop is not asyncio.get_running_loop():
            return
        if self._reader_stop is not None:
            self._reader_stop()
        self._reader_stop, self._in_loop = None, None
        if self.dead is None and not self._stopping:
            self._receiver = threading.Thread(target=self._receive, name="myserve-core-client", daemon=True)
            self._receiver.start()

    def _receive(self) -> None:
        poller = zmq.Poller()
        poller.register(self._in, zmq.POLLIN)
        # The front end that started the core reads until the core has gone (its last outputs);
        # an attached one stops when it shuts down (the core lives on for the others).
        while self._in_loop is None and not (self._stopping and self.process is None):
            if not poller.poll(timeout=int(_WATCH_S * 1000)):
                if self._core_gone():
                    return
                continue
            if self._handle(self._in.recv()):
                return

    def _start_reader(self) -> None:
        """Read in the loop: a reader callback on the socket's file descriptor, and a watch of the
        core every ``_WATCH_S`` (cheaper per message than awaiting a zmq.asyncio poll)."""
        loop = self._in_loop
        assert loop is not None
        fd = int(self._in.getsockopt(zmq.FD))
        heard = [True]

        def readable() -> None:
            # ZeroMQ's descriptor signals edges: drain until nothing is left, then wait again.
            while int(self._in.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                heard[0] = True
                if self._handle(self._in.recv(zmq.NOBLOCK)):
                    stop()
                    return

        def watch() -> None:
            if not heard[0] and self._core_gone():
                stop()
                return
            heard[0] = False
            self._watch = loop.call_later(_WATCH_S, watch)

        def stop() -> None:
            loop.remove_reader(fd)
            if self._watch is not None:
                self._watch.cancel()

        self._reader_stop = stop
        loop.add_reader(fd, readable)
        self._watch = loop.call_later(_WATCH_S, watch)
        readable()  # what arrived before the reader was added

    def _core_gone(self) -> bool:
        """No message came: is the core gone (its last words read)? Then fail what is open."""
        if self._core_alive() or self._in.poll(timeout=0):
            return False
        if not self._stopping:
            self._died(f"the engine core process exited ({self._exit_note()})")
        return True

    def _handle(self, data: bytes) -> bool:
        """One message from the core; True when it was the last (the core died)."""
        message = msg.from_core.decode(data)
        if isinstance(message, msg.Outputs):
            if message.stats is not None:  # first: whoever reads a delivered final sees them
                self._stats, self._added_since_stats = message.stats, 0
            self._deliver(message.outputs)
        elif isinstance(message, msg.Heartbeat):
            self._stats, self._added_since_stats = message.stats, 0
        elif isinstance(message, msg.Loaded):
            self.vocab_size, self.max_model_len = message.vocab_size, message.max_model_len
            self.max_waiting = message.max_waiting
            self.pooler = message.pooler
            self.generation_defaults = message.generation_defaults
            self._adapters = dict(message.adapters)
            self._image_model = message.images
            self._loaded.set()
        elif isinstance(message, msg.AdaptersChanged | msg.WeightsChanged | msg.SleepChanged):
            answer: object = message.error
            if isinstance(message, msg.WeightsChanged):
                answer = (message.error, message.version)
            elif isinstance(message, msg.SleepChanged):
                self.sleep_state = dict(message.state)
                answer = (message.error, self.sleep_state)
            else:
                self._adapters = dict(message.adapters)
            waiting = self._answers.get(message.token)
            if waiting is not None:
                loop, future = waiting
                loop.call_soon_threadsafe(settle, future, answer)
        elif isinstance(message, msg.Ready):
            self.ready.set()
            self._started.set()
        else:
            if message.config_error:
                self._startup_error = ConfigError(message.message)
            self._died(message.message)
            return True
        return False

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        self.processor.process(outputs)
        finals = [o.request_id for o in outputs if o.final]
        if finals:
            with self._open_lock:
                for request_id in finals:
                    self._open.pop(request_id, None)

    def _died(self, message: str) -> None:
        """The core is gone: fail every open request, then tell the server."""
        if not self._loaded.is_set() and self._startup_error is None:
            self._startup_error = RuntimeError(f"the engine core failed to load: {message}")
        if self._startup_error is None or not isinstance(self._startup_error, ConfigError):
            logger.error("%s", message)
        self.dead = EngineDead(message)
        with self._open_lock:
            open_ids, self._open = list(self._open), {}
        error = f"engine error: {message}"
        self._loaded.set()
        self._started.set()
        if open_ids:  # (none before loading: nothing can be submitted until then)
            self.processor.process(RequestOutput(rid, -1, usage=Usage(0, 0), error=error) for rid in open_ids)
        self._tell_server()

    def _tell_server(self) -> None:
        if self.on_dead is not None and self.ready.is_set():
            assert self.dead is not None
            self.on_dead(self.dead)

    def close_sockets_dir(self) -> None:
        """Remove the ipc socket files, if any (the front end that started the core owns them all)."""
        if self._owner and self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
