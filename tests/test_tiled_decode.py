"""The CPU's decode attention over each row's own tiles (``ops/tiled_decode.py``): one group of tiles
and several attend as a softmax over each row's context does, and as the reference does with soft
caps and a quantized cache; padding rows and tiles past the rows' own stay out of every row's sums."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ragged_steps import device_batch

from myserve.ops import tiled_decode
from myserve.ops.attention import _view_attention, ragged_attention
from myserve.ops.paged_cache import KVCache
from myserve.runtime.step_layout import Span, StepShape

KVH, H, D, PS, WIDTH, POOL = 2, 6, 8, 16, 32, 300
SHAPE = StepShape.of(16, max_num_seqs=16, block_tokens=8, max_pages=WIDTH, chunk_pages=8)
"""Sixteen one-token rows, page tables of 32 pages (512 tokens): tiles of 8 pages, four per row, 64
in all: two groups of 32."""

CASES = {
    # contexts after this step -> the groups their tiles fill
    "one group": [1, 20, 100, 128, 129, 300, 5, 7],  # 11 tiles (and eight padding rows)
    "two groups": [512, 500, 400, 129, 385, 300, 260, 3, 200, 64, 450, 511, 17, 256, 257, 384],  # 45 tiles
}


def _tiles(contexts: list[int]) -> int:
    span = tiled_decode.tile_pages(PS, WIDTH) * PS
    return sum(-(-n // span) for n in contexts)


def _step(rng: np.random.RandomState, contexts: list[int]) -> tuple[list[Span], object]:
    """One-token spans ending at ``contexts`` on scrambled pages of the pool, and their device batch."""
    perm = [int(p) for p in rng.permutation(POOL)]
    spans, used = [], 0
    for n in contexts:
        pages = perm[used : used + -(-n // PS)]
        used += len(pages)
        spans.append(Span([0], n - 1, pages, samples=True))
    return spans, device_batch(spans, SHAPE, PS)


def _cache(rng: np.random.RandomState, quantized: bool) -> KVCache:
    shape = (1, KVH, POOL + 1, PS, D)
    if not quantized:
        return KVCache(*(jnp.asarray(rng.randn(*shape), jnp.float32) for _ in range(2)))
    codes = [jnp.asarray(rng.randint(-127, 128, size=shape), jnp.int8) for _ in range(2)]
    scales = [jnp.asarray(rng.uniform(0.001, 0.02, size=(*shape[:-1], 1)), jnp.bfloat16) for _ in range(2)]
    return KVCache(*codes, *scales)


def test_the_cases_fill_the_groups_they_name() -> None:
    assert tiled_decode.group_count(SHAPE.singles, WIDTH, PS) == 2
    assert _tiles(CASES["one group"]) <= tiled_decode.GROUP_TILES < _tiles(CASES["two groups"])
    # A view whose every tile fits one group skips nothing: it takes the dense pass.
    assert tiled_decode.group_count(8, WIDTH, PS) == 0 and tiled_decode.group_count(64, 8, 16) == 2


def test_a_view_too_small_to_skip_a_group_takes_the_dense_pass() -> None:
    rng = np.random.RandomState(3)
    shape = StepShape.of(8, max_num_seqs=8, block_tokens=8, max_pages=WIDTH, chunk_pages=8)
    batch = device_batch([Span([0], 99, list(range(7)), samples=True)], shape, PS)
    q = jnp.zeros((9, H, D), jnp.float32)
    sentinel = jnp.full((8, 1, H, D), 7.0)
    got = tiled_decode.single_view_attention(
        q, _cache(rng, False), 0, batch.single, sm_scale=1.0, soft_cap=None, heads_sharded=False, dense=lambda: sentinel
    )
    assert got is sentinel


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_tier_attends_like_a_softmax_over_the_rows_context(case: str) -> None:
    rng = np.random.RandomState(7)
    contexts = CASES[case]
    spans, batch = _step(rng, contexts)
    cache = _cache(rng, quantized=False)
    q = rng.randn(SHAPE.tokens, H, D).astype(np.float32)
    got = np.asarray(jax.jit(lambda q, c, b: ragged_attention(q, c, 0, b, sm_scale=0.35))(jnp.asarray(q), cache, batch))
    k_all, v_all = np.asarray(cache.k[0]), np.asarray(cache.v[0])
    for i, span in enumerate(spans):
        slots = [(page, off) for page in span.pages for off in range(PS)][: contexts[i]]
        for head in range(H):
            kh = head // (H // KVH)
            keys = np.stack([k_all[kh, pg, off] for pg, off in slots])
            vals = np.stack([v_all[kh, pg, off] for pg, off in slots])
            s = keys @ q[i, head] * 0.35
            w = np.exp(s - s.max())
            np.testing.assert_allclose(got[i, head], (w / w.sum()) @ vals, atol=1e-5)
    assert not got[len(spans) :].any()  # padding tokens: zeros


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_tiles_equal_the_reference_with_a_soft_cap_and_a_quantized_cache(case: str, quantized: bool) -> None:
    rng = np.random.RandomState(11)
    _, batch = _step(rng, CASES[case])
    cache = _cache(rng, quantized)
    q = jnp.asarray(rng.randn(SHAPE.tokens + 1, H, D), jnp.float32).at[-1].set(0)
    view = batch.single
    options = {"sm_scale": 0.35, "soft_cap": 1.5, "heads_sharded": False}

    @jax.jit
    def both(q, cache, view):
        dense = _view_attention(q, cache, 0, view, chunk_pages=8, **options)
        return tiled_decode.single_view_attention(q, cache, 0, view, **options, dense=lambda: dense * np.nan), dense

    tiled, dense = both(q, cache, view)
    real = len(CASES[case])
    assert np.isfinite(np.asarray(tiled)).all()  # (the NaN dense branch was not taken)
    np.testing.assert_allclose(np.asarray(tiled)[:real], np.asarray(dense)[:real], atol=2e-5)
