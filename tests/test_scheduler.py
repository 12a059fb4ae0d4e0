"""The scheduler inside the real engine core on a fake device (``FakeCore``: no model, no JAX):
budget and order, admission, preemption, prefix hits, n > 1 copy-on-write, penalty slots, aborts."""

from __future__ import annotations

import pytest

from myserve.core.sequence import SeqStatus
from myserve.testing import FakeCore, assert_consistent
from myserve.wire.params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
PENALTY = SamplingParams(max_tokens=8, temperature=1.0, frequency_penalty=0.5, seed=1)


def engine(
    num_pages: int = 64,
    page_size: int = 4,
    *,
    max_num_seqs: int = 4,
    budget: int = 16,
    chunk: int | None = None,
    max_prefill_chunks: int | None = None,
) -> FakeCore:
    # max_prefill_chunks as the buckets give it: ``tokens // block_tokens`` of the largest bucket.
    blocks = 1 if max_prefill_chunks is None else budget // max_prefill_chunks
    return FakeCore(
        num_pages=num_pages, page_size=page_size, max_num_seqs=max_num_seqs, budget=budget, chunk=chunk,
        block_tokens=blocks,
    )  # fmt: skip


def prompt(n: int, start: int = 10) -> list[int]:
    return list(range(start, start + n))


def test_decodes_first_oldest_first_then_prefill_under_the_budget() -> None:
    e = engine(budget=10)
    a, b = e.submit(prompt(3), GREEDY)[0], e.submit(prompt(4, 50), GREEDY)[0]
    e.step()  # both prompts fit in one step: 3 + 4 tokens
    assert a.output_ids and b.output_ids
    (c,) = e.submit(prompt(30, 100), GREEDY)
    batch = e.step()
    assert [ch.seq for ch in batch.decodes] == [a, b]  # decodes, oldest admitted first
    assert [(ch.seq, ch.num_tokens) for ch in batch.prefills] == [(c, 8)]  # what the budget leaves
    batch = e.step()
    assert [ch.seq for ch in batch.decodes] == [a, b] and batch.prefills[0].start == 8
    assert_consistent(e.scheduler, e.live)


def test_prefill_chunks_are_capped_and_admission_respects_max_num_seqs() -> None:
    e = engine(budget=64, chunk=5, max_num_seqs=2)
    seqs = [e.submit(prompt(12, 20 * i), GREEDY)[0] for i in range(3)]
    batch = e.step()
    assert [(ch.seq, ch.num_tokens) for ch in batch.prefills] == [(seqs[0], 5), (seqs[1], 5)]
    assert list(e.scheduler.waiting) == [seqs[2]]  # max_num_seqs running: the third waits
    e.run()
    assert all(s.finish_reason == "length" and len(s.output_ids) == 8 for s in seqs)
    assert e.scheduler.allocator.num_used == 0


def test_preemption_takes_the_newest_and_requeues_it_at_the_front() -> None:
    # 6 pages of 4 tokens; three 7-token prompts take 2 pages each, then must grow.
    e = engine(num_pages=6, budget=32)
    seqs = [e.submit(prompt(7, 20 * i), PENALTY)[0] for i in range(3)]
    (late,) = e.submit(prompt(3, 90), GREEDY)
    e.step()
    assert all(s.status is SeqStatus.RUNNING for s in seqs) and late.status is SeqStatus.WAITING
    assert all(s.slot is not None for s in seqs)
    assert not e.step().preempted  # position 7 still fits in the second page
    batch = e.step()  # position 8 needs a third page for each: the pool has none left
    assert batch.preempted == [seqs[2]]  # newest admitted goes first
    assert list(e.scheduler.waiting)[:2] == [seqs[2], late]  # at the front, before later arrivals
    # Its pages and its penalty slot went back with it (the slot once leaked here).
    assert seqs[2].pages == [] and seqs[2].slot is None and seqs[2].num_computed == 0
    assert e.scheduler.slots.num_free == e.scheduler.slots.num_slots - 2
    assert_consistent(e.scheduler, e.live)
    e.run()
    # Recomputed and finished; the readmitted penalty sequence got a slot filled again.
    assert all(len(s.output_ids) == 8 for s in seqs) and e.scheduler.num_preemptions >= 1
    assert e.scheduler.slots.num_free == e.scheduler.slots.num_slots
    assert_consistent(e.scheduler, e.live)


def test_readmission_fills_the_penalty_slot_again() -> None:
    e = engine(num_pages=6, budget=32)
    seqs = [e.submit(prompt(7, 20 * i), PENALTY)[0] for i in range(3)]
    first = e.step()
    assert first.fill_slots == seqs
    fills = []
    while e.scheduler.has_work():
        fills.extend(e.step().fill_slots)
    assert fills and set(fills) <= set(seqs)  # each readmission after a preemption fills its slot


def test_prefix_hit_skips_cached_pages_and_lru_evicts_them_later() -> None:
    e = engine(num_pages=8, page_size=4, budget=64)
    shared = prompt(9)
    (a,) = e.submit(shared + [1], GREEDY)
    e.run()
    alloc = e.scheduler.allocator
    assert alloc.num_used == 0 and alloc.num_free == 8  # cached pages count as free
    (b,) = e.submit(shared + [2, 3], GREEDY)
    batch = e.step()
    assert b.num_prefix_hit_tokens == 8  # two full pages of the shared 9 tokens
    assert batch.prefills[0].start == 8 and batch.prefills[0].num_tokens == 3
    assert b.page_hashes[:2] == a.page_hashes[:2]
    e.run()
    # Fill the pool with other prompts: the unreferenced cached pages are evicted, oldest first.
    for i in range(4):
        e.submit(prompt(7, 100 + 10 * i), GREEDY)
    e.run()
    (c,) = e.submit(shared + [1], GREEDY)
    e.step()
    assert c.num_prefix_hit_tokens < 8
    assert_consistent(e.scheduler, e.live)


