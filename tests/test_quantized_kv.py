"""A quantized KV cache (``engine.kv_cache_dtype``: int8, fp8_e4m3, fp8_e5m2): codes and per-token
scales as written, and every attention path reading them (the reference, our GPU ragged kernel and
JAX's GPU decode kernel in Pallas's interpreter, the TPU kernel's contract) equal to attention over
the dequantized cache; page copies carry the scales. Served, the tiny models' greedy tokens and the
pool's capacity are ``tests/test_quantized_kv_serving.py``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from kernel_contract import contract_attention
from ragged_steps import MIXED, mixed_step

from myserve.ops import gpu_attention, tpu_attention
from myserve.ops import gpu_ragged_attention as ragged_kernel
from myserve.ops.attention import _view_attention, ragged_attention
from myserve.ops.attention import paged_attention as attend
from myserve.ops.kv_rotation import rotate
from myserve.ops.paged_cache import KernelKVCache, KVCache, kv_dtype, quantize, write_kv
from myserve.ops.ragged_batch import kernel_meta
from myserve.runtime.small_ops import copy_page, gather_pages, scatter_pages

DTYPES = ("int8", "fp8_e4m3", "fp8_e5m2")
TOLERANCE = {"int8": 1 / 127, "fp8_e4m3": 2.0**-4, "fp8_e5m2": 2.0**-3}
"""The largest error of a value, relative to its vector's largest magnitude (int8: one step; fp8:
half an ulp at the top of the range, relative to the value itself at least as tight)."""


def dequantized(cache: KVCache) -> KVCache:
    """The float32 cache a quantized one stands for (codes times their scales)."""
    assert cache.k_scale is not None and cache.v_scale is not None
    return KVCache(
        cache.k.astype(jnp.float32) * cache.k_scale.astype(jnp.float32),
        cache.v.astype(jnp.float32) * cache.v_scale.astype(jnp.float32),
    )


def quantized_step(rng: np.random.RandomState, name: str, d: int = 16):
    """A mixed ragged step written into layer 1 of a two-layer quantized cache (3 query heads per
    KV head): (queries padded with a zero row, cache, batch, T, the new keys and values)."""
    layers, kvh, h, ps, n_pages = 2, 2, 6, 4, 64
    shape, _, batch = mixed_step(rng, n_pages, ps, [*MIXED, (0, 1)])
    dtype = kv_dtype(name, jnp.float32)
    (k, ks), (v, vs) = (quantize(jnp.asarray(3 * rng.randn(layers, kvh, n_pages + 1, ps, d)), dtype) for _ in "kv")
    k_new, v_new = (jnp.asarray(2 * rng.randn(1, shape.tokens, kvh, d), jnp.float32) for _ in "kv")
    cache = write_kv(KVCache(k, v, ks, vs), 1, k_new, v_new, batch)
    q = jnp.asarray(rng.randn(shape.tokens, h, d), jnp.float32)
    return jnp.concatenate([q, jnp.zeros((1, h, d))]), cache, batch, shape.tokens, (k_new, v_new)


@pytest.mark.parametrize("name", DTYPES)
def test_codes_and_scales_reconstruct_each_vector_within_the_dtype_s_step(name: str) -> None:
    x = jnp.asarray(np.random.RandomState(0).randn(64, 8, 32) * np.logspace(-3, 3, 64)[:, None, None], jnp.float32)
    codes, scales = quantize(x, kv_dtype(name, jnp.float32))
    assert codes.dtype == kv_dtype(name, jnp.float32) and codes.dtype.itemsize == 1
    assert scales.shape == (64, 8, 1) and scales.dtype == jnp.bfloat16
    back = codes.astype(jnp.float32) * scales.astype(jnp.float32)
    top = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    assert float(jnp.max(jnp.abs(back - x) / top)) <= TOLERANCE[name] * 1.01  # whatever the magnitude
    zero_codes, zero_scales = quantize(jnp.zeros((2, 4)), kv_dtype(name, jnp.float32))
    assert not np.asarray(zero_codes.astype(jnp.float32)).any() and np.all(np.asarray(zero_scales) == 1)


@pytest.mark.parametrize("name", DTYPES)
def test_a_step_writes_its_tokens_quantized_with_their_scales(name: str) -> None:
    _, cache, batch, _, (k_new, _) = quantized_step(np.random.RandomState(1), name)
    view = batch.single  # decode rows: token view.idx[r, 0] at position view.positions[r, 0]
    back = dequantized(cache)
    rows = np.asarray(view.idx[:, 0])
    for r in np.flatnonzero(np.asarray(view.kv_lens) > 0):
        pos = int(view.positions[r, 0])
        page = int(view.pages[r, pos // 4])
        got = back.k[1, :, page, pos % 4]  # [KVH, D]
        want = k_new[0, rows[r]]
        top = float(jnp.max(jnp.abs(want)))
        assert float(jnp.max(jnp.abs(got - want))) <= TOLERANCE[name] * top * 1.01


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize(("window", "soft_cap"), [(None, None), (5, 2.0)])
def test_the_reference_on_a_quantized_cache_equals_it_on_the_dequantized_cache(name, window, soft_cap) -> None:
    """Scales applied to the scores (keys) and to the weights (values) give what widening the
    pages first would: both views, several chunks, a window and a soft cap."""
    q, cache, batch, _, _ = quantized_step(np.random.RandomState(2), name)
    for view in (batch.single, batch.blocks):
        args = dict(chunk_pages=batch.chunk_pages, sm_scale=0.25, heads_sharded=False, window=window, soft_cap=soft_cap)
        got = _view_attention(q, cache, jnp.int32(1), view, **args)
        want = _view_attention(q, dequantized(cache), jnp.int32(1), view, **args)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_the_gpu_ragged_kernel_reads_a_quantized_cache_as_the_reference(name: str) -> None:
    q, cache, batch, t, _ = quantized_step(np.random.RandomState(3), name)
    for view in (batch.single, batch.blocks):
        want = _view_attention(
            q, cache, jnp.int32(1), view, chunk_pages=batch.chunk_pages, sm_scale=0.25, heads_sharded=False
        )
        got = ragged_kernel.view_attention(q, cache, jnp.int32(1), view, num_tokens=t, sm_scale=0.25)
        real = np.asarray(view.idx < t)
        np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=2e-5)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_the_gpu_decode_kernel_takes_the_scales(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_attention, "_gpu_kernel", lambda: functools.partial(paged_attention, interpret=True))
    q, cache, batch, t, _ = quantized_step(np.random.RandomState(4), name)

    @jax.jit
    def both(q, cache, batch):
        return (
            ragged_attention(q, cache, jnp.int32(1), batch, sm_scale=0.25),
            ragged_attention(q, cache, jnp.int32(1), batch.with_decode_kernel(), sm_scale=0.25),
        )

    want, got = both(q[:t], cache, batch)
    real = int(batch.q_lens[0])
    np.testing.assert_allclose(np.asarray(got)[:real], np.asarray(want)[:real], atol=2e-5)


def test_an_fp8_kernel_cache_holds_the_values_and_the_tpu_kernel_widens_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The TPU kernel's layout in fp8 (one scale per cache: 1): its writes clip to the dtype's
    range, and the kernel path (the contract's stand-in) equals the reference over the same fp8
    values widened."""
    monkeypatch.setattr(tpu_attention, "_tpu_kernel", lambda: contract_attention)
    rng = np.random.RandomState(5)
    layers, kvh, h, d, ps, n_pages = 2, 2, 6, 16, 4, 64
    shape, spans, batch = mixed_step(rng, n_pages, ps)
    fp8 = jnp.float8_e4m3fn
    kv = jnp.asarray(rng.randn(layers, n_pages, ps, 2 * kvh, d), jnp.float32).astype(fp8)
    k_new, v_new = (jnp.asarray(rng.randn(1, shape.tokens, kvh, d), jnp.float32) for _ in "kv")
    k_new = k_new.at[0, 0, 0, 0].set(1e6)  # beyond e4m3's 448: clipped, not NaN
    q = jnp.asarray(rng.randn(shape.tokens, h, d), jnp.float32)
    kernel_batch = batch.with_kernel(kernel_meta(batch, shape.tokens))
    got, written = jax.jit(lambda q, c, b: attend(q, k_new, v_new, c, jnp.int32(1), b, sm_scale=0.25))(
        q, KernelKVCache(kv), kernel_batch
    )
    assert written.kv.dtype == fp8 and not np.isnan(np.asarray(written.kv.astype(jnp.float32))).any()
    # The same values in the reference layout (the spare page last), widened: K is combined head 2h.
    wide = written.kv.astype(jnp.float32).reshape(layers, n_pages, ps, kvh, 2, d).transpose(4, 0, 3, 1, 2, 5)
    spare = jnp.zeros((2, layers, kvh, 1, ps, d))
    ref_cache = KVCache(*jnp.concatenate([wide, spare], axis=3))
    # The cache holds rotated keys (ops/kv_rotation.py); the queries are rotated alike.
    want = ragged_attention(rotate(q), ref_cache, jnp.int32(1), batch, sm_scale=0.25)
    real = sum(len(s.token_ids) for s in spans)
    np.testing.assert_allclose(np.asarray(got)[:real], np.asarray(want)[:real], atol=2e-5)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_a_page_copy_and_the_host_tier_s_page_moves_carry_the_codes_and_scales(name: str) -> None:
    """(fp8 on CPU is indexed as its bits: the numbers must come through unchanged.)"""
    _, cache, _, _, _ = quantized_step(np.random.RandomState(6), name)
    before = [np.asarray(leaf.astype(jnp.float32)) for leaf in jax.tree.leaves(cache)]
    copied = copy_page(cache, jnp.int32(3), jnp.int32(9), None)  # (donates the cache)
    after = [np.asarray(leaf.astype(jnp.float32)) for leaf in jax.tree.leaves(copied)]
    assert len(after) == 4 and jax.tree.leaves(copied)[0].dtype == kv_dtype(name, jnp.float32)
    for old, new in zip(before, after, strict=True):
        np.testing.assert_array_equal(new[:, :, 9], old[:, :, 3])
        np.testing.assert_array_equal(np.delete(new, 9, axis=2), np.delete(old, 9, axis=2))
    one = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("x",)), PartitionSpec())
    saved = gather_pages(copied, jnp.asarray([3, 5]), 2, one)
    moved = scatter_pages(copied, jnp.asarray([10, 11]), saved, 2, one)
    for old, new in zip(after, jax.tree.leaves(moved), strict=True):
        np.testing.assert_array_equal(np.asarray(new.astype(jnp.float32))[:, :, [10, 11]], old[:, :, [3, 5]])
