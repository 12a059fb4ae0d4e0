"""A hypothesis state machine over the engine core's host bookkeeping on a fake device (the
real ``EngineCore``, scheduler and runner; no JAX): random submits, steps, choice and request
aborts on a pool small enough that scheduling must preempt. After every rule the page and slot
invariants hold (``assert_consistent``), every step is laid out by the runner's planner into a
step shape and checked (``check_layout``); at the end every request finishes."""

from __future__ import annotations

import functools

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from myserve.core.runner import span_of
from myserve.core.scheduler import ScheduledBatch
from myserve.core.sequence import SeqStatus
from myserve.runtime.buckets import Buckets
from myserve.runtime.step_layout import layout
from myserve.testing import FakeCore, assert_consistent
from myserve.wire.params import SamplingParams

PAGE_SIZE = 4
NUM_PAGES = 8  # 32 tokens: two requests of up to 24 tokens can already need more than that
MAX_LEN = 24


def check_layout(batch: ScheduledBatch, buckets: Buckets, inflight_rows: dict) -> None:
    """The runner's planner on a scheduled step: it fits a step shape, and the layout puts every
    chunk's tokens, positions and pages where the attention reads them; a token still in flight
    is fed from the sampling row of the step before (``inflight_rows``, updated here)."""
    chunks = [*batch.decodes, *batch.prefills]
    spans = [span_of(c, inflight_rows) for c in chunks]
    shape = buckets.fit(spans)  # raises if the scheduler let a step outgrow the largest shape
    host = layout(spans, shape, PAGE_SIZE)
    tokens, positions, q_lens, write_pages, s_idx, _, s_kv, s_pages, b_idx, _, b_kv, _, sample_idx, _, feed, *_ = (
        host.arrays
    )
    at = 0
    for chunk, row in zip(chunks, host.sample_rows, strict=True):
        seq, n = chunk.seq, chunk.num_tokens
        known = seq.tokens(chunk.start, chunk.start + n)
        assert list(tokens[at : at + len(known)]) == known
        if len(known) < n:  # the token sampled by the step in flight: fed on the device
            assert feed[at + n - 1] == inflight_rows[seq] and len(known) == n - 1
        else:
            assert feed[at + n - 1] == -1
        assert list(positions[0, at : at + n]) == list(range(chunk.start, chunk.start + n))
        for j in range(n):
            assert write_pages[0, at + j] == seq.pages[(chunk.start + j) // PAGE_SIZE]
        if n == 1:
            (i,) = np.nonzero(s_idx[:, 0] == at)[0]
            assert s_kv[i] == chunk.start + 1 and list(s_pages[i, : len(seq.pages)]) == seq.pages
        else:
            covered = sorted(int(x) for x in b_idx.ravel() if at <= x < at + n)
            assert covered == list(range(at, at + n))  # every token in exactly one block
            assert set(b_kv[(b_idx[:, 0] >= at) & (b_idx[:, 0] < at + n)]) == {chunk.start + n}
        assert (row is not None) == chunk.samples and (row is None or sample_idx[row] == at + n - 1)
        at += n
    assert q_lens[0] == at
    inflight_rows.clear()
    inflight_rows.update({c.seq: row for c, row in zip(chunks, host.sample_rows, strict=True) if row is not None})


class SchedulerMachine(RuleBasedStateMachine):
    """The engine's host side driven by random traffic."""

    def __init__(self) -> None:
        super().__init__()
        self.engine: FakeCore | None = None
        self.prompts: list[list[int]] = []  # earlier prompts, reused so that prefix hits happen

    @rule(
        max_num_seqs=st.integers(1, 4),
        budget=st.integers(4, 16),
        block_tokens=st.sampled_from([2, 3, 32]),
        prefix_cache=st.booleans(),
        overlap=st.booleans(),
    )
    @precondition(lambda self: self.engine is None)
    def start(self, max_num_seqs: int, budget: int, block_tokens: int, prefix_cache: bool, overlap: bool) -> None:
        budget = max(budget, max_num_seqs)
        block_tokens = min(block_tokens, budget)
        self.engine = FakeCore(
            num_pages=NUM_PAGES,
            page_size=PAGE_SIZE,
            max_num_seqs=max_num_seqs,
            budget=budget,
            token_buckets=(1, 2, budget) if budget > 2 else (1, budget),
            block_tokens=block_tokens,
            max_model_len=MAX_LEN,
            prefix_cache=prefix_cache,
            overlap=overlap,
        )
        buckets = self.engine.core.replicas[0].runner.buckets
        self.engine.on_schedule = functools.partial(check_layout, buckets=buckets, inflight_rows={})

    @rule(
        length=st.integers(1, MAX_LEN - 1),
        reuse=st.booleans(),
        max_tokens=st.integers(1, 12),
        n=st.integers(1, 3),
        penalties=st.booleans(),
        scored=st.booleans(),
    )
    @precondition(lambda self: self.engine is not None)
    def submit(self, length: int, reuse: bool, max_tokens: int, n: int, penalties: bool, scored: bool) -> None:
        assert self.engine is not None
        if reuse and self.prompts:
            base = self.prompts[length % len(self.prompts)]
            tokens = (base + list(range(200, 200 + length)))[:length]
        else:
            tokens = [3 + (17 * len(self.prompts) + 5 * i) % 250 for i in range(length)]
        self.prompts.append(tokens)
        params = SamplingParams(
            max_tokens=min(max_tokens, MAX_LEN - length),
            temperature=1.0,
            n=n,
            frequency_penalty=0.5 if penalties else 0.0,
            prompt_logprobs=1 if scored else None,
        )
        self.engine.submit(tokens, params)  # max_len: prompt + max_tokens, as the service sets it

    @rule(times=st.integers(1, 8))
    @precondition(lambda self: self.engine is not None)
    def step(self, times: int) -> None:
        assert self.engine is not None
        for _ in range(times):
            if self.engine.has_work():
                self.engine.step()

    @rule(data=st.data())
    @precondition(lambda self: self.engine is not None and bool(self.engine.live))
    def abort_request(self, data: st.DataObject) -> None:
        """An abort (client gone, deadline) ends every unfinished choice of a request."""
        assert self.engine is not None
        victim = data.draw(st.sampled_from(self.engine.live))
        self.engine.abort(victim.request_id)

    @rule(data=st.data())
    @precondition(lambda self: self.engine is not None and bool(self.engine.live))
    def stop_one_choice(self, data: st.DataObject) -> None:
        """One choice ends early (the front end aborts it on a stop string): its siblings go on."""
        assert self.engine is not None
        seq = data.draw(st.sampled_from(self.engine.live))
        if seq.output_ids:
            self.engine.abort(seq.request_id, seq.choice)

    @invariant()
    def bookkeeping_is_consistent(self) -> None:
        if self.engine is not None:
            assert_consistent(self.engine.scheduler, self.engine.live)

    def teardown(self) -> None:
        if self.engine is None:
            return
        # Every request still in flight finishes, at its full length, and nothing stays held.
        for _ in range(2_000):
            if not self.engine.has_work():
                break
            self.engine.step()
            assert_consistent(self.engine.scheduler, self.engine.live)
        assert not self.engine.live
        for seq in self.engine.done:
            assert seq.status is SeqStatus.FINISHED
            if seq.finish_reason == "length":
                assert len(seq.output_ids) == seq.params.max_tokens
        sched = self.engine.scheduler
        assert sched.allocator.num_used == 0 and sched.slots.num_free == sched.slots.num_slots
        assert_consistent(sched, [])


SchedulerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestScheduler = SchedulerMachine.TestCase
