"""GenerationService: the engine thread that runs continuous batching, and its thread-safe front.

``submit`` (any thread, usually the asyncio loop) validates a request and puts it in the inbox;
the engine thread drains the inbox and aborts, plans a step with the scheduler, runs it on the
runner, then post-processes: append sampled tokens, detokenize, check stop conditions, deliver
deltas to each request's stream, free finished sequences' pages. Deltas reach asyncio consumers
through ``loop.call_soon_threadsafe``; nothing polls with sleeps.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence

from myserve.engine.detokenizer import IncrementalDetokenizer
from myserve.engine.outputs import (
    ContextLengthExceeded,
    EngineDead,
    EngineStats,
    Overloaded,
    RequestOutput,
    TokenLogprob,
    Usage,
)
from myserve.engine.pages import PageAllocator
from myserve.engine.params import InvalidParams, SamplingParams
from myserve.engine.scheduler import Scheduler
from myserve.engine.sequence import Sequence as Seq
from myserve.engine.stop import StopChecker
from myserve.engine.stream import RequestStream
from myserve.models.quant import MIN_ROWS
from myserve.runtime.batch_layout import DECODE_GROUP
from myserve.runtime.buckets import Buckets
from myserve.runtime.compile_counter import compile_count
from myserve.runtime.deployment import Deployment
from myserve.runtime.runner import ModelRunner
from myserve.runtime.steps import LAYERS_PER_CALL
from myserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class _Request:
    """Engine-thread state of one request: its choices and where their deltas go."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, stream: RequestStream):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.stream = stream
        self.seqs: list[Seq] = []
        self.detok: dict[Seq, IncrementalDetokenizer] = {}
        self.stops: dict[Seq, StopChecker] = {}
        self.unfinished = params.n


def _default_layers_per_call(dep: Deployment) -> int:
    """LAYERS_PER_CALL on CPU, where compiling dominates; the whole model per call on accelerators,
    where a 1B model's decode step computes in about a millisecond and every dispatch shows."""
    platform = dep.mesh.devices.flat[0].platform
    return LAYERS_PER_CALL if platform == "cpu" else dep.spec.num_layers


