"""What a quantized KV cache does to lose less: keys (and queries) rotated by a Hadamard transform
(``ops/kv_rotation.py``) and, for fp8, the best of several scales per vector
(``paged_cache.quantize``). Host-sized arrays; each test fails with its mechanism turned off."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ragged_steps import mixed_step

from myserve.ops import attention
from myserve.ops.attention import paged_attention
from myserve.ops.kv_rotation import hadamard_block, rotate
from myserve.ops.paged_cache import KVCache, _round_mantissa, kv_dtype, quantize, stored_dtype, widen

FRESH = [(0, 7), (0, 13), (0, 5)]
"""Three sequences written whole in one step, so every key attended is this step's."""


@pytest.mark.parametrize("head_dim", [16, 64, 96, 128])
def test_the_rotation_is_orthonormal_and_its_own_inverse(head_dim: int) -> None:
    h = hadamard_block(head_dim)
    assert head_dim % h.shape[0] == 0 and h.shape[0] == (32 if head_dim == 96 else head_dim)
    np.testing.assert_allclose(h @ h.T, np.eye(h.shape[0]), atol=1e-6)
    rng = np.random.RandomState(0)
    q, k = (jnp.asarray(rng.randn(5, 3, head_dim), jnp.float32) for _ in "qk")
    np.testing.assert_allclose(np.asarray(rotate(rotate(q))), np.asarray(q), atol=1e-5)
    dots = jnp.sum(q * k, axis=-1)
    np.testing.assert_allclose(np.asarray(jnp.sum(rotate(q) * rotate(k), axis=-1)), np.asarray(dots), atol=1e-4)
    assert rotate(q.astype(jnp.bfloat16)).dtype == jnp.bfloat16


def _attention_error(name: str, seed: int) -> float:
    """The mean error of one quantized-cache attention step against a float cache's, on keys whose
    energy sits in two channels the queries share (as a trained model's low-frequency rotary pairs
    do)."""
    rng = np.random.RandomState(seed)
    layers, kvh, h, d, ps, n_pages = 1, 2, 4, 64, 4, 32
    shape, _, batch = mixed_step(rng, n_pages, ps, FRESH)
    t = shape.tokens
    outlier = np.zeros(d, np.float32)
    outlier[[3, 35]] = 10.0
    k = jnp.asarray(rng.randn(1, t, kvh, d) + outlier * (1 + 0.3 * rng.randn(1, t, kvh, 1)), jnp.float32)
    v = jnp.asarray(rng.randn(1, t, kvh, d), jnp.float32)
    q = jnp.asarray(rng.randn(t, h, d) + outlier / 10, jnp.float32)

    def run(dtype: jnp.dtype) -> np.ndarray:
        zeros = jnp.zeros((layers, kvh, n_pages + 1, ps, d), dtype)
        scales = jnp.ones((layers, kvh, n_pages + 1, ps, 1), jnp.bfloat16) if dtype.itemsize == 1 else None
        out, _ = paged_attention(q, k, v, KVCache(zeros, zeros, scales, scales), 0, batch, sm_scale=d**-0.5)
        return np.asarray(out[: sum(n for _, n in FRESH)])

    return float(np.mean(np.abs(run(kv_dtype(name, jnp.float32)) - run(jnp.dtype(jnp.float32)))))


