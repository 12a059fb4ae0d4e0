"""A quantized KV cache served: the tiny Llama's greedy tokens with int8 and fp8 KV against the
full-precision cache over 16 prompts (at least 90 % of positions equal, and what the first
divergence is), the pool's bytes per page as the sizing counts them, and its capacity at the same
memory. The attention paths over a quantized cache are ``tests/test_quantized_kv.py``."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from myserve.config import load_config
from myserve.models.spec import ModelSpec
from myserve.runtime.footprint import spec_and_parameters
from myserve.runtime.kv_sizing import page_bytes, plan_pages
from myserve.testing import TINY_ENGINE, collect, start_service
from myserve.wire.params import SamplingParams

PROMPTS = 16
TOKENS = 24
AGREEMENT = {"int8": 0.9, "fp8_e4m3": 0.9}
"""The least share of positions whose greedy token a quantized cache keeps (measured: int8 0.966,
fp8_e4m3 0.911 with the rotated keys and the fp8 scale search; 0.97 and 0.87 without them). The
tiny random model is nearly undecided everywhere (its top token has p ~0.05-0.15 over 256, the
runner-up within a few per cent), so fp8's 3-bit mantissa flips near-ties that a trained model's
margins absorb: SmolLM2's perplexity and greedy agreement are in docs/performance.md ("Quantized KV
cache")."""
NEAR_TIE = {"int8": 0.5, "fp8_e4m3": 0.75}
"""Where a position's greedy token differs, the full-precision cache's top two tokens were closer
than this (nats). fp8's 3-bit mantissa flipped gaps of up to 0.50 nats in full-suite runs (0.34 alone:
a step's bucket, and so its float32 reductions, varies with timing)."""


def scored(svc, prompt: list[int]) -> list[tuple[tuple[int, float], ...]]:
    """Each prompt position's top 5 (token, logprob) given the tokens before it (teacher forcing)."""
    tops: list[tuple[tuple[int, float], ...]] = []
    for out in svc.submit(prompt, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=5)):
        tops += [() if t is None else t.top for t in out.prompt_logprobs or ()]
    return tops


@pytest.fixture(scope="module")
def runs(tiny_checkpoints) -> dict[str, tuple[list[list[tuple[tuple[int, float], ...]]], object]]:
    """Per KV dtype: each of 16 prompts followed by the full-precision cache's 24 greedy tokens,
    scored position by position (teacher forcing: every dtype sees the same tokens, so one flip does
    not change the rest), and the engine's cache."""
    rng = np.random.RandomState(7)
    prompts = [[int(t) for t in rng.randint(3, 256, size=n)] for n in rng.randint(4, 90, size=PROMPTS)]
    out = {}
    for name in ("auto", "int8", "fp8_e4m3"):
        svc = start_service(
            tiny_checkpoints["llama3"], *TINY_ENGINE, "engine.num_pages=128", f"engine.kv_cache_dtype={name}"
        )
        try:
            if name == "auto":
                greedy = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
                prompts = [p + collect(svc.submit(p, greedy))[0] for p in prompts]
            out[name] = ([scored(svc, p)[-TOKENS:] for p in prompts], svc.replicas[0].runner.device.kv_cache)
        finally:
            svc.shutdown()
    return out


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_greedy_tokens_agree_with_the_full_precision_cache(runs, name: str) -> None:
    full, _ = runs["auto"]
    got, cache = runs[name]
    assert cache.k.dtype.itemsize == 1 and cache.k_scale is not None  # served quantized
    positions = [(f, g) for fp, gp in zip(full, got, strict=True) for f, g in zip(fp, gp, strict=True)]
    same = [f[0][0] == g[0][0] for f, g in positions]
    assert sum(same) >= AGREEMENT[name] * PROMPTS * TOKENS, f"{sum(same)} of {PROMPTS * TOKENS} positions equal"
    # Each position that differs is a near-tie of the full-precision model: its top two tokens were
    # within NEAR_TIE nats, a gap the cache's rounding can close.
    for (f, g), equal in zip(positions, same, strict=True):
        if not equal:
            assert f[0][1] - f[1][1] < NEAR_TIE[name], (f, g)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_the_pool_s_bytes_per_page_are_what_the_sizing_counts(runs, name: str, tiny_checkpoints) -> None:
    cache = runs[name][1]
    leaves = jax.tree.leaves(cache)
    pages = cache.k.shape[2]  # the pool and its spare page
    spec, _ = spec_and_parameters(str(tiny_checkpoints["llama3"]))
    assert sum(leaf.nbytes for leaf in leaves) == pages * page_bytes(spec, cache.page_size, 4, kv_cache_dtype=name)


@pytest.mark.parametrize("itemsize, at_least", [(2, 1.9), (4, 3.7)])
def test_the_same_memory_holds_about_twice_the_tokens(itemsize: int, at_least: float) -> None:
    """A 1B-shaped model (head_dim 64: the scale's 2 bytes weigh most) at 2 GiB of KV: int8 and fp8
    pools hold >= 1.9x the pages of a bf16 one (3.7x a float32 one)."""
    spec = ModelSpec(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
        num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=131072, tie_word_embeddings=True,
    )  # fmt: skip
    pages = {}
    for name in ("auto", "int8", "fp8"):
        engine = load_config(None, [f"engine.kv_cache_dtype={name}", "engine.kv_cache_memory_bytes=2147483648"]).engine
        plan = plan_pages(engine, spec, platform="gpu", itemsize=itemsize, max_model_len=4096, token_budget=2048)
        pages[name] = plan.pages
    assert pages["int8"] == pages["fp8"] >= at_least * pages["auto"]