def test_n_choices_share_prompt_pages_with_copy_on_write() -> None:
    e = engine(num_pages=32, page_size=4, budget=64)
    params = SamplingParams(max_tokens=6, temperature=1.0, n=3, seed=5)
    parent, *siblings = e.submit(prompt(10), params)
    batch = e.step()
    assert [ch.seq for ch in batch.prefills] == [parent] and not batch.copies  # siblings wait for it
    batch = e.step()
    # Siblings: the 2 full prompt pages shared, the page of the last prompt token copied.
    assert len(batch.copies) == 2 and {src for src, _ in batch.copies} == {parent.pages[2]}
    alloc = e.scheduler.allocator
    assert [alloc.refcount(p) for p in parent.pages[:2]] == [3, 3]
    assert all(s.pages[:2] == parent.pages[:2] and s.num_computed >= 9 for s in siblings)
    assert_consistent(e.scheduler, e.live)
    e.run()
    assert all(len(s.output_ids) == 6 for s in (parent, *siblings)) and alloc.num_used == 0
    assert_consistent(e.scheduler, e.live)


def test_multi_token_chunks_per_step_are_capped() -> None:
    """At most ``max_prefill_chunks`` chunks of more than one token per step (the largest step shape
    holds that many prefill blocks); one-token chunks are not counted, and FIFO order holds."""
    e = engine(num_pages=64, page_size=4, budget=64, max_num_seqs=8, max_prefill_chunks=2)
    seqs = [e.submit(prompt(5, 10 * i), GREEDY)[0] for i in range(4)]
    batch = e.step()
    assert [c.seq for c in batch.prefills] == seqs[:2]
    batch = e.step()
    assert [c.seq for c in batch.decodes] == seqs[:2] and [c.seq for c in batch.prefills] == seqs[2:]
    assert_consistent(e.scheduler, e.live)
    e.run()
    assert all(s.finish_reason == "length" for s in seqs)


@pytest.mark.parametrize("stage", ["waiting", "prefilling", "decoding", "sibling_waiting", "preempted"])
def test_abort_at_every_stage_releases_everything(stage: str) -> None:
    e = engine(num_pages=6, page_size=4, budget=8, chunk=4)
    params = SamplingParams(max_tokens=8, temperature=1.0, presence_penalty=0.3, n=2, seed=3)
    seqs = e.submit(prompt(7), params)
    others = [e.submit(prompt(5, 40 + 10 * i), PENALTY)[0] for i in range(2)]
    target = {"waiting": seqs[0], "prefilling": seqs[0], "decoding": seqs[0], "sibling_waiting": seqs[1]}.get(stage)
    if stage == "prefilling":
        e.step()
        assert 0 < seqs[0].num_computed < 7
    elif stage == "decoding":
        while not seqs[0].output_ids:
            e.step()
        assert seqs[0].status is SeqStatus.RUNNING
    elif stage == "sibling_waiting":
        e.step()
        assert seqs[1].status is SeqStatus.WAITING
    elif stage == "preempted":
        while not e.scheduler.num_preemptions:
            e.step()
        target = next(s for s in e.live if s.status is SeqStatus.WAITING and s.num_tokens > len(s.prompt_ids))
    assert target is not None
    e.abort(target.request_id)
    assert_consistent(e.scheduler, e.live)
    e.run()
    assert all(s.finish_reason == "length" for s in others if s in e.done and s.finish_reason != "abort")
    assert e.scheduler.allocator.num_used == 0 and e.scheduler.slots.num_free == e.scheduler.slots.num_slots
    assert_consistent(e.scheduler, e.live)


def test_an_image_attending_both_ways_is_computed_in_one_step() -> None:
    """Gemma 3's images (``ImageSpan.whole``): a chunk stops before an image it would cut, and one
    that starts inside an image takes it whole or waits, admitting no one before it, until the
    budget holds it (here: two decodes leave 8 of 10 tokens for a 9-token image)."""
    import numpy as np

    from myserve.core.images import ImageSpan

    e = engine(budget=10, max_num_seqs=4)
    (a,) = e.submit(prompt(3), GREEDY)
    e.step()
    (b,) = e.submit(prompt(20, 40), GREEDY)
    b.images = (ImageSpan("ab" * 16, 4, 9, np.zeros((9, 4), np.float32), whole=True),)
    (c,) = e.submit(prompt(3, 80), GREEDY)
    chunks: list[tuple[int, int]] = []
    late = None
    while e.live:
        batch = e.step()
        if batch is None:
            continue
        chunks += [(ch.start, ch.num_tokens) for ch in batch.prefills if ch.seq is b]
        if late is None and len(chunks) == 1 and c.output_ids:  # b waits inside its image: no admission
            (late,) = e.submit(prompt(3, 120), GREEDY)
            assert e.step() is not None and late.status is SeqStatus.WAITING and len(chunks) == 1
    assert chunks[0] == (0, 4)  # stopped before the image
    assert chunks[1][0] == 4 and chunks[1][1] >= 9  # the image whole, once the decodes left room
    assert all(s.finish_reason == "length" for s in (a, b, c, late))
    assert_consistent(e.scheduler, e.live)
