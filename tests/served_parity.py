"""Greedy parity of a served architecture with transformers, through the engine's real scheduler:
several prompts at once on a small KV pool (chunked prefill, preemption), then a prompt sharing a
cached prefix. Each new architecture's serving test calls ``check_served_greedy``."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from myserve.testing import TINY_ENGINE, collect, hf_greedy, start_service
from myserve.wire.params import SamplingParams

# Lengths: a decode-sized prompt, prompts longer than a 64-token step (chunked prefill) and longer
# than the tiny configs' 16-token sliding windows.
PROMPT_LENGTHS = (3, 150, 17, 90, 40, 120)
MAX_TOKENS = 32


def prompts(seed: int = 5, vocab: int = 256) -> list[list[int]]:
    """Random prompts of ``PROMPT_LENGTHS`` (ids >= 3, clear of the tiny configs' special ids)."""
    rng = np.random.RandomState(seed)
    return [[int(t) for t in rng.randint(3, vocab, size=n)] for n in PROMPT_LENGTHS]


def hf_model(checkpoint: Path):
    """The checkpoint in transformers, float32, eval mode."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def check_served_greedy(checkpoint: Path, *overrides: str) -> None:
    """Serve ``checkpoint`` on a 48-page pool of 8 tokens (the prompts need ~100 pages: sequences
    are preempted) with 64-token steps (long prompts are prefilled in chunks); every prompt's 32
    greedy tokens equal transformers' for that prompt alone, and so do the logprobs of every token
    (transformers' log-softmax over the same sequence): tiny random models can repeat one token
    whatever their attention computes (the tiny Gemma 2 does), and the logprobs still see it. Then
    a prompt that shares a 96-token cached prefix gives transformers' tokens too, computing only
    its uncached tokens."""
    ref = hf_model(checkpoint)
    ps = prompts()
    expected = [hf_greedy(ref, p, MAX_TOKENS, (0,)) for p in ps]
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    svc = start_service(checkpoint, *TINY_ENGINE, "engine.num_pages=48", "model.max_model_len=256", *overrides)
    try:
        streams = [svc.submit(p, greedy) for p in ps]
        got, logprobs = zip(*(_tokens_and_logprobs(s) for s in streams), strict=True)
        stats = svc.stats()
        assert stats.num_preemptions > 0, "the pool was meant to force preemption"
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            # transformers stops at a sampled id 0; the engine ignores EOS and makes them all.
            assert len(g) == MAX_TOKENS and g[: len(e)] == e, f"prompt {i} ({len(ps[i])} tokens): {g} != {e}"
            want_lp = hf_token_logprobs(ref, ps[i], g)
            np.testing.assert_allclose(logprobs[i], want_lp, atol=2e-4, rtol=0, err_msg=f"prompt {i} logprobs")
        # Prefix caching: 100 shared tokens = 12 full pages of 8 come from the cache.
        prefix = ps[1][:100]
        first, second = prefix + [7, 8, 9], prefix + [10, 11, 12, 13]
        collect(svc.submit(first, greedy))
        before = svc.stats()
        tokens = collect(svc.submit(second, greedy))[0]
        after = svc.stats()
        assert after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens == 96
        want = hf_greedy(ref, second, MAX_TOKENS, (0,))
        assert tokens[: len(want)] == want
    finally:
        svc.shutdown()


def _tokens_and_logprobs(stream) -> tuple[list[int], list[float]]:  # noqa: ANN001
    """A single-choice stream's tokens and each one's logprob."""
    tokens: list[int] = []
    logprobs: list[float] = []
    for out in stream:
        tokens.extend(out.token_ids)
        logprobs.extend(entry.logprob for entry in out.logprobs or ())
    assert len(logprobs) == len(tokens)
    return tokens, logprobs


def hf_token_logprobs(model, prompt: list[int], generated: list[int]) -> np.ndarray:  # noqa: ANN001
    """transformers' float32 log-softmax of each ``generated`` token after ``prompt`` and the
    generated tokens before it (one forward over the whole sequence)."""
    import torch

    ids = torch.tensor([prompt + generated[:-1]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 :].float()
    picked = torch.log_softmax(logits, dim=-1)[torch.arange(len(generated)), torch.tensor(generated)]
    return picked.numpy()


def check_served_on_backend(make_service, hf_tiny, backend: str, monkeypatch) -> None:  # noqa: ANN001
    """The tiny Llama served with its attention on ``backend`` (``resolve_backend``'s pick forced):
    chunked prefills beside decodes and a prefix-cache hit, each request's greedy tokens equal to
    transformers alone, and every page returned."""
    monkeypatch.setattr("myserve.runtime.deployment.resolve_backend", lambda *a, **k: backend)
    svc = make_service("engine.num_pages=128")
    assert svc.replicas[0].runner.device.outer.attention_backend == backend
    rng = np.random.RandomState(5)
    prompts = [[int(t) for t in rng.randint(3, 256, size=n)] for n in (3, 150, 17, 64, 5)]
    prompts.append(prompts[1][:100] + [7, 8, 9])  # shares full pages with prompt 1
    params = SamplingParams(max_tokens=16, temperature=0.0)
    streams = [svc.submit(p, params) for p in prompts]
    got = [collect(s)[0] for s in streams]
    assert got == [hf_greedy(hf_tiny, p, 16, (2,)) for p in prompts]
    assert svc.stats().pages_used == 0