class GenerationService:
    """Continuous batching over the paged KV cache, driven by one background thread."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        *,
        num_pages: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_waiting: int = 1024,
        enable_prefix_caching: bool = True,
    ):
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = runner.spec.vocab_size
        self.page_size = runner.page_size
        self.num_pages = num_pages
        self.max_waiting = max_waiting
        self.allocator = PageAllocator(num_pages, runner.page_size, enable_prefix_cache=enable_prefix_caching)
        self.scheduler = Scheduler(
            self.allocator,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_prefill_chunk=max_num_batched_tokens,
        )
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._pending = 0  # submitted but not yet admitted to the scheduler (bounded by max_waiting)
        self._pending_lock = threading.Lock()
        self._requests: dict[str, _Request] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.ready = threading.Event()
        self.dead: BaseException | None = None
        self._steps = 0
        self._max_decode_batch = 0
        self._generated = 0
        self._prompt_computed = 0
        self._ids = itertools.count()

    @staticmethod
    def from_deployment(dep: Deployment) -> GenerationService:
        """A service (not yet started) for a loaded deployment, sized by its engine config."""
        cfg = dep.config.engine
        min_rows = MIN_ROWS if dep.config.model.quantization == "int8" else 1
        # The TPU kernel reads the rows layout; the reference attention reads balanced row groups.
        group = DECODE_GROUP if dep.model.attention_backend == "reference" else 1
        buckets = Buckets.from_config(cfg, dep.max_model_len, min_rows, group)
        runner = ModelRunner(
            dep.model,
            dep.mesh,
            dep.mapping,
            num_pages=cfg.num_pages,
            buckets=buckets,
            max_num_seqs=cfg.max_num_seqs,
            eos_ids=dep.tokenizer.eos_token_ids,
            layers_per_call=cfg.layers_per_call or _default_layers_per_call(dep),
        )
        logger.info(
            "engine: %d pages x %d tokens, max_num_seqs=%d, buckets batch=%s prefill rows=%s x %d tokens pages=%s",
            cfg.num_pages,
            cfg.page_size,
            cfg.max_num_seqs,
            buckets.batch,
            buckets.prefill_rows,
            buckets.row_tokens,
            buckets.pages,
        )
        return GenerationService(
            runner,
            dep.tokenizer,
            num_pages=cfg.num_pages,
            max_model_len=dep.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_waiting=cfg.max_waiting,
            enable_prefix_caching=cfg.enable_prefix_caching,
        )

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self, *, warmup: bool = True, progress: Callable[[int, int], None] | None = None) -> None:
        """Start the engine thread; with ``warmup`` compile every bucket first (``ready`` is set after).

        ``progress(done, total)`` is called per compiled shape; by default a tqdm bar shows it.
        """
        if warmup and not self.runner.warmed_up:
            t0 = time.perf_counter()
            if progress is None:
                from tqdm import tqdm

                bar = tqdm(total=len(self.runner.buckets.shapes()), desc="warmup (compiling buckets)", unit="shape")
                compiles = self.runner.warmup(lambda done, total: bar.update(done - bar.n))
                bar.close()
            else:
                compiles = self.runner.warmup(progress)
            logger.info("warmup: %d executables built in %.1fs", compiles, time.perf_counter() - t0)
        self._thread = threading.Thread(target=self._loop, name="myserve-engine", daemon=True)
        self._thread.start()
        self.ready.set()

    def shutdown(self) -> None:
        """Stop the engine thread (in-flight requests are aborted)."""
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout=30)

    # -- front (any thread) -------------------------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None) -> RequestStream:
        """Queue a request; returns the stream of its deltas. Raises on invalid or excess requests."""
        if self.dead is not None:
            raise EngineDead(f"engine stopped: {self.dead}")
        prompt = [int(t) for t in prompt_ids]
        self._validate(prompt, params)
        with self._pending_lock:
            if self._pending + len(self.scheduler.waiting) >= self.max_waiting:
                raise Overloaded(f"the waiting queue is full ({self.max_waiting} requests)")
            self._pending += 1
        request_id = request_id or f"req-{uuid.uuid4().hex[:16]}"
        stream = RequestStream(request_id, on_close=self.abort)
        self._inbox.put(("submit", _Request(request_id, prompt, params, stream)))
        if self.dead is not None:  # died between the check above and the put: nobody will drain it
            raise EngineDead(f"engine stopped: {self.dead}")
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request: its sequences are freed at the start of the next engine step."""
        self._inbox.put(("abort", request_id))

    def _validate(self, prompt: list[int], params: SamplingParams) -> None:
        if not prompt:
            raise InvalidParams("prompt", "the prompt must contain at least one token")
        if any(t < 0 or t >= self.vocab_size for t in prompt):
            raise InvalidParams("prompt", f"prompt token ids must be in [0, {self.vocab_size})")
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids)):
            if any(t < 0 or t >= self.vocab_size for t in ids):
                raise InvalidParams(name, f"{name} token ids must be in [0, {self.vocab_size})")
        if len(params.stop_token_ids) > 16:
            raise InvalidParams("stop_token_ids", "at most 16 stop_token_ids")
        wanted = len(prompt) + (params.max_tokens or 1)
        if wanted > self.max_model_len:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{wanted} tokens ({len(prompt)} in the messages, {params.max_tokens or 1} in the completion). "
                "Please reduce the length of the messages or completion."
            )

    def stats(self) -> EngineStats:
        """Counters for metrics (read without locking: each is a single int read)."""
        return EngineStats(
            waiting=len(self.scheduler.waiting) + self._pending,
            running=len(self.scheduler.running),
            pages_used=self.allocator.num_used,
            pages_free=self.allocator.num_free,
            pages_total=self.num_pages,
            prefix_cache_hit_rate=self.allocator.hit_rate,
            prefix_cache_hit_tokens=self.allocator.prefix_hits,
            prompt_tokens_computed=self._prompt_computed,
            compile_count=compile_count(),
            num_preemptions=self.scheduler.num_preemptions,
            steps=self._steps,
            max_decode_batch=self._max_decode_batch,
            generated_tokens=self._generated,
        )

    # -- engine thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox(block=not self.scheduler.has_work())
                if self._stop.is_set():
                    break
                if self.scheduler.has_work():
                    self._step()
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
            return
        for req in list(self._requests.values()):
            self._finish_request(req, "abort")

    def _drain_inbox(self, *, block: bool) -> None:
        try:
            item = self._inbox.get(block=block)
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "submit":
                self._admit(payload)  # type: ignore[arg-type]
            elif kind == "abort":
                req = self._requests.get(str(payload))
                if req is not None:
                    self._finish_request(req, "abort")
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _admit(self, req: _Request) -> None:
        with self._pending_lock:
            self._pending -= 1
        if req.stream.closed:
            return
        max_len = min(self.max_model_len, len(req.prompt_ids) + (req.params.max_tokens or self.max_model_len))
        self._requests[req.request_id] = req
        for choice in range(req.params.n):
            parent = req.seqs[0] if req.seqs else None
            seq = Seq(req.request_id, choice, req.prompt_ids, req.params, max_len, parent=parent)
            req.seqs.append(seq)
            req.detok[seq] = IncrementalDetokenizer(
                self.tokenizer, req.prompt_ids, skip_special_tokens=req.params.skip_special_tokens
            )
            req.stops[seq] = StopChecker(req.params.stop)
            self.scheduler.add(seq)

    def _step(self) -> None:
        batch = self.scheduler.schedule()
        for seq in batch.preempted:
            self.runner.release(seq)
        if batch.empty:
            return
        results = self.runner.execute(batch)
        self.scheduler.after_step(batch)
        self._steps += 1
        if batch.decodes:
            self._max_decode_batch = max(self._max_decode_batch, len(batch.decodes))
        self._prompt_computed += sum(c.num_tokens for c in batch.prefills)
        for seq, start, lps, ids, tlps in results.prompt_scores:
            self._record_prompt_scores(seq, start, lps, ids, tlps)
        for seq, (token, logprob, top_ids, top_lps) in results.sampled.items():
            req = self._requests.get(seq.request_id)
            if req is None or seq.finish_reason is not None:
                continue
            if seq.params.max_tokens == 0:  # only the prompt was wanted (scored): done without a token
                req.stream.put(self._prompt_output(req, seq, finish="length"))
                self._finish_seq(req, seq, "length")
                continue
            self._append(req, seq, token, logprob, top_ids, top_lps)

    def _record_prompt_scores(self, seq: Seq, start: int, lps, ids, tlps) -> None:
        """Keep the logprob of each prompt token (after the first) computed by a scored chunk."""
        if seq.prompt_scores is None:
            seq.prompt_scores = {}
        k = seq.params.prompt_logprobs or 0
        last = len(seq.prompt_ids) - 1  # position whose next token is still a prompt token, at most
        for j in range(len(lps)):
            pos = start + j
            if pos >= last:
                break
            top = tuple((int(i), float(v)) for i, v in zip(ids[j][:k], tlps[j][:k], strict=True))
            seq.prompt_scores[pos + 1] = TokenLogprob(seq.prompt_ids[pos + 1], float(lps[j]), top)

    def _prompt_output(self, req: _Request, seq: Seq, finish: str | None = None) -> RequestOutput:
        """The delta carrying the prompt's logprobs (first prompt token: None)."""
        scores = seq.prompt_scores or {}
        entries = (None, *(scores.get(i) for i in range(1, len(seq.prompt_ids))))
        return RequestOutput(req.request_id, seq.choice, prompt_logprobs=entries, finish_reason=finish)

    def _append(self, req: _Request, seq: Seq, token: int, logprob: float, top_ids, top_lps) -> None:
        params = seq.params
        if params.prompt_logprobs is not None and not seq.output_ids:
            req.stream.put(self._prompt_output(req, seq))
        seq.output_ids.append(token)
        self._generated += 1
        logprobs = None
        if params.logprobs is not None:
            k = params.logprobs
            top = tuple((int(i), float(v)) for i, v in zip(top_ids[:k], top_lps[:k], strict=True))
            logprobs = (TokenLogprob(token, logprob, top),)
        finish: str | None = None
        stop_reason: str | int | None = None
        text = ""
        if token in params.stop_token_ids:
            finish, stop_reason = "stop", token
        elif not params.ignore_eos and token in self.tokenizer.eos_token_ids:
            finish = "stop"
        else:
            text, stopped = req.stops[seq].feed(req.detok[seq].add([token]))
            if stopped:
                finish, stop_reason = "stop", req.stops[seq].matched
        if finish is None and (len(seq.output_ids) >= (params.max_tokens or 1 << 30) or seq.num_tokens >= seq.max_len):
            finish = "length"
        if finish is not None and not req.stops[seq].stopped:
            # Ending for another reason than a stop string: release held-back text.
            tail, _ = req.stops[seq].feed(req.detok[seq].finish())
            text += tail + req.stops[seq].flush()
        req.stream.put(RequestOutput(req.request_id, seq.choice, (token,), text, logprobs, finish, stop_reason))
        if finish is not None:
            self._finish_seq(req, seq, finish)

    def _finish_seq(self, req: _Request, seq: Seq, reason: str) -> None:
        seq.finish_reason = reason
        self.scheduler.finish(seq)
        self.runner.release(seq)
        req.unfinished -= 1
        if req.unfinished == 0:
            self._close(req)

    def _close(self, req: _Request, error: str | None = None) -> None:
        self._requests.pop(req.request_id, None)
        usage = Usage(
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=sum(len(s.output_ids) for s in req.seqs),
            cached_tokens=max((s.num_prefix_hit_tokens for s in req.seqs), default=0),
        )
        req.stream.put(RequestOutput(req.request_id, -1, usage=usage, error=error))

    def _finish_request(self, req: _Request, reason: str) -> None:
        """Abort every unfinished choice of ``req`` (pages freed now) and close its stream."""
        for seq in req.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = reason
                self.scheduler.finish(seq)
                self.runner.release(seq)
                req.stream.put(RequestOutput(req.request_id, seq.choice, finish_reason=reason))
        req.unfinished = 0
        self._close(req)

    def _fail(self, req: _Request, message: str) -> None:
        for seq in req.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = "error"
                req.stream.put(RequestOutput(req.request_id, seq.choice, finish_reason="error", error=message))
        self._close(req, error=message)
