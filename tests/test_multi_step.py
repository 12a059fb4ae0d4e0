"""Multi-step decode (``engine.decode_steps``): several decode steps per dispatch give exactly the
tokens, logprobs and finish reasons of one step per dispatch, and end rows on the device."""

from __future__ import annotations

import numpy as np
import pytest

from myserve.engine.params import SamplingParams
from myserve.runtime.compile_counter import compile_count
from myserve.testing import TINY_ENGINE, hf_greedy, start_service

STEPS = 4
LENGTHS = [3, 200, 17, 64, 5, 120, 33, 9]


def collect(stream) -> dict:
    """Tokens, text, finish reasons and logprobs of every choice, in choice order."""
    choices: dict[int, dict] = {}
    for out in stream:
        if out.choice < 0:
            continue  # the closing usage record
        c = choices.setdefault(out.choice, {"tokens": [], "text": "", "finish": None, "logprobs": []})
        c["tokens"].extend(out.token_ids)
        c["text"] += out.text
        c["finish"] = out.finish_reason or c["finish"]
        c["logprobs"].extend((lp.logprob, lp.top) for lp in out.logprobs or ())
    runs = [choices[i] for i in sorted(choices)]
    return runs[0] if len(runs) == 1 else {key: [r[key] for r in runs] for key in runs[0]}


def run_all(service, prompts, params) -> list[dict]:
    streams = [service.submit(p, q) for p, q in zip(prompts, params, strict=True)]
    return [collect(s) for s in streams]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.RandomState(11)
    return [[int(t) for t in rng.randint(3, 256, size=n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def services(tiny_checkpoints, tiny_service):
    """(one step per dispatch, STEPS per dispatch) engines of the tiny Llama."""
    multi = start_service(
        tiny_checkpoints["llama3"], *TINY_ENGINE, "engine.num_pages=256", f"engine.decode_steps={STEPS}"
    )
    yield tiny_service, multi
    multi.shutdown()


def test_everything_freed_and_nothing_compiled_after_warmup(services, prompts) -> None:
    # First in the module: the engine has served nothing since its warmup.
    _, multi = services
    before = compile_count()
    params = [
        SamplingParams(max_tokens=n, temperature=t, seed=i, stop_token_ids=(5,))
        for i, (n, t) in enumerate([(1, 0.0), (2, 0.5), (9, 0.0), (30, 1.0), (5, 0.0), (13, 0.9), (7, 0.0), (40, 0.3)])
    ]
    run_all(multi, prompts, params)
    assert compile_count() == before
    stats = multi.stats()
    assert stats.pages_used == 0 and stats.running == 0
    allocator = multi.replicas[0].allocator
    assert all(allocator.refcount(p) == 0 for p in range(allocator.num_pages))


def test_greedy_equals_transformers_and_steps_are_chained(services, prompts, tiny_checkpoints) -> None:
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama3"], dtype=torch.float32).eval()
    _, multi = services
    params = SamplingParams(max_tokens=23, temperature=0.0)  # 23: the last dispatch runs fewer steps
    before = multi.stats()
    got = run_all(multi, prompts, [params] * len(prompts))
    after = multi.stats()
    assert [g["tokens"] for g in got] == [hf_greedy(hf, p, 23, (2,)) for p in prompts]
    # Far fewer dispatches than tokens: decode steps really ran STEPS at a time.
    steps = after.steps - before.steps
    generated = after.generated_tokens - before.generated_tokens
    assert after.chained_decode_steps > before.chained_decode_steps
    assert steps < generated / 4


def test_sampling_penalties_and_logprobs_equal_single_step(services, prompts) -> None:
    single, multi = services
    params = [
        SamplingParams(max_tokens=19, temperature=0.9, top_p=0.9, seed=1, logprobs=3),
        SamplingParams(max_tokens=21, temperature=1.0, top_k=5, seed=2, presence_penalty=1.5, frequency_penalty=0.5),
        SamplingParams(max_tokens=17, temperature=0.7, repetition_penalty=1.3, seed=3, min_tokens=9),
        SamplingParams(max_tokens=20, temperature=0.0, logit_bias=((17, 5.0),), logprobs=2),
        SamplingParams(max_tokens=18, temperature=1.2, min_p=0.1, seed=4),
        SamplingParams(max_tokens=16, temperature=0.8, seed=5),
    ]
    want = run_all(single, prompts[: len(params)], params)
    got = run_all(multi, prompts[: len(params)], params)
    for w, g in zip(want, got, strict=True):
        assert g["tokens"] == w["tokens"]
        assert g["finish"] == w["finish"]
        got_lps, want_lps = np.array([lp for lp, _ in g["logprobs"]]), np.array([lp for lp, _ in w["logprobs"]])
        np.testing.assert_allclose(got_lps, want_lps, atol=1e-5)
        # Rows sit in other batches, so float sums may differ in the last bits: ids exact, values close.
        assert [[i for i, _ in top] for _, top in g["logprobs"]] == [[i for i, _ in top] for _, top in w["logprobs"]]
        got_top = np.array([[v for _, v in top] for _, top in g["logprobs"]])
        np.testing.assert_allclose(got_top, np.array([[v for _, v in top] for _, top in w["logprobs"]]), atol=1e-5)


def test_stop_ids_end_rows_on_the_device_and_stop_strings_on_the_host(services, prompts) -> None:
    single, multi = services
    base = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    free = run_all(single, prompts[:3], [base] * 3)
    params = []
    for i, run in enumerate(free):
        tokens = run["tokens"]
        if i == 0:  # a stop token in the middle of a chained dispatch
            params.append(SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(tokens[6],)))
        elif i == 1:  # a stop string
            params.append(SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(run["text"][-12:-6],)))
        else:  # min_tokens keeps a stop token banned for the first 10 tokens
            params.append(SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(tokens[3],), min_tokens=10))
    want = run_all(single, prompts[:3], params)
    got = run_all(multi, prompts[:3], params)
    assert got == want
    assert [g["finish"] for g in got] == ["stop", "stop", want[2]["finish"]]
    assert len(got[0]["tokens"]) < 24
