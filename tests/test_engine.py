"""GenerationService end to end on the tiny random Llama: batching, preemption, prefix cache, aborts."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest

from myserve.runtime.compile_counter import compile_count, recent_builds
from myserve.testing import collect, hf_greedy, hf_logits, wait_primed
from myserve.wire.params import SamplingParams

LENGTHS = [3, 200, 17, 64, 5, 120, 33, 9, 150, 48, 77, 11]


def run_concurrently(service, prompts, params) -> list[list[int]]:
    streams = [service.submit(p, params) for p in prompts]
    return [collect(s)[0] for s in streams]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.RandomState(5)
    return [[int(t) for t in rng.randint(3, 256, size=n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def expected(hf_tiny, prompts) -> list[list[int]]:
    return [hf_greedy(hf_tiny, p, 24, (2,)) for p in prompts]


@pytest.fixture(scope="module")
def service(tiny_service):
    return tiny_service


GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def test_no_compile_after_warmup(service, prompts) -> None:
    # Executables are cached process-wide: forget them and warm up again, so that a shape warmup
    # misses compiles here whatever ran before (the persistent cache keeps the re-warmup quick).
    # Not while the engine thread primes (a shared engine another file just started may still):
    # clearing JAX's caches under a call in flight on another thread broke its arrays.
    wait_primed(service)
    jax.clear_caches()
    # The engine thread primes while idle, donating the cache and counts this warmup also donates.
    wait_primed(service)
    runner = service.replicas[0].runner
    runner.warmup()
    # Warmup leaves the narrower context buckets and the decode loops building in the background
    # (counted compiles on the build-later thread): this test is about what serving compiles.
    assert runner.device.background_builds_done(600)
    before = compile_count()
    mixes = [
        SamplingParams(max_tokens=5, temperature=0.0),
        SamplingParams(max_tokens=9, temperature=0.7, top_k=20, top_p=0.8, seed=3),
        SamplingParams(max_tokens=7, temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5, logprobs=5),
        SamplingParams(max_tokens=6, temperature=0.0, logit_bias=((5, 10.0),), min_tokens=3, n=2),
    ]
    threads_out: list = []
    streams = [service.submit(p, mixes[i % 4]) for i, p in enumerate(prompts)]
    for s in streams:
        threads_out.append(collect(s))
    # The engine, idle again, primes what the warmup above rebuilt (and compiles nothing for it).
    wait_primed(service)
    assert compile_count() == before, recent_builds(compile_count() - before)


def test_concurrent_greedy_matches_transformers_alone(service, prompts, expected) -> None:
    got = run_concurrently(service, prompts, GREEDY)
    assert got == expected
    stats = service.stats()
    assert stats.max_decode_batch > 1  # decode steps really batched several sequences
    # The engine timed its steps: every phase took time, and with overlapped steps each step was
    # dispatched before the one before it was read (a negative host-measured gap).
    assert all(stats.host_seconds[phase] > 0 for phase in ("plan", "dispatch", "read", "postprocess"))
    assert stats.step_gap_seconds < 0


def test_one_step_at_a_time_gives_the_same_tokens(make_service, prompts, expected) -> None:
    """``engine.async_scheduling=false``: each step is read before the next is planned; same tokens,
    and the device now waits between steps (a positive gap)."""
    svc = make_service("engine.async_scheduling=false")
    assert run_concurrently(svc, prompts, GREEDY) == expected
    assert svc.stats().step_gap_seconds > 0


def test_preemption_keeps_outputs_and_frees_every_page(make_service, prompts, expected) -> None:
    # 48 pages of 8 tokens: the 12 requests need ~170 pages in all, so sequences must be preempted.
    svc = make_service("engine.num_pages=48", "model.max_model_len=256")
    got = run_concurrently(svc, prompts, GREEDY)
    stats = svc.stats()
    assert stats.num_preemptions > 0
    assert got == expected
    assert all(svc.replicas[0].allocator.refcount(p) == 0 for p in range(48))
    assert stats.pages_used == 0 and stats.running == 0 and stats.waiting == 0


def test_prefix_cache_computes_only_uncached_tokens(service, hf_tiny) -> None:
    rng = np.random.RandomState(9)
    prefix = [int(t) for t in rng.randint(3, 256, size=100)]
    first = prefix + [7, 8, 9]
    second = prefix + [10, 11, 12, 13]
    cold = hf_greedy(hf_tiny, second, 16, (2,))
    params = SamplingParams(max_tokens=16, temperature=0.0)
    collect(service.submit(first, params))
    before = service.stats()
    tokens, _, _ = collect(service.submit(second, params))
    after = service.stats()
    # 100 shared tokens = 12 full pages of 8 (96 tokens) come from the cache.
    assert after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens == 96
    assert after.prompt_tokens_computed - before.prompt_tokens_computed == len(second) - 96
    assert tokens == cold


def test_seeded_sampling_is_batch_invariant(service, prompts) -> None:
    target = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=1234)
    alone = collect(service.submit(prompts[2], target))[0]
    others = [
        SamplingParams(max_tokens=20, temperature=t, top_k=k, seed=s)
        for t, k, s in [(1.0, 0, 1), (0.5, 5, 2), (0.0, 0, None), (1.2, 50, 3), (0.9, 0, None), (0.7, 3, 4)]
    ] + [SamplingParams(max_tokens=12, temperature=1.0, presence_penalty=0.5, seed=5)] * 2
    streams = [service.submit(prompts[i], p) for i, p in enumerate(others)]
    mixed_stream = service.submit(prompts[2], target)
    mixed = collect(mixed_stream)[0]
    for s in streams:
        collect(s)
    assert mixed == alone
    other_seed = collect(service.submit(prompts[2], SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=99)))
    assert other_seed[0] != alone


def test_n_choices_share_the_prompt_and_differ(service, prompts) -> None:
    stream = service.submit(prompts[1], SamplingParams(max_tokens=8, temperature=1.0, n=3, seed=7))
    by_choice: dict[int, list[int]] = {0: [], 1: [], 2: []}
    usage = None
    for out in stream:
        if out.final:
            usage = out.usage
        else:
            by_choice[out.choice].extend(out.token_ids)
    assert all(len(v) == 8 for v in by_choice.values())
    assert len({tuple(v) for v in by_choice.values()}) > 1
    assert usage is not None and usage.completion_tokens == 24 and usage.prompt_tokens == len(prompts[1])


def test_abort_frees_everything_and_engine_keeps_serving(service, prompts, expected) -> None:
    streams = [service.submit(prompts[i % 12], SamplingParams(max_tokens=200, temperature=0.0)) for i in range(50)]
    for s in streams:
        service.abort(s.request_id)
    finishes = [collect(s)[2] for s in streams]
    assert set(finishes) <= {"abort", "length", "stop"} and "abort" in finishes
    stats = service.stats()
    assert stats.pages_used == 0 and stats.running == 0 and stats.waiting == 0
    assert collect(service.submit(prompts[0], GREEDY))[0] == expected[0]


def test_stop_strings_and_finish_reasons(service, prompts) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0)
    tokens, text, finish = collect(service.submit(prompts[3], params))
    assert finish in ("length", "stop") and len(text) > 4
    stop = text[2:5]
    _, stopped_text, stopped_finish = collect(
        service.submit(prompts[3], SamplingParams(max_tokens=24, temperature=0.0, stop=(stop, "\u2603")))
    )
    assert stopped_finish == "stop" and stopped_text == text[: text.index(stop)]
    _, at_start, reason = collect(
        service.submit(prompts[3], SamplingParams(max_tokens=24, temperature=0.0, stop=(text[:2],)))
    )
    assert at_start == "" and reason == "stop"


def test_submit_from_many_threads(service, prompts, expected) -> None:
    results: dict[int, list[int]] = {}

    def worker(i: int) -> None:
        results[i] = collect(service.submit(prompts[i], GREEDY))[0]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [results[i] for i in range(6)] == expected[:6]


def test_n_greedy_choices_share_prompt_pages_copy_on_write(service, hf_tiny) -> None:
    """Later choices reuse the first choice's prompt pages: the prompt is prefilled once, not 3 times."""
    # A fresh 117-token prompt (nothing cached): 14 full pages of 8 shared, the last prompt token's
    # page copied for choices 1 and 2.
    prompt = [int(t) for t in np.random.RandomState(21).randint(3, 256, size=117)]
    want = hf_greedy(hf_tiny, prompt, 24, (2,))
    before = service.stats()
    stream = service.submit(prompt, SamplingParams(max_tokens=24, temperature=0.0, n=3))
    by_choice: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for out in stream:
        if not out.final:
            by_choice[out.choice].extend(out.token_ids)
    after = service.stats()
    assert by_choice[0] == by_choice[1] == by_choice[2] == want
    assert after.prompt_tokens_computed - before.prompt_tokens_computed == len(prompt)
    assert after.pages_used == 0


