"""Several decode tokens per call (``engine.decode_steps``) on the real engine and the tiny random
Llama: K = 4 and K = 8 give K = 1's tokens, text and finishes over 16 mixed concurrent requests
(stop strings, stop ids, EOS, max_tokens 1-40, n > 1, logprobs, min_tokens, seeded sampling with
top-p, one grammar-constrained row) with preemption forced by a small KV pool; an abort ends its
stream at once and gives its pages back; nothing compiles after the background builds."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from myserve.grammar import GrammarSpec
from myserve.runtime.compile_counter import compile_count, recent_builds
from myserve.testing import TINY_ENGINE, make_tiny_checkpoint, start_service
from myserve.wire.params import SamplingParams

# 64 pages of 8 tokens: 512 tokens for 8 running sequences of up to ~100 tokens: preemption.
# Decode pacing off (a budget no call reaches): on a loaded machine its timing estimate may choose
# one-token steps for a while, and these tests count the calls of K tokens (pacing: test_decode_pacing).
ENGINE = (*TINY_ENGINE, "engine.num_pages=64", "engine.decode_call_budget_ms=600000")


def run(service: Any, requests: list[tuple[list[int], SamplingParams]]) -> list[dict[int, tuple]]:
    """Submit every request at once; per request, per choice: (token ids, text, finish reason,
    logprobs of each token)."""
    streams = [service.submit(prompt, params) for prompt, params in requests]
    results = []
    for stream in streams:
        choices: dict[int, tuple[list[int], str, str | None, list[float]]] = {}
        for out in stream:
            if out.choice < 0:
                continue
            tokens, text, finish, lps = choices.get(out.choice, ([], "", None, []))
            lps = lps + [lp.logprob for lp in out.logprobs or ()]
            choices[out.choice] = (tokens + list(out.token_ids), text + out.text, out.finish_reason or finish, lps)
        results.append(choices)
    return results


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Any:
    # SmolLM2's whole vocabulary, so that the grammar's tokenizer fits the model.
    checkpoint = make_tiny_checkpoint("llama3", tmp_path_factory.mktemp("vocab") / "llama", vocab_size=49152)
    started = {k: start_service(checkpoint, *ENGINE, f"engine.decode_steps={k}") for k in (1, 4, 8)}
    for k, svc in started.items():
        assert svc.replicas[0].runner.device.background_builds_done(600), k
    yield started
    for svc in started.values():
        svc.shutdown()


def mixed(reference: Any) -> list[tuple[list[int], SamplingParams]]:
    """16 requests; stop ids and stop strings are taken from what the model says without them, so
    that they do stop it mid-way."""
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(3, 49152, size=n)] for n in (5, 160, 17, 133, 9, 148, 21, 140)]
    probe = run(reference, [(p, SamplingParams(max_tokens=30, temperature=0.0)) for p in prompts[:3]])
    stop_id = probe[0][0][0][6]
    stop_text = probe[1][0][1][len(probe[1][0][1]) // 2 :][:3]
    assert stop_text.strip()
    requests = [
        (prompts[0], SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=(stop_id,))),
        (prompts[1], SamplingParams(max_tokens=30, temperature=0.0, stop=(stop_text,))),
        (prompts[2], SamplingParams(max_tokens=1, temperature=0.0)),
        (prompts[3], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)),
        (prompts[4], SamplingParams(max_tokens=23, temperature=0.8, seed=11, top_p=0.9)),
        (prompts[5], SamplingParams(max_tokens=17, temperature=1.0, seed=12, n=2)),
        (prompts[6], SamplingParams(max_tokens=12, temperature=0.0, logprobs=3)),
        (prompts[7], SamplingParams(max_tokens=25, temperature=0.7, seed=13, min_tokens=20, stop_token_ids=(stop_id,))),
        (prompts[0], SamplingParams(max_tokens=9, temperature=0.0, grammar=GrammarSpec("choice", '["yes", "no"]'))),
        (prompts[1], SamplingParams(max_tokens=2, temperature=1.0, seed=14)),
        (prompts[2], SamplingParams(max_tokens=37, temperature=0.0, repetition_penalty=1.2)),
        (prompts[3], SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=(stop_id,))),
        (prompts[4], SamplingParams(max_tokens=40, temperature=1.0, seed=15, top_k=20)),
        (prompts[5], SamplingParams(max_tokens=28, temperature=0.0, n=2, logprobs=1)),
        (prompts[6], SamplingParams(max_tokens=19, temperature=0.0, min_tokens=19)),
        (prompts[7], SamplingParams(max_tokens=33, temperature=0.5, seed=16)),
    ]
    return requests


def test_several_tokens_per_call_give_one_per_calls_outputs(services) -> None:
    requests = mixed(services[1])
    before = compile_count()
    got = {k: run(svc, requests) for k, svc in services.items()}
    # Counted on the engines' own threads (serving, background builds): the process may hold
    # threads of other tests' deployments (an early build outliving its test) that are not ours.
    built = recent_builds(compile_count() - before)
    ours = [b for b in built if b[1] == "myserve-engine" or b[1].startswith("build-later")]
    assert not ours, f"built after the background builds: {built}"
    for k in (4, 8):
        for i, (one, several) in enumerate(zip(got[1], got[k], strict=True)):
            assert one.keys() == several.keys(), (k, i)
            for choice in one:
                tokens, text, finish, lps = one[choice]
                assert (tokens, text, finish) == several[choice][:3], (k, i, choice)
                np.testing.assert_allclose(lps, several[choice][3], rtol=1e-4, atol=1e-4)
    assert any(out[0][2] == "stop" for out in got[1])  # the stop id and stop string did stop requests
    engine = services[8].replicas[0]
    assert engine.scheduler.num_preemptions > 0  # the small pool preempted
    assert engine.allocator.num_used == 0


def test_an_abort_ends_its_stream_within_one_call(services) -> None:
    service = services[8]
    stream = service.submit([7, 8, 9], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
    seen = 0
    for out in stream:
        seen += len(out.token_ids)
        if seen >= 10:
            break
    t0 = time.monotonic()
    stream.close()  # the client went away: the request is aborted
    while service.replicas[0].allocator.num_used and time.monotonic() - t0 < 10:
        time.sleep(0.01)
    assert service.replicas[0].allocator.num_used == 0
    assert seen < 400


@pytest.mark.parametrize("k", [1, 4, 8])
def test_a_decode_only_stretch_is_one_call_per_k_tokens(services, k: int) -> None:
    """The executable-call counter (``Executor.calls``) over one greedy request: its prompt is one
    forward and one head call; its 24 tokens after the first come from decode calls of K tokens,
    each one executable (forward, head and sampler inside), so calls = tokens / K and no forward
    or head runs for them. K = 1 too: the decode call of one token replaces the forward and head."""
    service = services[k]
    executor = service.replicas[0].runner.device
    before = executor.calls.copy()
    decode_tokens = 24  # a multiple of 1, 4 and 8
    params = SamplingParams(max_tokens=1 + decode_tokens, temperature=0.0, ignore_eos=True)
    (out,) = run(service, [([11, 12, 13, 14, 15], params)])
    assert len(out[0][0]) == 1 + decode_tokens
    calls = executor.calls - before
    by_kind: dict[str, int] = {}
    for key, n in calls.items():
        by_kind[key[0]] = by_kind.get(key[0], 0) + n
    assert by_kind == {"forward": 1, "head": 1, "loop": decode_tokens // k}, calls
    assert all(key[2] == k for key in calls if key[0] == "loop")
