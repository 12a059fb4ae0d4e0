"""The host-memory tier of the prefix cache (``engine.kv_offloading_size``; ``core/host_tier.py``,
``runtime/host_kv.py``).

Host logic first, in milliseconds: the tier's LRU and pinning, the allocator's saves on eviction
and loads on a hit, their order in a step's ops, the scheduler taking a host hit instead of a
prefill, a full tier evicting. Then the tiny Llama: a multi-turn workload whose prefixes the pool
cannot all hold gives the same greedy tokens with the tier as without, computes fewer prompt
tokens, compiles nothing while serving, and leaves the pool and the tier idle; a tier whose
loads were garbage would not (the test's own control); a one-page tier evicts and keeps serving.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from myserve.config import EngineConfig
from myserve.core.host_tier import HostTier, host_tier_ops
from myserve.core.pages import PageAllocator, chain_hashes
from myserve.errors import ConfigError
from myserve.runtime.step_ops import LoadPages, SavePages, StepCall
from myserve.testing import TINY_ENGINE, FakeCore, assert_consistent, collect, make_tiny_checkpoint, start_service
from myserve.wire.params import SamplingParams


def test_the_tier_keeps_the_most_recently_used_and_never_reuses_a_pinned_slot() -> None:
    tier = HostTier(2)
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    assert tier.store(a) == 0 and tier.store(b) == 1
    assert tier.store(a) is None  # held already: now the most recently used
    assert tier.store(c) == 1 and b not in tier and tier.evicted_pages == 1  # b was the oldest
    assert tier.match([c, a, b]) == [1, 0]  # the run stops at the first miss; both now pinned
    assert tier.store(b) is None and b not in tier  # every slot pinned: nothing is saved
    tier.unpin([0, 1])
    assert tier.store(b) == 1  # c (matched first, so older than a) makes room
    assert tier.num_used == 2 and tier.clear() == 2 and tier.num_used == 0 and tier.store(a) == 0


def test_an_evicted_cached_page_is_saved_and_a_later_prompt_loads_it_back() -> None:
    a = PageAllocator(3, 2, host=HostTier(4))
    tokens = [5, 6, 7, 8, 9, 10, 11]
    hashes = chain_hashes(tokens, 2)
    pages = a.allocate(3)
    for page, h in zip(pages, hashes, strict=True):
        a.cache_page(page, h)
    a.release(pages[::-1])  # as the scheduler releases: the tail is evicted first
    taken = a.allocate(2)  # evicts the two least recently released: the tail pages
    assert taken == [pages[2], pages[1]]
    saves, loads = a.take_transfers()
    assert saves == [(pages[2], 0), (pages[1], 1)] and loads == []
    # The head is still on the device; the rest comes back from the host.
    device = a.match_prefix(hashes, len(tokens))
    assert device == [pages[0]]
    slots = a.match_host(hashes, len(device), len(tokens))
    assert slots == [1, 0]  # hashes[1] is in slot 1, hashes[2] in slot 0
    a.release(taken)
    fresh = a.allocate(2)
    a.load(slots, fresh, hashes[1:3])
    assert a.take_transfers() == ([], list(zip(slots, fresh, strict=True)))
    assert a.match_prefix(hashes, len(tokens)) == [pages[0], *fresh]  # cached again on the device
    a.reset_prefix_cache()
    assert a.host is not None and a.host.num_used == 0


def test_host_tier_ops_put_saves_before_loads() -> None:
    ops = host_tier_ops([(4, 0), (5, 1)], [(1, 9)])
    assert [type(op) for op in ops] == [SavePages, LoadPages]
    assert ops[0].pages.tolist() == [4, 5] and ops[0].slots.tolist() == [0, 1]
    assert ops[1].slots.tolist() == [1] and ops[1].pages.tolist() == [9]
    assert host_tier_ops([], []) == []


def _turns(seed: int, conversations: int, turns: int, system: int, turn: int) -> list[list[list[int]]]:
    """Per conversation, the prompt of each turn: a shared system prompt, then the turns so far."""
    rng = random.Random(seed)
    head = [rng.randrange(3, 200) for _ in range(system)]
    out = []
    for _ in range(conversations):
        said: list[int] = list(head)
        prompts = []
        for _ in range(turns):
            said += [rng.randrange(3, 200) for _ in range(turn)]
            prompts.append(list(said))
        out.append(prompts)
    return out


def _serve_turns(e: FakeCore, convs: list[list[list[int]]]) -> list[list[int]]:
    got = []
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=7)
    for t in range(len(convs[0])):
        for c in convs:
            (seq,) = e.submit(c[t], params)
            e.run()
            assert_consistent(e.scheduler, e.live)
            got.append(e.finished(seq.request_id)[0][0])
    return got


def test_on_the_fake_device_host_hits_replace_prefill_and_transfers_precede_the_step() -> None:
    convs = _turns(0, conversations=6, turns=4, system=12, turn=6)
    plain, tiered = FakeCore(num_pages=24, page_size=4), FakeCore(num_pages=24, page_size=4, host_pages=64)
    assert _serve_turns(plain, convs) == _serve_turns(tiered, convs)
    host = tiered.scheduler.allocator.host
    assert host is not None and host.saved_pages > 0 and host.hit_tokens > 0
    computed = [e.core.stats().prompt_tokens_computed for e in (plain, tiered)]
    assert computed[1] + host.hit_tokens == computed[0]  # every host hit is a token not computed
    # Within each op list, the tier's transfers come first and the saves before the loads.
    ops = tiered.device.ops
    for i, op in enumerate(ops):
        if isinstance(op, LoadPages):
            assert not any(isinstance(o, SavePages) for o in ops[i + 1 : _next_step(ops, i)])
        if isinstance(op, SavePages | LoadPages):
            assert isinstance(ops[_next_step(ops, i)], StepCall)
    alloc = tiered.scheduler.allocator
    assert alloc.num_used == 0 and alloc.transfers_owed == 0  # idle: nothing held, nothing owed


def _next_step(ops: list, i: int) -> int:
    return next(j for j in range(i + 1, len(ops)) if isinstance(ops[j], StepCall))


def test_a_full_tier_evicts_and_keeps_serving() -> None:
    convs = _turns(1, conversations=6, turns=3, system=12, turn=6)
    plain, tiny = FakeCore(num_pages=24, page_size=4), FakeCore(num_pages=24, page_size=4, host_pages=2)
    assert _serve_turns(plain, convs) == _serve_turns(tiny, convs)
    host = tiny.scheduler.allocator.host
    assert host is not None and host.num_used == 2 and host.evicted_pages > 0


def test_the_config_refuses_a_tier_it_cannot_keep() -> None:
    with pytest.raises(ConfigError, match="kv_offloading_size must be >= 0"):
        EngineConfig(kv_offloading_size=-1)
    with pytest.raises(ConfigError, match="needs engine.enable_prefix_caching"):
        EngineConfig(kv_offloading_size=1, enable_prefix_caching=False)
    with pytest.raises(ConfigError, match="draft model"):
        EngineConfig(kv_offloading_size=1, speculative_method="draft_model", speculative_model="x")


# -- the tiny Llama ---------------------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
POOL = ("engine.num_pages=64",)  # 512 tokens: two thirds of the workload's prefixes
TIER = "engine.kv_offloading_size=0.0002"  # ~50 pages of the tiny Llama in float32


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint("llama3", tmp_path_factory.mktemp("host_tier") / "llama", seed=0)


@pytest.fixture(scope="module")
def served_without(checkpoint):
    svc = start_service(checkpoint, *TINY_ENGINE, *POOL)
    try:
        yield _serve(svc, _workload()), svc.stats()
    finally:
        svc.shutdown()


def _workload() -> list[list[int]]:
    """6 conversations of 4 turns over a shared system prompt, turn by turn: their prefixes need
    ~100 pages of 8 tokens at the last turn, against a pool of 64."""
    convs = _turns(2, conversations=6, turns=4, system=40, turn=32)
    return [c[t] for t in range(4) for c in convs]


def _serve(svc, prompts: list[list[int]]) -> list[list[int]]:
    return [collect(svc.submit(p, GREEDY))[0] for p in prompts]


def test_the_tiny_llama_serves_the_same_tokens_from_the_host_tier_with_fewer_computed(
    checkpoint, served_without
) -> None:
    from myserve.runtime.compile_counter import compile_count

    want, plain = served_without
    svc = start_service(checkpoint, *TINY_ENGINE, *POOL, TIER)
    try:
        assert svc.replicas[0].runner.device.background_builds_done(600)
        compiled = compile_count()
        got = _serve(svc, _workload())
        stats = svc.stats()
        assert compile_count() == compiled  # the tier's gather and scatter were built at start
        alloc = svc.replicas[0].allocator
        executor = svc.replicas[0].runner.device
        assert executor.host_kv is not None and alloc.host is not None
        assert executor.host_kv.num_slots == alloc.host.num_slots == stats.host_tier_pages_total > 0
    finally:
        svc.shutdown()
    assert got == want
    assert stats.host_tier_saved_pages > 0 and stats.host_tier_hit_tokens > 0
    assert stats.prompt_tokens_computed == plain.prompt_tokens_computed - stats.host_tier_hit_tokens
    assert stats.pages_used == 0 and alloc.transfers_owed == 0  # the pool idle, no copy owed
    assert stats.host_tier_pages_used <= stats.host_tier_pages_total


def test_garbage_from_the_host_would_change_the_tokens(checkpoint, served_without, monkeypatch) -> None:
    """The control of the test above: loads that write other values give other tokens, so equal
    tokens there mean the pages came back as they were saved."""
    import jax
    import jax.numpy as jnp

    from myserve.runtime import host_kv

    real = host_kv.HostKV._device_pages

    def garbage(self, store: np.ndarray, slots: np.ndarray):
        a = real(self, store, slots)
        return jax.device_put(jnp.full(a.shape, 0.5, a.dtype), a.sharding)

    monkeypatch.setattr(host_kv.HostKV, "_device_pages", garbage)
    svc = start_service(checkpoint, *TINY_ENGINE, *POOL, TIER)
    try:
        got = _serve(svc, _workload())
        assert svc.stats().host_tier_hit_tokens > 0
    finally:
        svc.shutdown()
    assert got != served_without[0]


def test_a_one_page_tier_evicts_and_keeps_serving_the_same_tokens(checkpoint, served_without) -> None:
    svc = start_service(checkpoint, *TINY_ENGINE, *POOL, "engine.kv_offloading_size=0.000004")  # 1 page
    try:
        got = _serve(svc, _workload())
        stats = svc.stats()
    finally:
        svc.shutdown()
    assert got == served_without[0]
    assert stats.host_tier_pages_total == 1 and stats.host_tier_pages_used == 1
    assert stats.host_tier_saved_pages > 1  # it kept taking newer pages in its one slot


@pytest.mark.parametrize("kernel", [False, True], ids=["reference", "kernel_layout"])
def test_the_tier_on_sharded_caches_serves_the_same_tokens(checkpoint, kernel: bool) -> None:
    """4 fake devices in a subprocess: the cache split over model=2 (each device its KV head), and
    two data-parallel replicas each with its own tier; with the kernel's layout too (pages on
    axis 1, K and V interleaved per head)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    worker = Path(__file__).with_name("host_tier_worker.py")
    env = {**os.environ, "KERNEL_CONTRACT": "1"} if kernel else None
    proc = subprocess.run(
        [sys.executable, str(worker), str(checkpoint), "1x2", "2x1"],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for mesh, runs in result.items():
        assert runs["on"]["tokens"] == runs["off"]["tokens"], mesh
        assert runs["on"]["host_hit_tokens"] > 0, mesh
        assert runs["on"]["layout"] == ("KernelKVCache" if kernel else "KVCache"), mesh
