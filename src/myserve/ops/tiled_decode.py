"""Decode attention whose cost follows each row's own context (the reference's single view on a CPU).

The reference reads every row of a view to the width of the step's page tables: the context bucket
that holds the step's *longest* row. At many streams that is most of the work: 64 chat streams with
the HTTP benchmark's prompts (5-304 tokens, 128 generated) sit in the 512-token bucket while their
contexts fill ~30 % of it, and on the 16-layer yardstick attention was 74 % of a decode call's device
time (the page gathers alone 33 %, each writing the whole ``[kv_heads, rows, 512, head_dim]`` copy).

Here a step's one-token rows are cut into **tiles**: ``TILE_TOKENS`` consecutive positions of one
row (a few whole pages), only as many as each row's context needs. The tiles of all rows are one flat
list, rows in order, computed ``GROUP_TILES`` at a time in a loop that runs only as many groups as
the rows fill (a data-dependent trip count: on a CPU the executable's own thread decides it, no host
round trip). Each tile's scores, softmax and values use its own maximum; each row's tiles are then
merged (flash decoding's log-sum-exp combination: a row's tiles gathered into a ``[rows, tiles per
row]`` grid, rescaled by their maxima). Views too small to skip a group take the reference's dense
pass. Over HTTP at 64 streams on a 2-core AVX-512 host (``docs/performance.md``): the bundled
SmolLM2 1.19-1.28x the dense pass, the 2-layer yardstick 1.12x.

Accelerators keep their kernels, which read each row's own pages already; this is the CPU's path.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from myserve.ops.paged_cache import KVCache, page_scores
from myserve.ops.ragged_batch import AttentionView

TILE_TOKENS = 128
"""Positions per tile (whole pages): long enough that a tile's two small dots and its softmax cost
more in work than in dispatch (in a script at 64 rows of the 16-layer yardstick's heads: 64-token
tiles ~8 % slower, 16-token ones slower than the dense pass)."""

GROUP_TILES = 32
"""Tiles one iteration of the loop computes (4,096 positions of 128): enough work per iteration
that the loop's own cost (a few small ops) stays small beside it (16 and 32 measured alike in the
same script)."""

LOOP_SCOPE = "tiled_decode_groups"
"""The name scope of the loop over groups: its HLO ``while`` carries it in its metadata."""

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def tile_pages(page_size: int, width: int) -> int:
    """Pages per tile for pages of ``page_size`` tokens and page tables ``width`` pages wide."""
    return max(1, min(width, TILE_TOKENS // page_size))


def group_count(rows: int, width: int, page_size: int) -> int:
    """Groups of ``GROUP_TILES`` a view of ``rows`` rows and ``width`` pages holds at most when
    every row fills its table; 0 when the view takes the dense pass (fewer than two groups: no
    group could be skipped)."""
    dense = rows * -(-width // tile_pages(page_size, width))
    groups = -(-dense // GROUP_TILES)
    return groups if groups >= 2 else 0


def single_view_attention(
    q: jax.Array,
    cache: KVCache,
    layer: int | jax.Array,
    view: AttentionView,
    *,
    sm_scale: float,
    soft_cap: float | None,
    heads_sharded: bool,
    dense: Callable[[], jax.Array],
) -> jax.Array:
    """Attention of the one-token rows of ``view`` (queries ``q`` [T + 1, heads, D], last row zeros)
    over their context: [N, 1, heads, D] float32, as the reference's ``dense()`` gives it (which
    runs instead when the view is too small to skip anything, ``group_count``)."""
    n, width = view.pages.shape
    groups = group_count(n, width, cache.page_size)
    if not groups:
        return dense()
    _, h, d = q.shape
    kvh = cache.k.shape[1]
    g = h // kvh
    tp = tile_pages(cache.page_size, width)
    span = tp * cache.page_size
    capacity = groups * GROUP_TILES
    # Tile j belongs to row `row[j]` (rows in order, each row's tiles consecutive) and reads the
    # row's tile `nth[j]`; tiles past the rows' total are masked out and merged nowhere.
    counts = (view.kv_lens + span - 1) // span  # [N] (padding rows: 0)
    ends = jnp.cumsum(counts)
    j = jnp.arange(capacity, dtype=ends.dtype)
    row = jnp.minimum(jnp.sum(ends[None, :] <= j[:, None], axis=1), n - 1)
    firsts = ends - counts
    nth = j - firsts[row]
    page_idx = jnp.clip(nth[:, None] * tp + jnp.arange(tp), 0, width - 1)
    pages = jnp.take_along_axis(view.pages[row], page_idx, axis=1)  # [C, tp]
    kv_pos = nth[:, None] * span + jnp.arange(span)  # [C, span]
    q_pos = view.positions[:, 0]
    see = (j < ends[-1])[:, None] & (kv_pos < view.kv_lens[row][:, None]) & (kv_pos <= q_pos[row][:, None])
    queries = q[view.idx[:, 0]].reshape(n, kvh, g, d).transpose(1, 0, 2, 3)  # [KVH, N, g, D]

    def group(i: jax.Array, stats: jax.Array) -> jax.Array:
        """Tiles ``i * GROUP_TILES ...``: each one's values summed by its own softmax weights, the
        weights' sum and their maximum, into ``stats`` [KVH, C + 1, g, D + 2]."""
        at = i * GROUP_TILES
        tiles = lax.dynamic_slice_in_dim(pages, at, GROUP_TILES)
        qm = queries[:, lax.dynamic_slice_in_dim(row, at, GROUP_TILES)]  # [KVH, G, g, D]
        s, values, v_scale = page_scores(
            qm, cache, layer, tiles, sm_scale=sm_scale, soft_cap=soft_cap, heads_sharded=heads_sharded
        )
        s = jnp.where(lax.dynamic_slice_in_dim(see, at, GROUP_TILES)[None, :, None, :], s, _MASK_VALUE)
        m = s.max(axis=-1)  # [KVH, G, g]: each tile's own maximum
        p = jnp.exp(s - m[..., None])
        pv = p if v_scale is None else p * v_scale
        o = jnp.einsum("kcgs,kcsd->kcgd", pv.astype(values.dtype), values, preferred_element_type=jnp.float32)
        part = jnp.concatenate([o, p.sum(axis=-1)[..., None], m[..., None]], axis=-1)
        return lax.dynamic_update_slice_in_dim(stats, part, at, axis=1)

    # The slot past the tiles (`capacity`): an empty tile, maximum masked and sums zero, where each
    # row's grid points past its own tiles.
    empty = jnp.zeros((kvh, capacity + 1, g, d + 2), jnp.float32).at[..., -1].set(_MASK_VALUE)
    needed = (ends[-1] + GROUP_TILES - 1) // GROUP_TILES
    with jax.named_scope(LOOP_SCOPE):  # (a data-dependent trip count: CPU only, named for the HLO checks)
        stats = lax.fori_loop(0, needed, group, empty)
    r = jnp.arange(-(-width // tp))
    grid = jnp.where(r[None, :] < counts[:, None], firsts[:, None] + r[None, :], capacity)  # [N, tiles per row]
    tiles = stats[:, grid]  # [KVH, N, tiles per row, g, D + 2]
    tile_max = tiles[..., -1]
    weight = jnp.exp(tile_max - tile_max.max(axis=2, keepdims=True))  # [KVH, N, tiles per row, g]
    acc = jnp.sum(tiles[..., :d] * weight[..., None], axis=2)
    denom = jnp.sum(tiles[..., d] * weight, axis=2)
    out = acc / jnp.maximum(denom, 1e-30)[..., None]  # [KVH, N, g, D]
    return out.transpose(1, 0, 2, 3).reshape(n, 1, h, d)