def test_full_waiting_queue_raises_overloaded_and_the_rest_finish(make_service, prompts) -> None:
    from myserve.wire.outputs import Overloaded

    svc = make_service("engine.max_num_seqs=1", "engine.max_waiting=3")
    accepted, refused = [], 0
    for i in range(12):
        try:
            accepted.append(svc.submit(prompts[i], SamplingParams(max_tokens=30, temperature=0.0)))
        except Overloaded:
            refused += 1
    assert refused > 0 and len(accepted) >= 3
    finishes = [collect(s)[2] for s in accepted]
    assert all(f in ("length", "stop") for f in finishes)
    assert svc.stats().pages_used == 0


def test_prompt_logprobs_equal_transformers_log_softmax(service, tiny_checkpoints) -> None:
    """Scored prompts (echo with logprobs): every prompt token's logprob, across prefill chunks."""
    prompt = [int(t) for t in np.random.RandomState(33).randint(3, 256, size=150)]  # 3 chunks of <= 64
    ref = hf_logits(tiny_checkpoints["llama3"], prompt)
    ref_lp = ref - np.log(np.exp(ref - ref.max(-1, keepdims=True)).sum(-1, keepdims=True)) - ref.max(-1, keepdims=True)
    outputs = list(service.submit(prompt, SamplingParams(max_tokens=0, prompt_logprobs=3)))
    scored = [o for o in outputs if o.prompt_logprobs is not None]
    assert len(scored) == 1 and scored[0].finish_reason == "length"
    entries = scored[0].prompt_logprobs
    assert entries[0] is None and len(entries) == len(prompt)
    for i in range(1, len(prompt)):
        e = entries[i]
        assert e.token_id == prompt[i]
        assert abs(e.logprob - ref_lp[i - 1, prompt[i]]) < 1e-4
        assert [t for t, _ in e.top] == list(np.argsort(-ref[i - 1])[:3])
    assert outputs[-1].usage.completion_tokens == 0
    # With generation too: the prompt's scores come first, then the tokens.
    outs = list(service.submit(prompt[:40], SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=0)))
    assert outs[0].prompt_logprobs is not None and sum(len(o.token_ids) for o in outs) == 3


def test_engine_crash_fails_requests_instead_of_hanging(make_service, prompts) -> None:
    from myserve.wire.outputs import EngineDead

    svc = make_service("engine.num_pages=64")
    all_submitted = threading.Event()

    def boom(batch):
        all_submitted.wait(10)  # the engine dies only once every request is queued
        raise RuntimeError("injected device failure")

    svc.replicas[0].runner.dispatch = boom  # type: ignore[method-assign]
    streams = [svc.submit(p, GREEDY) for p in prompts[:4]]
    all_submitted.set()
    finals = [[o for o in s if o.final][0] for s in streams]
    assert all(f.error and "injected device failure" in f.error for f in finals)
    # The failed requests' pages went back through the one release path.
    assert svc.replicas[0].allocator.num_used == 0
    with pytest.raises(EngineDead):
        svc.submit(prompts[0], GREEDY)