def test_rotated_keys_lose_less_of_the_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 (an error per step of the token's largest value): the outlier channels' products carry
    the score's error unless rotated (measured 0.60x). fp8's error is relative to each element, so
    on these keys the rotation gains nothing; on SmolLM2's it does (docs/performance.md)."""
    rotated = np.mean([_attention_error("int8", seed) for seed in range(3)])
    monkeypatch.setattr(attention, "rotate", lambda x: x)
    plain = np.mean([_attention_error("int8", seed) for seed in range(3)])
    assert rotated < 0.75 * plain, (rotated, plain)
    assert rotated < 0.01  # and the step still attends as the float cache does


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_a_quantized_step_attends_as_the_float_cache_does(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Queries rotated with the keys: without the queries' rotation the scores are garbage."""
    bound = {"int8": 0.005, "fp8_e4m3": 0.02, "fp8_e5m2": 0.04}[name]
    assert _attention_error(name, 0) < bound
    monkeypatch.setattr(attention, "rotate", lambda x: x if x.ndim == 3 else rotate(x))
    assert _attention_error(name, 0) > 5 * bound


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_an_fp8_vector_keeps_the_scale_that_reconstructs_it_best(name: str) -> None:
    x = jnp.asarray(np.random.RandomState(1).randn(4096, 64), jnp.float32)
    dtype = kv_dtype(name, jnp.float32)
    codes, scales = quantize(x, dtype, search=True)
    searched = jnp.sum(jnp.square(codes.astype(jnp.float32) * scales.astype(jnp.float32) - x), axis=-1)
    # The absmax scale alone (the first candidate): never better, and worse on average.
    absmax = (jnp.max(jnp.abs(x), axis=-1, keepdims=True) / float(jnp.finfo(dtype).max)).astype(jnp.bfloat16)
    top = float(jnp.finfo(dtype).max)
    plain = jnp.clip(x / absmax.astype(jnp.float32), -top, top).astype(dtype)
    one = jnp.sum(jnp.square(plain.astype(jnp.float32) * absmax.astype(jnp.float32) - x), axis=-1)
    assert bool(jnp.all(searched <= one * (1 + 1e-6)))
    assert float(jnp.mean(searched)) < 0.85 * float(jnp.mean(one))
    assert bool(jnp.all(scales >= absmax))  # never a scale that would clip the largest element


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_the_search_s_estimate_rounds_as_the_cast_does(name: str) -> None:
    """The search ranks candidates by a mantissa rounding in float32 bits: in the dtype's normal
    range it is the cast itself (ties to even included)."""
    dtype = kv_dtype(name, jnp.float32)
    info = jnp.finfo(dtype)
    rng = np.random.RandomState(2)
    y = rng.uniform(float(info.smallest_normal), float(info.max), 20000) * rng.choice([-1, 1], 20000)
    grid = np.asarray(jnp.arange(256, dtype=jnp.uint8).view(dtype).astype(jnp.float32))
    grid = grid[np.isfinite(grid) & (np.abs(grid) >= float(info.smallest_normal))]
    ties = (grid[:-1] + grid[1:]) / 2  # halfway points (same binade or not): ties go to even
    y = jnp.asarray(np.concatenate([y, np.sort(grid), ties[np.abs(ties) <= float(info.max)]]), jnp.float32)
    cast = y.astype(dtype).astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(_round_mantissa(y, info.nmant)), np.asarray(cast))


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_an_fp8_cache_held_as_bits_on_cpu_decodes_to_the_cast_s_numbers(name: str) -> None:
    """XLA:CPU indexes fp8 through a float16 copy of the whole pool, so a CPU pool holds the codes'
    bits (``stored_dtype``), and the gathered bits decode (``widen``) to every finite code exactly;
    a step over it attends as over the fp8 arrays themselves."""
    dtype = kv_dtype(name, jnp.float32)
    assert stored_dtype(dtype) == (jnp.uint8 if jax.default_backend() == "cpu" else dtype)
    assert stored_dtype(dtype, "pallas") == dtype and stored_dtype(jnp.dtype(jnp.int8)) == jnp.int8
    codes = jnp.arange(256, dtype=jnp.uint8).view(dtype)
    want = np.asarray(codes.astype(jnp.float32))
    got = np.asarray(widen(jnp.arange(256, dtype=jnp.uint8), dtype, jnp.float32))
    finite = np.isfinite(want)
    np.testing.assert_array_equal(got[finite], want[finite])

    rng = np.random.RandomState(3)
    shape, _, batch = mixed_step(rng, 32, 4, FRESH)
    q, k, v = (
        jnp.asarray(rng.randn(shape.tokens, 4, 16) if x == "q" else rng.randn(1, shape.tokens, 2, 16)) for x in "qkv"
    )
    scales = jnp.ones((1, 2, 33, 4, 1), jnp.bfloat16)
    outs = []
    for held in (dtype, jnp.dtype(jnp.uint8)):
        zeros = jnp.zeros((1, 2, 33, 4, 16), held)
        cache = KVCache(zeros, zeros, scales, scales, codes=dtype.name if held != dtype else None)
        out, written = paged_attention(
            q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), cache, 0, batch, sm_scale=0.25
        )
        assert written.k.dtype == held and written.codes == cache.codes
        outs.append((np.asarray(out), np.asarray(written.k.view(dtype).astype(jnp.float32))))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])
