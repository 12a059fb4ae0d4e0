"""EngineCore: the engine thread that runs continuous batching over token ids.

``add`` (any thread) validates a request and puts it in the inbox; the engine thread drains the
inbox and aborts, plans a step with the scheduler, runs it on the runner, then post-processes:
append sampled tokens, advance grammars, end choices on EOS, stop token ids or length, free
finished sequences' pages, and hand the iteration's token deltas (``RequestOutput``s without text)
to its ``sink`` in one call. The core never detokenizes: text, stop strings and streams belong to
the front half (``frontend/output_processor.py``), which runs beside it in ``GenerationService`` or in
another process (``core/process.py``).
"""

from __future__ import annotations

import gc
import itertools
import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Self, cast

from myserve.core.adapters import AdapterRegistry, check_adapter
from myserve.core.engine_admin import EngineAdmin
from myserve.core.engine_sleep import EngineSleep, Sleeper
from myserve.core.engine_stats import EngineCounters
from myserve.core.engine_weights import EngineWeights, WeightLoader
from myserve.core.images import ImageEncoding, check_images
from myserve.core.pooling import finished_embeddings
from myserve.core.replica import Replica, Request
from myserve.core.request_admission import RequestAdmission
from myserve.core.request_endings import RequestEndings
from myserve.core.runner import PlannedStep, Sample, StepResults
from myserve.core.sequence import Sequence as Seq
from myserve.core.step_timer import StepTimer
from myserve.core.warmup import warm_up
from myserve.grammar import LazyGrammars
from myserve.runtime.background_builds import GATE
from myserve.tokenizer import Tokenizer
from myserve.validation import validate_request
from myserve.wire.images import ImageInput, ImageModel
from myserve.wire.outputs import EngineDead, Overloaded, RequestOutput
from myserve.wire.params import SamplingParams
from myserve.wire.pooling import Pooler

if TYPE_CHECKING:
    from myserve.runtime.deployment import Deployment
    from myserve.runtime.executor import Executor

logger = logging.getLogger(__name__)


Sink = Callable[[list[RequestOutput]], None]
"""Where an engine iteration's token deltas go (called on the engine thread)."""


