"""The engine core on a fake device: the real ``EngineCore``, scheduler and runner, with a
``Device`` that draws scripted tokens. No JAX, no model: the host-logic tests run in milliseconds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def assert_consistent(scheduler: Any, live: list[Any]) -> None:
    """The host bookkeeping invariants, given the sequences not yet finished or aborted.

    No page is both free and referenced; each refcount equals the references live sequences hold;
    every page is free, evictable (cached, unreferenced) or referenced, exactly one of them; every
    penalty slot is free or owned by exactly one running sequence that knows it.
    """
    from myserve.core.sequence import SeqStatus

    alloc, slots = scheduler.allocator, scheduler.slots
    held = [0] * alloc.num_pages
    for seq in live:
        if seq.status is not SeqStatus.RUNNING:
            assert not seq.pages and seq.slot is None, f"{seq} holds resources while not running"
        for page in seq.pages:
            held[page] += 1
    free, evictable = set(alloc._free), set(alloc._evictable)  # white-box: the allocator's own lists
    assert len(free) == len(alloc._free), "a page is on the free list twice"
    assert not free & evictable, "a page is both free and evictable"
    for page in range(alloc.num_pages):
        refs = alloc.refcount(page)
        assert refs == held[page], f"page {page}: refcount {refs}, held by {held[page]} live sequences"
        assert (refs > 0) + (page in free) + (page in evictable) == 1, f"page {page} is in no state or several"
    owners = {seq.slot: seq for seq in live if seq.slot is not None}
    assert len(owners) == sum(seq.slot is not None for seq in live), "two sequences share a penalty slot"
    for slot in range(slots.num_slots):
        assert slots.owner(slot) is owners.get(slot), f"penalty slot {slot}: pool and sequences disagree"
    for seq in scheduler.running:
        assert seq in live and (seq.slot is not None) == seq.params.uses_penalties, f"{seq}: slot {seq.slot}"
    assert slots.num_free == slots.num_slots - len(owners)


def scripted_token(seed: int, choice: int, position: int) -> int:
    """The token ``FakeDevice`` draws by default for a row: deterministic in the row's seed, choice
    and output position (as the real sampler's key is), never below 3 (no EOS-like id)."""
    return 3 + (seed + 31 * choice + 7 * position) % 200


def fake_pooled(op: Any) -> Any:
    """What ``FakeDevice`` pools: per pooling row, the sum over its pooled tokens of the vector
    (1, token id, position, 0), so a test knows every embedding exactly (a mean of the vectors)."""
    import math

    import numpy as np

    parts, at = [], 0
    for dims in op.shape.array_shapes():
        size = math.prod(dims)
        parts.append(op.batch[at : at + size].reshape(dims))
        at += size
    tokens, positions, pool_rows = parts[0], parts[1][0], parts[15]  # (StepShape.array_shapes order)
    vectors = np.stack([np.ones_like(tokens), tokens, positions, np.zeros_like(tokens)], axis=1).astype(np.float32)
    pooled = np.zeros((op.shape.singles + 1, FAKE_HIDDEN), np.float32)
    np.add.at(pooled, np.where(pool_rows >= 0, pool_rows, op.shape.singles), vectors)
    return pooled[:-1]


FAKE_HIDDEN = 4
"""The width of ``FakeDevice``'s pooled vectors."""


class FakeDevice:
    """A runtime ``Device`` with no JAX and no model, for the engine core's host-logic tests.

    Each sampling row of a ``StepCall`` draws ``script(seed, choice, position)`` (``position``: the
    row's output index), except that a token the row bans (EOS and stop ids under ``min_tokens``)
    or its grammar mask forbids is replaced by the smallest allowed id. Every op is recorded, so a
    test sees what the core asked of the device: page copies, penalty-slot writes, steps.
    """

    def __init__(self, script: Callable[[int, int, int], int] = scripted_token, vocab_size: int = 256):
        self.script = script
        self.vocab_size = vocab_size
        self.ops: list[Any] = []
        """Every op run, in order."""

    @property
    def steps(self) -> list[Any]:
        """The ``StepCall`` ops run so far."""
        from myserve.runtime.step_ops import StepCall

        return [op for op in self.ops if isinstance(op, StepCall)]

    def run(self, ops: Any, progress: Callable[[int, int], None] | None = None) -> list[Any]:
        """Record ``ops``; each ``StepCall``'s sampled rows, as the output handle ``read`` takes."""
        from myserve.runtime.step_ops import CompileSteps, StepCall

        outputs = []
        for op in ops:
            self.ops.append(op)
            if isinstance(op, CompileSteps) and progress is not None:
                progress(op.count, op.count)
            elif isinstance(op, StepCall):
                outputs.append(self._sample(op))
        return outputs

    def _sample(self, op: Any) -> Any:
        import numpy as np

        from myserve.runtime import sampling_rows as rows
        from myserve.runtime.device import StepRead

        ints, n = op.ints, op.ints.shape[0]
        masks = dict(zip(op.mask_rows.tolist(), op.bitmask, strict=True)) if op.bitmask is not None else {}
        steps = max(op.steps, 1)  # a decode call of K tokens: iteration i draws at position + i
        tokens = np.zeros((steps, n), np.int32)
        for r in range(n):
            if not ints[r, rows.WEIGHT]:
                continue  # a padding row
            seed = int(np.int32(ints[r, rows.SEED]).view(np.uint32))
            stops = set(ints[r, rows.NUM_INTS + rows.MAX_BIAS :].tolist()) - {-1}
            mask = masks.get(r)
            for i in range(min(steps, int(ints[r, rows.STEPS])) if op.steps else 1):
                token = self.script(seed, int(ints[r, rows.CHOICE]), int(ints[r, rows.POSITION]) + i)
                banned = stops if i < ints[r, rows.BAN_STEPS] else set()

                def allowed(t: int, banned: set[int] = banned, mask: Any = mask) -> bool:
                    return t not in banned and (mask is None or bool((int(mask[t // 32]) >> (t % 32)) & 1))

                if not allowed(token):
                    token = next(t for t in range(self.vocab_size) if allowed(t))
                tokens[i, r] = token
                if token in stops:
                    break  # the row stops: later iterations are garbage the host never reads
        k = rows.MAX_TOP_LOGPROBS
        t = op.shape.tokens
        scores = (
            np.zeros(t, np.float32),
            np.zeros((t, k), np.int32),
            np.zeros((t, k), np.float32),
            np.ones(t, np.int32),
        )
        if not op.steps:  # a forward and head step: [N1]
            tops = np.zeros((n, k), np.int32), np.zeros((n, k), np.float32)
            return StepRead(tokens[0], np.zeros(n, np.float32), *tops, scores, fake_pooled(op))
        tops = np.zeros((steps, n, k), np.int32), np.zeros((steps, n, k), np.float32)
        return StepRead(tokens, np.zeros((steps, n), np.float32), *tops, scores, None)

    def background_builds_done(self, timeout: float | None = None) -> bool:
        """Nothing is built here: always done."""
        return True

    def stop_background_builds(self) -> None:
        """Nothing is built here: nothing to stop."""

    def memory_stats(self) -> list[dict[str, int]]:
        """No allocator here: nothing to report."""
        return []

    def step_ready(self, shape: Any) -> bool:
        """Nothing is built here: every shape is ready."""
        return True

    def loop_ready(self, shape: Any, steps: int) -> bool:
        """Nothing is built here: every decode call is ready."""
        return True

    def want_step(self, shape: Any) -> None:
        """Nothing is built here: nothing to hurry."""

    def read(self, output: Any, *, tops: bool, scored: bool, pooled: bool = False) -> Any:
        """The step's rows, with top logprobs, prompt scores and pooled rows only when asked for (as
        ``Executor.read``)."""
        return output._replace(
            top_ids=output.top_ids if tops else None,
            top_logprobs=output.top_logprobs if tops else None,
            scores=output.scores if scored else None,
            pooled=output.pooled if pooled else None,
        )


class FakeTokenizer:
    """What the engine core reads of a tokenizer when no request is constrained: its EOS ids."""

    def __init__(self, eos_token_ids: tuple[int, ...] = (2,)):
        self.eos_token_ids = eos_token_ids
        self.hf = None  # the grammar compiler is built on first use only: a constrained request needs a real one


class FakeCore:
    """The real ``EngineCore`` on a ``FakeDevice``, driven step by step on the calling thread.

    ``submit`` queues a request through ``EngineCore.add`` and admits it; ``step`` runs one loop
    iteration (``EngineCore.run_once``) and returns the ``ScheduledBatch`` it planned; every delta
    the core emits is kept in ``outputs``. For tests of the scheduler, the pages, the penalty
    slots and the core's finish and post-processing, in milliseconds and without JAX.
    """

    def __init__(
        self,
        *,
        num_pages: int = 64,
        page_size: int = 4,
        max_num_seqs: int = 4,
        budget: int = 16,
        chunk: int | None = None,
        token_buckets: tuple[int, ...] | None = None,
        block_tokens: int = 32,
        max_model_len: int = 256,
        prefix_cache: bool = True,
        overlap: bool = False,
        device: FakeDevice | None = None,
        tokenizer: Any = None,
        vocab_size: int = 256,
        max_waiting: int = 1024,
        pooler: Any = None,
        decode_steps: int = 1,
        decode_call_budget_s: float = 0.0,
        host_pages: int = 0,
    ):
        """``host_pages``: slots of a host tier of the prefix cache (0: none);
        ``pooler``: a ``wire.pooling.Pooler`` (its ``hidden_size`` ``FAKE_HIDDEN``) to serve embeddings;
        ``decode_steps``: tokens per several-token decode call (``engine.decode_steps``), paced by
        ``decode_call_budget_s`` (``engine.decode_call_budget_ms``; 0: no limit)."""
        import math

        from myserve.core.engine_core import EngineCore
        from myserve.core.host_tier import HostTier
        from myserve.core.pages import PageAllocator
        from myserve.core.replica import Replica
        from myserve.core.runner import ModelRunner
        from myserve.core.scheduler import Scheduler
        from myserve.runtime.buckets import Buckets
        from myserve.wire.outputs import RequestOutput

        tokenizer = tokenizer if tokenizer is not None else FakeTokenizer()
        self.device = device if device is not None else FakeDevice(vocab_size=vocab_size)
        buckets = Buckets(
            tokens=token_buckets or tuple(sorted({1, budget})),
            max_num_seqs=max_num_seqs,
            page_size=page_size,
            max_pages=math.ceil(max_model_len / page_size),
            block_tokens=min(block_tokens, budget),
            chunk_pages=2,
        )
        host = HostTier(host_pages) if host_pages else None
        allocator = PageAllocator(num_pages, page_size, enable_prefix_cache=prefix_cache, host=host)
        self.scheduler = Scheduler(
            allocator,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_prefill_chunk=chunk or budget,
            max_prefill_chunks=buckets.max_prefill_chunks,
        )
        runner = ModelRunner(
            self.device,
            buckets=buckets,
            max_num_seqs=max_num_seqs,
            eos_ids=tokenizer.eos_token_ids,
            decode_steps=decode_steps,
            decode_call_budget_s=decode_call_budget_s,
        )
        self.core = EngineCore(
            [Replica(allocator, self.scheduler, runner)],
            tokenizer,
            vocab_size=vocab_size,
            num_pages=num_pages,
            max_model_len=max_model_len,
            max_waiting=max_waiting,
            async_scheduling=overlap,
            pooler=pooler,
        )
        self.outputs: list[RequestOutput] = []
        self.core.sink = self.outputs.extend
        self.batches: list[Any] = []
        """Every ``ScheduledBatch`` planned, in order."""
        self.on_schedule: Callable[[Any], None] | None = None
        """Called with each ``ScheduledBatch`` as it is planned (e.g. to check its layout)."""
        schedule = self.scheduler.schedule

        def recording(weights: int = 0) -> Any:
            batch = schedule(weights)
            self.batches.append(batch)
            if self.on_schedule is not None:
                self.on_schedule(batch)
            return batch

        self.scheduler.schedule = recording  # type: ignore[method-assign]
        self._ids = 0
        self.seqs: list[Any] = []
        """Every choice submitted, in order."""

    def submit(self, prompt: list[int], params: Any, request_id: str | None = None) -> list[Any]:
        """Queue and admit a request; its choices' ``Sequence``s."""
        self._ids += 1
        request_id = request_id or f"r{self._ids}"
        self.core.add(request_id, prompt, params)
        self.core.drain_inbox()
        seqs = [seq for seq in self.core.sequences() if seq.request_id == request_id]
        self.seqs.extend(seqs)
        return seqs

    def abort(self, request_id: str, choice: int | None = None) -> None:
        """Abort a request (or one choice) through the core's inbox, applied now."""
        self.core.abort(request_id, choice)
        self.core.drain_inbox()

    def step(self) -> Any:
        """One engine loop iteration; the batch it scheduled (None when it scheduled none)."""
        before = len(self.batches)
        self.core.run_once()
        return self.batches[-1] if len(self.batches) > before else None

    @property
    def live(self) -> list[Any]:
        """Choices submitted and not yet finished or aborted."""
        return [seq for seq in self.seqs if seq.finish_reason is None]

    @property
    def done(self) -> list[Any]:
        """Choices finished or aborted."""
        return [seq for seq in self.seqs if seq.finish_reason is not None]

    def has_work(self) -> bool:
        """Whether a sequence waits or runs, or a step is in flight."""
        return self.core.has_work()

    def run(self, max_steps: int = 10_000) -> int:
        """Step until nothing is left; the number of steps taken."""
        for i in range(max_steps):
            if not self.core.run_once():
                return i + 1
        raise AssertionError(f"work left after {max_steps} steps: {self.scheduler.running} {self.scheduler.waiting}")

    def finished(self, request_id: str) -> dict[int, tuple[list[int], str | None]]:
        """A request's choices as delivered: (token ids, finish reason) per choice."""
        got: dict[int, tuple[list[int], str | None]] = {}
        for out in self.outputs:
            if out.request_id == request_id and out.choice >= 0:
                tokens, finish = got.get(out.choice, ([], None))
                got[out.choice] = ([*tokens, *out.token_ids], out.finish_reason or finish)
        return got
