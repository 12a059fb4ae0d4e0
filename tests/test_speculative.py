"""Speculative decoding with prompt-lookup (ngram) drafts and with a draft model: the ngram
proposer (host only), and engines that speculate against one that does not, on a tiny random
Llama: greedy and seeded sampled outputs are identical (each position samples as a plain decode at
that position would, with the same seed: so the target distribution is kept exactly), with
logprobs, n > 1 and stop ids, while drafts are proposed, verified and partly accepted (the counters
and vLLM's metrics say how many). The draft model is the target with one layer's weights perturbed
(it agrees often, not always), or the target itself (it agrees always, sampled rows too: the draft
draws with the target's own keys)."""

from __future__ import annotations

import math
import shutil

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from scipy.stats import chi2_contingency
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
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint("llama3", tmp_path_factory.mktemp("spec"))


@pytest.fixture(scope="module")
def plain(checkpoint):
    # One token per decode step (K = 1): what speculation saves steps against.
    service = start_service(checkpoint, *TINY_ENGINE, "engine.num_pages=256", "engine.decode_steps=1")
    yield service
    service.shutdown()


@pytest.fixture(scope="module")
def engines(checkpoint, plain):
    spec = start_service(
        checkpoint,
        *TINY_ENGINE,
        "engine.num_pages=256",
        "engine.speculative_method=ngram",
        "engine.num_speculative_tokens=4",
        "engine.prompt_lookup_max=3",
    )
    yield plain, spec
    spec.shutdown()


def perturbed(checkpoint, directory):
    """The checkpoint with its second layer's weights perturbed: a draft that often agrees."""
    shutil.copytree(checkpoint, directory)
    weights = load_file(str(checkpoint / "model.safetensors"))
    rng = np.random.default_rng(0)
    for name, w in weights.items():
        if "layers.1." in name:
            weights[name] = w + 0.08 * rng.standard_normal(w.shape).astype(w.dtype)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def drafted(checkpoint, tmp_path_factory):
    draft = perturbed(checkpoint, tmp_path_factory.mktemp("draft") / "draft")
    spec = start_service(
        checkpoint,
        *TINY_ENGINE,
        "engine.num_pages=256",
        "engine.speculative_method=draft_model",
        f"engine.speculative_model={draft}",
        "engine.num_speculative_tokens=4",
    )
    yield spec
    spec.shutdown()


def run(service, requests: list[tuple[list[int], SamplingParams]]) -> list[dict[int, tuple]]:
    """Every request at once; per request, each choice's (token ids, finish reason) and logprobs
    (to 3 decimals: a verified row's logits come from a step of other shapes than a decode's)."""
    streams = [service.submit(prompt, params) for prompt, params in requests]
    results = []
    for stream in streams:
        choices: dict[int, list] = {}
        for out in stream:
            if out.final:
                continue
            tokens, logprobs, finish = choices.setdefault(out.choice, [[], [], None])
            tokens.extend(out.token_ids)
            logprobs.extend(round(lp.logprob, 3) for lp in out.logprobs or ())
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


def spec_counts(service, before) -> tuple[int, int, int]:
    """Drafts verified, draft tokens proposed and accepted since ``before`` (a stats snapshot)."""
    after = service.stats()
    return (
        after.spec_drafts - before.spec_drafts,
        after.spec_draft_tokens - before.spec_draft_tokens,
        after.spec_accepted_tokens - before.spec_accepted_tokens,
    )


def test_a_draft_model_gives_the_tokens_plain_decoding_gives(plain, drafted) -> None:
    """16 mixed requests, the draft's later tokens drawn one call each (before its several-token
    call is built), then by its several-token call: identical to plain decoding both times."""
    requests = mixed_requests()
    want = run(plain, requests)
    proposer = drafted.replicas[0].draft
    ready = proposer.device.background_builds_done
    proposer.device.background_builds_done = lambda timeout=None: False  # one call per draft token
    try:
        before = drafted.stats()
        assert run(drafted, requests) == want
    finally:
        proposer.device.background_builds_done = ready
    drafts, proposed, accepted = spec_counts(drafted, before)
    assert drafts > 0 and 0 < accepted < proposed
    assert ready(120)
    before = drafted.stats()
    assert run(drafted, requests) == want
    assert proposer._loops_ready  # the several-token call drew them
    drafts, proposed, accepted = spec_counts(drafted, before)
    assert drafts > 0 and 0 < accepted < proposed


def test_sampling_with_a_draft_model_keeps_the_target_distribution(plain, drafted) -> None:
    """A chi-square test of the second output token (the first one a draft proposes) over 400
    seeds with the draft model against 400 other seeds without: the same distribution."""
    prompt = OTHER[0]

    def second_tokens(service, seeds: range) -> list[int]:
        requests = [(prompt, SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True)) for s in seeds]
        return [result[0][0][1] for result in run(service, requests)]

    before = drafted.stats()
    drafted_tokens = second_tokens(drafted, range(400))
    assert spec_counts(drafted, before)[0] > 0
    plain_tokens = second_tokens(plain, range(1000, 1400))
    common = [
        t for t in set(drafted_tokens) | set(plain_tokens) if drafted_tokens.count(t) + plain_tokens.count(t) >= 10
    ]
    table = [
        [sample.count(t) for t in common] + [sum(x not in common for x in sample)]
        for sample in (drafted_tokens, plain_tokens)
    ]
    assert len(common) >= 4, table  # enough categories for the test to mean something
    p_value = chi2_contingency(np.array(table)).pvalue
    assert p_value > 0.001, (p_value, table)


def test_the_target_as_its_own_draft_is_always_accepted(checkpoint, plain) -> None:
    """A draft that is the target agrees at every position, sampled rows too (it draws with the
    target's seeds, positions and noise), and the tokens are still plain decoding's."""
    spec = start_service(
        checkpoint,
        *TINY_ENGINE,
        "engine.num_pages=256",
        "engine.speculative_method=draft_model",
        f"engine.speculative_model={checkpoint}",
        "engine.num_speculative_tokens=3",
    )
    try:
        requests = [
            (REPEATING[0], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)),
            (OTHER[1], SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)),
        ]
        before = spec.stats()
        assert run(spec, requests) == run(plain, requests)
        drafts, proposed, accepted = spec_counts(spec, before)
        assert drafts > 0 and accepted >= math.floor(0.9 * proposed)
    finally:
        spec.shutdown()


def test_a_draft_model_serves_the_openai_sdk_and_counts_its_drafts(plain, drafted) -> None:
    """Over HTTP through the real app: the SDK's completions, streamed and not, equal the plain
    engine's; vLLM's spec-decode counters say how many drafts the draft model proposed."""
    import openai

    texts = []
    for service in (plain, drafted):
        live = LiveServer(create_app(service, served_model_name="tiny"))
        try:
            client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0)
            done = client.completions.create(model="tiny", prompt=REPEATING[0], max_tokens=12, temperature=0)
            stream = client.completions.create(
                model="tiny", prompt=OTHER[0], max_tokens=10, temperature=0.7, seed=3, stream=True
            )
            texts.append((done.choices[0].text, "".join(c.choices[0].text for c in stream if c.choices)))
            metrics = httpx.get(f"{live.url}/metrics").text
        finally:
            live.stop()
    assert texts[0] == texts[1]
    stats = drafted.stats()
    assert stats.spec_drafts > 0
    assert f'vllm:spec_decode_num_drafts_total{{model_name="tiny"}} {float(stats.spec_drafts)}' in metrics