class EngineCore(EngineCounters, EngineAdmin, EngineWeights, EngineSleep, RequestEndings, RequestAdmission):
    """Continuous batching over the paged KV cache, driven by one background thread.

    The device work is done by one ``Replica`` per data-parallel row of the mesh (usually one).
    """

    def __init__(
        self,
        replicas: Sequence[Replica],
        tokenizer: Tokenizer,
        *,
        vocab_size: int,
        num_pages: int,
        max_model_len: int,
        max_waiting: int = 1024,
        on_shutdown: Callable[[], None] | None = None,
        async_scheduling: bool = True,
        compile_counts: Callable[[], tuple[int, int]] = lambda: (0, 0),
        pooler: Pooler | None = None,
        seed: int | None = None,
        generation_defaults: dict[str, float] | None = None,
        adapters: AdapterRegistry | None = None,
        memory_utilization: float = 0.9,
        weight_loader: WeightLoader | None = None,
        sleeper: Sleeper | None = None,
        image_encoder: ImageEncoding | None = None,
        max_images: int | None = None,
        image_model: ImageModel | None = None,
    ):
        """``image_encoder``: a vision-language model's vision tower (None: prompts take no images);
        ``max_images``: images per prompt at most (None: no bound here); ``image_model``: what the
        front end needs to prepare images for it."""
        self.replicas = list(replicas)
        self.image_encoder = image_encoder
        self.max_images = max_images
        self.image_model = image_model
        self._init_weights(weight_loader)
        self._init_sleep(sleeper)
        self.memory_utilization = memory_utilization
        """``engine.gpu_memory_utilization``: the share of a device the peak after warmup is held to."""
        self.adapters = adapters
        """The LoRA adapters served (None: the engine serves none); touched on the engine thread only
        once it runs."""
        self.generation_defaults = dict(generation_defaults or {})
        """Request defaults from the model's generation config (``runtime/generation_config.py``)."""
        self._seeds = random.Random(seed)
        """Draws the seed of each choice whose request sends none (``engine.seed``)."""
        self.pooler = pooler
        """How the model makes embeddings (None: it serves none)."""
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.num_pages = num_pages
        self.max_waiting = max_waiting
        self._on_shutdown = on_shutdown
        self._compile_counts = compile_counts
        """(compiled, loaded from a cache) executables so far in this process (``runtime/compile_counter``)."""
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._pending = 0  # submitted but not yet admitted to the scheduler (bounded by max_waiting)
        self._pending_lock = threading.Lock()
        self._requests: dict[str, Request] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.ready = threading.Event()
        self.dead: BaseException | None = None
        self.on_dead: Callable[[BaseException], None] | None = None
        """Called once, on the engine thread, after the engine died and failed every request; the
        serve entry point exits on it. Embedded services leave it unset: ``/health`` says 503."""
        self._steps = 0
        self._iteration = 0
        self._inflight: tuple[int, list[PlannedStep]] | None = None
        """The last iteration's dispatched steps, not read yet (overlapped loop)."""
        self.async_scheduling = async_scheduling
        """Plan and dispatch step N+1 before reading step N (``engine.async_scheduling``)."""
        self.grammars = LazyGrammars(tokenizer.hf, vocab_size, tokenizer.eos_token_ids)
        """The engine's grammar compiler (validates requests, makes each sequence's matcher)."""
        self.warmup_since: tuple[float, int, int] | None = None
        """(perf_counter, compiled, loaded) when the deployment began building steps early: the
        warmup log counts from there."""
        self.timer = StepTimer()
        """Host time of the engine loop by phase, and the gap between steps (metrics)."""
        self._max_decode_batch = 0
        self._generated = 0
        self._prompt_computed = 0
        self._ids = itertools.count()
        self.sink: Sink = lambda outputs: None
        """Receives each iteration's token deltas; set before ``start``."""
        self._outbox: list[RequestOutput] = []

    @classmethod
    def from_deployment(cls, dep: Deployment, executors: Sequence[Executor] | None = None) -> Self:
        """A core (not yet started) for a loaded deployment (``core/build.py``; imports JAX)."""
        from myserve.core.build import core_arguments

        replicas, kwargs = core_arguments(dep, executors)
        core = cls(replicas, dep.tokenizer, **kwargs)
        core.warmup_since = dep.prebuild_started
        return core

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self, *, warmup: bool = True, progress: Callable[[int, int], None] | None = None) -> None:
        """Start the engine thread; with ``warmup`` compile every bucket first (``ready`` is set after).

        ``progress(done, total)`` is called per compiled shape; by default a tqdm bar shows it.
        """
        runners = [b for r in self.replicas for b in r.builders if not b.warmed_up]
        if warmup and runners:
            limit = self.memory_utilization
            warm_up(runners, self._compile_counts, since=self.warmup_since, progress=progress, memory_utilization=limit)
        # What the start made (weights, executables, tokenizer: millions of objects) goes to the
        # permanent generation: a full collection, which the requests' garbage triggers now and
        # then, no longer walks it (tens of ms, an outlier step each time). As vLLM does.
        gc.collect()
        gc.freeze()
        self._thread = threading.Thread(target=self._loop, name="myserve-engine", daemon=True)
        self._thread.start()
        self.ready.set()

    def shutdown(self) -> None:
        """Stop the engine thread (in-flight requests are aborted)."""
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout=30)
        for builder in (b for replica in self.replicas for b in replica.builders):
            builder.device.stop_background_builds()
        if self._on_shutdown is not None and not (self._thread is not None and self._thread.is_alive()):
            self._on_shutdown()
            self._on_shutdown = None

    # -- front (any thread) -------------------------------------------------------------------
    def add(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        admitted: bool = False,
        images: Sequence[ImageInput] = (),
    ) -> None:
        """Queue a request, its token deltas to come through ``sink``. Raises on invalid or excess
        requests (``InvalidParams``, ``ContextLengthExceeded``, ``Overloaded``, ``EngineDead``).

        ``admitted``: a front end has already checked the waiting queue (and answers 429 itself), so
        the bound is not checked again here: its view lags the queue by the requests in transit, and
        refusing one of those would fail a request that was told it was accepted. ``images``: the
        prompt's images, their placeholder tokens already in ``prompt_ids`` (``core/images.py``)."""
        if self.dead is not None:
            raise EngineDead(f"engine stopped: {self.dead}")
        self.check_awake()
        prompt = [int(t) for t in prompt_ids]
        limits = dict(vocab_size=self.vocab_size, max_model_len=self.max_model_len, pooler=self.pooler)
        validate_request(prompt, params, grammars=self.grammars, **limits)  # type: ignore[arg-type]
        check_images(prompt, images, self.image_encoder, self.max_images)
        check_adapter(self.adapters, params.adapter)
        with self._pending_lock:
            if not admitted and self._pending + self._num_waiting() >= self.max_waiting:
                raise Overloaded(f"the waiting queue is full ({self.max_waiting} requests)")
            self._pending += 1
        self._inbox.put(("submit", Request(request_id, prompt, params, images)))
        if self.dead is not None:  # died between the check above and the put: nobody will drain it
            raise EngineDead(f"engine stopped: {self.dead}")

    def abort(self, request_id: str, choice: int | None = None) -> None:
        """Abort a request, or one of its choices: freed at the start of the next engine step."""
        self._inbox.put(("abort", (request_id, choice)))

    # -- engine thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            priming: bool | None = True  # as ``ModelRunner.prime_next``: None once every replica is done
            busy, idle_at = False, time.monotonic()  # as last told to the build gate; since when idle
            while not self._stop.is_set():
                idle = not self.has_work()
                if idle == busy:  # background builds wait while this engine serves
                    GATE.set_busy(self, busy := not idle)
                    idle_at = time.monotonic()
                # Idle with executables to prime: after the idle grace (a client's next request may
                # be near), look for requests between primes (or, while the rest still build, every
                # 0.1 s); with none left, wait for a request.
                grace = max(0.0, GATE.grace_s - (time.monotonic() - idle_at)) if idle and priming else 0.0
                timeout = grace or (0.1 if idle and priming is False else None)
                self._drain_inbox(block=idle and not priming, timeout=timeout)
                self._flush()
                if self._stop.is_set():
                    break
                if self.has_work():
                    self._step()
                    self._flush()
                    if priming is None:  # look again once the work is done (see below)
                        priming = True
                    continue
                if grace:
                    continue
                self.timer.idle()  # the next step follows a wait for requests, not a step
                self._sleep_when_idle()
                # Asked again after each spell of work (cheap once none is left): a runner warmed up
                # again (a test's, on its own thread while this one waited) has executables to prime.
                # (Asleep, the devices hold nothing to run them on.)
                priming = None if self.sleep_level else self._prime_next()
        except BaseException as e:  # the engine must never die silently: fail every request
            logger.exception("engine thread crashed")
            self.dead = e
            message = f"engine error: {type(e).__name__}: {e}"
            for req in list(self._requests.values()):
                self._fail(req, message)
            # Requests still in the inbox were never admitted: fail them too, or their streams hang.
            while True:
                try:
                    kind, payload = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "submit":
                    self._fail(payload, message)  # type: ignore[arg-type]
            self._flush()
            if self.on_dead is not None:
                self.on_dead(e)
            return
        finally:
            GATE.set_busy(self, False)  # a stopped engine holds no build back
        for req in list(self._requests.values()):
            self._finish_request(req, "abort")
        self._flush()

    def run_once(self, *, block: bool = False) -> bool:
        """One iteration of the engine loop on the calling thread, for a core whose thread was never
        started (the host-logic tests drive it step by step): admit and abort what is queued,
        dispatch the next step and read the one before, hand the deltas to the sink. Returns
        whether work is left (waiting or running sequences, or a step in flight)."""
        self.drain_inbox(block=block and not self.has_work())
        if self.has_work():
            self._step()
        self._sleep_when_idle()
        self._flush()
        return self.has_work()

    def drain_inbox(self, *, block: bool = False) -> None:
        """Admit the requests and apply the aborts queued since the last iteration (the start of
        every loop iteration; ``block``: wait for one first), and hand their deltas to the sink."""
        self._drain_inbox(block=block)
        self._flush()

    def sequences(self) -> list[Seq]:
        """Every choice of the requests not yet closed, finished ones included (tests, debugging)."""
        return [seq for req in self._requests.values() for seq in req.seqs]

    def _emit(self, output: RequestOutput) -> None:
        self._outbox.append(output)

    def _flush(self) -> None:
        """Hand the deltas gathered since the last flush to the sink, in one call."""
        if self._outbox:
            outputs, self._outbox = self._outbox, []
            t = self.timer.now()
            self.sink(outputs)
            self.timer.lap("deliver", t)

    def has_work(self) -> bool:
        """Whether a sequence waits or runs on some replica, or a step is in flight."""
        return self._inflight is not None or any(r.scheduler.has_work() for r in self.replicas)

    def _prime_next(self) -> bool | None:
        """One replica's next executable run once (``ModelRunner.prime_next``): True if one ran, False if
        some are still building, None when every replica's have all run."""
        states = []
        for rep in self.replicas:
            state = rep.runner.prime_next()
            if state:
                return True
            states.append(state)
        return False if False in states else None

    def _drain_inbox(self, *, block: bool, timeout: float | None = None) -> None:
        try:
            item = self._inbox.get(block=block or timeout is not None, timeout=timeout)
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "submit":
                self._admit(payload)  # type: ignore[arg-type]
            elif kind == "abort":
                request_id, choice = cast(tuple[str, int | None], payload)
                req = self._requests.get(request_id)
                if req is not None:
                    self._finish_request(req, "abort", choice)
            else:
                self._admin(kind, payload) or self._weights_admin(kind, payload) or self._sleep_admin(kind, payload)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        """One loop iteration: schedule and dispatch every replica's next step, then read the steps
        dispatched by the iteration before (overlapped: the host plans step N+1 and handles step
        N's tokens while the device runs N+1) or, without ``async_scheduling``, this one's."""
        timer = self.timer
        if self._inflight is not None and self._constrained_running():
            # A constrained row's mask depends on its token in flight: read it before planning.
            waiting_for, self._inflight = self._inflight, None
            self._read(*waiting_for)
        self._iteration += 1
        t = timer.now()
        timer.plan_started(self._iteration, t)
        dispatched: list[PlannedStep] = []
        weights = self._step_weights()  # (alternating while an old version of the weights drains)
        for rep in self.replicas:
            if not rep.scheduler.has_work():
                continue
            if rep.runner.decode_steps > 1:  # several tokens per decode where a built call holds them
                pages, k = rep.runner.decode_call_pages(), rep.runner.decode_steps
                short = rep.runner.pacer.allows(len(rep.scheduler.running), k)  # (a new request waits for it)
                rep.scheduler.decode_steps = k if pages and short else 1
                rep.scheduler.decode_steps_pages = pages
            batch = rep.scheduler.schedule(weights)
            t = timer.lap("schedule", t)
            if batch.empty:
                continue  # e.g. every running sequence waits for its token in flight
            planned = rep.runner.plan(batch)
            t = timer.lap("plan", t)
            timer.dispatching(self._iteration, t)
            dispatched.append(rep.runner.dispatch(planned))
            # Counted as computed now, its samples in flight: the next step is planned on that.
            rep.scheduler.after_step(batch)
            t = timer.lap("dispatch", t)
            self._steps += 1
            self._max_decode_batch = max(self._max_decode_batch, len(batch.decodes))
            self._prompt_computed += sum(c.num_tokens for c in batch.prefills if not c.draft)
        previous = self._inflight
        if self.async_scheduling:
            self._inflight = (self._iteration, dispatched) if dispatched else None
        else:
            previous, self._inflight = ((self._iteration, dispatched) if dispatched else None), None
        if previous is None:
            if not dispatched:
                timer.idle()  # nothing ran (every waiting sequence is blocked): no gap to count
            return
        self._read(*previous)

    def _read(self, iteration: int, steps: list[PlannedStep]) -> None:
        """Wait for a dispatched iteration's steps and post-process their tokens."""
        timer = self.timer
        for step in steps:
            t = timer.now()
            timer.timeline.append((iteration, "wait", t))
            results = step.runner.collect(step)
            t = timer.lap("read", t)
            timer.read_done(iteration, t)
            self._postprocess(results)
            timer.lap("postprocess", t)

    def _constrained_running(self) -> bool:
        return any(seq.constrained for rep in self.replicas for seq in rep.scheduler.running)

    def _postprocess(self, results: StepResults) -> None:
        """Append a read step's tokens: advance grammars, deliver, finish sequences."""
        for seq, start, lps, ids, tlps, ranks in results.prompt_scores:
            seq.record_prompt_scores(start, lps, ids, tlps, ranks)
        for seq, vector in finished_embeddings(results.pooled, self.pooler):
            owner = self._requests[seq.request_id]
            self._emit(RequestOutput(owner.request_id, 0, finish_reason="stop", embedding=vector))
            self._finish_seq(owner, seq, "stop")
        for seq, samples in results.sampled.items():
            seq.num_inflight -= results.spent.get(seq, len(samples))
            req = self._requests.get(seq.request_id)
            if req is None or seq.finish_reason is not None:
                continue  # finished or aborted while its token was in flight: the token is dropped
            if seq.params.max_tokens == 0:  # only the prompt was wanted (scored): done without a token
                self._emit(seq.prompt_output(finish="length"))
                self._finish_seq(req, seq, "length")
                continue
            self._append(req, seq, samples)
            if seq in results.spent:  # a verified draft: its rejected positions' pages go back
                req.replica.scheduler.trim_pages(seq)

    def _append(self, req: Request, seq: Seq, samples: Sequence[Sample]) -> None:
        """A step's tokens of one choice (K of a several-token call), delivered as one delta."""
        if seq.params.prompt_logprobs is not None and not seq.output_ids:
            self._emit(seq.prompt_output())
        tokens, logprobs, finish, stop_reason = seq.take_samples(samples, self.tokenizer.eos_token_ids)
        if not tokens:
            return
        self._generated += len(tokens)
        version = self._version_label(seq.weights)
        out = RequestOutput(
            req.request_id, seq.choice, tokens, "", logprobs, finish, stop_reason, weights_version=version
        )
        self._emit(out)
        if finish is not None:
            self._finish_seq(req, seq, finish)
