"""Speculative decoding with prompt-lookup (ngram) drafts: the draft proposer (host only), and an
engine that speculates against one that does not, on a tiny random Llama: greedy and seeded
sampled outputs are identical (each position samples as a plain decode at that position would,
with the same seed: so the target distribution is kept exactly), with logprobs, n > 1 and stop
strings, while drafts are proposed, verified and partly accepted (the counters and vLLM's metrics
say how many)."""

from __future__ import annotations

import httpx
import pytest
from test_server import LiveServer

from myserve.core.ngram import propose
from myserve.frontend.app import create_app
from myserve.testing import TINY_ENGINE, collect, make_tiny_checkpoint, start_service
from myserve.wire.params import SamplingParams


def test_ngram_drafts() -> None:
    assert propose([1, 2, 3, 4, 1, 2], k=3, n_max=3) == [3, 4, 1]  # "1 2" seen before: what followed
    assert propose([1, 2, 3, 4, 5, 2, 3], k=2, n_max=3, n_min=2) == [4, 5]
    assert propose([5, 6, 7], k=2, n_max=3) == []  # nothing repeats
    assert propose([9, 1, 2, 8, 1, 2], k=1, n_max=2) == [8]  # the most recent occurrence
    assert propose([7, 7, 7, 7, 7, 7], k=3, n_max=2) == [7, 7, 7]  # one with k tokens after it
    assert propose([1, 2, 3, 1, 2, 3, 1, 2], k=4, n_max=2, n_min=2) == [3, 1, 2, 3]  # the earliest has 4 after it
    assert propose([1, 2], k=0, n_max=2) == []


REPEATING = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [40, 41, 42, 40, 41, 42, 40, 41], [100, 3, 100, 3, 100, 3]]
OTHER = [[11, 200, 31, 4, 250, 17, 9], [60, 61, 62, 63]]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    checkpoint = make_tiny_checkpoint("llama3", tmp_path_factory.mktemp("spec"))
    plain = start_service(checkpoint, *TINY_ENGINE, "engine.num_pages=128")
    spec = start_service(
        checkpoint,
        *TINY_ENGINE,
        "engine.num_pages=128",
        "engine.speculative_method=ngram",
        "engine.num_speculative_tokens=4",
        "engine.prompt_lookup_max=3",
    )
    yield plain, spec
    plain.shutdown()
    spec.shutdown()


def run(service, requests: list[tuple[list[int], SamplingParams]]) -> list[dict[int, tuple]]:
    """Every request at once; per request, each choice's (token ids, finish reason) and logprobs."""
    streams = [service.submit(prompt, params) for prompt, params in requests]
    results = []
    for stream in streams:
        choices: dict[int, list] = {}
        for out in stream:
            if out.final:
                continue
            tokens, logprobs, finish = choices.setdefault(out.choice, [[], [], None])
            tokens.extend(out.token_ids)
            logprobs.extend(round(lp.logprob, 4) for lp in out.logprobs or ())
            choices[out.choice][2] = out.finish_reason or finish
        results.append({c: tuple(map(tuple, v[:2])) + (v[2],) for c, v in choices.items()})
    return results


def mixed_requests() -> list[tuple[list[int], SamplingParams]]:
    """16 requests: greedy and seeded sampling, logprobs, n = 2, a stop id, lengths that end inside a draft."""
    requests = []
    for i in range(16):
        prompt = (REPEATING + OTHER)[i % 5]
        if i % 4 == 0:
            params = SamplingParams(max_tokens=20 + i, temperature=0.0, ignore_eos=True, logprobs=2)
        elif i % 4 == 1:
            params = SamplingParams(max_tokens=17, temperature=0.8, top_k=40, seed=i, ignore_eos=True)
        elif i % 4 == 2:
            params = SamplingParams(max_tokens=13, temperature=1.0, seed=100 + i, n=2, ignore_eos=True, logprobs=0)
        else:
            params = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(prompt[1],), ignore_eos=True)
        requests.append((prompt, params))
    return requests


def test_speculation_gives_the_tokens_plain_decoding_gives(engines) -> None:
    plain, spec = engines
    requests = mixed_requests()
    want = run(plain, requests)
    before = spec.stats()
    got = run(spec, requests)
    assert got == want
    after = spec.stats()
    drafts = after.spec_drafts - before.spec_drafts
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    proposed = after.spec_draft_tokens - before.spec_draft_tokens
    assert drafts > 0 and 0 < accepted < proposed  # drafts ran, some held and some did not
    assert sum(after.spec_accepted_per_pos) == after.spec_accepted_tokens
    assert after.spec_accepted_per_pos[0] >= after.spec_accepted_per_pos[-1]
    assert after.steps - before.steps < plain.stats().steps  # fewer steps for the same tokens


def test_seeded_sampling_is_the_target_distribution(engines) -> None:
    """Over many seeds, speculated samples equal plain ones seed by seed: the draft never shapes
    what is sampled, only how many positions one step verifies."""
    plain, spec = engines
    requests = [
        (REPEATING[0], SamplingParams(max_tokens=8, temperature=1.0, seed=s, ignore_eos=True)) for s in range(48)
    ]
    assert run(spec, requests) == run(plain, requests)


def test_spec_decode_metrics_have_vllm_names(engines) -> None:
    _, spec = engines
    collect(spec.submit(REPEATING[1], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)))
    live = LiveServer(create_app(spec, served_model_name="tiny"))
    try:
        text = httpx.get(f"{live.url}/metrics").text
    finally:
        live.stop()
    stats = spec.stats()
    assert f'vllm:spec_decode_num_drafts_total{{model_name="tiny"}} {float(stats.spec_drafts)}' in text
    assert (
        f'vllm:spec_decode_num_accepted_tokens_total{{model_name="tiny"}} {float(stats.spec_accepted_tokens)}' in text
    )
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}' in text
    assert "vllm:spec_decode_num_draft_tokens_total" in text
