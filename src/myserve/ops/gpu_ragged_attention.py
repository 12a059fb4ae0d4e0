"""Our Pallas (Triton) paged attention for GPUs: both views of a ragged step, prefill blocks and decode rows.

JAX's paged decode kernel (``ops/gpu_attention.py``) takes one query token per sequence, so a
step's prefill blocks go through the reference, which gathers every block's whole context into a
copy and computes every chunk for every block, even the chunks past a block's last query. This
kernel reads one view of the step (``ops/ragged_batch.py``) as it is:

- **Programs.** One per (row, KV head, query tile, K split). A row's queries that read one KV head,
  its ``Q`` tokens times the ``g`` query heads grouped on it, are one ``[Q * g, D]`` matrix
  (token-major), padded to a power of two of at least 16 rows (a Triton dot's smallest) and cut
  into tiles of ``BLOCK_M`` rows. Each K/V block a program loads serves all of them: GQA costs no
  extra reads, and no query head is padded beyond the 16 rows a decode row's group needs.
- **Only the blocks a row needs.** A program reads the K/V blocks from the first its window
  still sees (0 without a window) to the one holding its last query (not the row's page-table
  width): the loop's trip count is data-dependent *inside* the kernel, which costs the host
  nothing (one custom call per layer). Causality, the window and padding are masks by absolute
  position, as the reference's (``ops/attention.py``); ``soft_cap`` caps the scaled scores first.
- **Pages in place.** The reference cache ``[layers, kv_heads, pages, page_size, D]`` is read
  through its merged page axis (a bitcast, as ``ops/gpu_attention.py`` does): page ``p`` of KV
  head ``j`` of layer ``l`` is page ``(l * kv_heads + j) * pages + p``. A K/V block is
  ``pages_per_block`` pages gathered by their ids (a Triton gather load), not a copy of the layer.
- **Split K (flash-decoding).** A decode view of few rows has too few programs for a GPU's SMs at
  long contexts, so its blocks are split over ``k_splits`` programs whose partial results (the
  output and its log-sum-exp) are merged outside the kernel.

The tile sizes and the split target are first choices, to be tuned on a GPU (``BLOCK_M``,
``KV_BLOCK_TOKENS``, ``SPLIT_PROGRAMS``). The kernel runs on CPU in Pallas's interpreter
(``interpret=True``): the tests check it against the reference there, and that it lowers to one
Triton call per view for CUDA.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from myserve.ops.paged_cache import KVCache
from myserve.ops.ragged_batch import AttentionView

BLOCK_M = 64
"""Query rows (tokens x grouped heads) per program, at most."""
KV_BLOCK_TOKENS = 128
"""Context tokens per K/V block a program loads at once (whole pages: at least one page)."""
SPLIT_PROGRAMS = 256
"""A decode view is split over K until it has about this many programs (an H100 has 132 SMs)."""
MIN_ROWS = 16
"""A Triton dot's smallest dimension: a tile has at least this many query rows."""

_NT = (((1,), (1,)), ((), ()))
"""A dot contracting both operands' last axes (queries times keys, no transposed copy)."""
# Finite, so that a query row that sees nothing gives zeros, not NaN.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def view_attention(
    q: jax.Array,
    cache: KVCache,
    layer: int | jax.Array,
    view: AttentionView,
    *,
    num_tokens: int,
    sm_scale: float,
    window: int | None = None,
    soft_cap: float | None = None,
    cache_sharding: NamedSharding | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Attention of one view's rows: ``q`` [T + 1, heads, D] (the step's flat queries and a zero
    row at ``num_tokens`` = T) over layer ``layer`` of ``cache`` (this step's K/V written) ->
    [N, Q, heads, D] float32. ``window``, ``soft_cap``: as the reference's. ``cache_sharding``:
    with KV heads split over devices, the kernel runs on each device's own heads (``shard_map``).
    ``interpret``: run in Pallas's interpreter (None: on a CPU, where the tests run it)."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    call = functools.partial(
        _view_attention, layer=layer, num_tokens=num_tokens, sm_scale=sm_scale,
        window=window, soft_cap=soft_cap, interpret=interpret,
    )  # fmt: skip
    heads = None if cache_sharding is None else cache_sharding.spec[1] if len(cache_sharding.spec) > 1 else None
    rows = q[view.idx]  # [N, Q, heads, D]
    args = (rows, cache.k, cache.v, view.idx, view.positions, view.pages, cache.k_scale, cache.v_scale)
    if heads is None:
        return call(*args)
    cached = P(None, heads)  # K, V and (quantized) their scales: KV heads split
    per_device = jax.shard_map(
        call,
        mesh=cache_sharding.mesh,  # type: ignore[union-attr]
        in_specs=(P(None, None, heads, None), cached, cached, P(), P(), P(), cached, cached),
        out_specs=P(None, None, heads, None),
        check_vma=False,
    )
    return per_device(*args)  # type: ignore[no-any-return]


def tiles(num_queries: int, group: int) -> tuple[int, int]:
    """``(padded rows, rows per program)`` of a row's ``num_queries`` tokens times ``group`` heads:
    a power of two of at least ``MIN_ROWS``, cut into tiles of at most ``BLOCK_M``."""
    rows = max(MIN_ROWS, 1 << max(num_queries * group - 1, 0).bit_length())
    return rows, min(rows, BLOCK_M)


def pages_per_block(page_size: int, width: int) -> int:
    """Pages a K/V block gathers: ``KV_BLOCK_TOKENS`` worth (at least one page), dividing the
    page-table ``width`` (so that no block reads past it)."""
    return math.gcd(width, max(1, KV_BLOCK_TOKENS // page_size))


def k_splits(programs: int, blocks: int) -> int:
    """Splits of a row's K/V blocks for a view of ``programs`` programs without splitting, at most
    ``blocks`` (a power of two): enough to reach ``SPLIT_PROGRAMS`` programs."""
    want = -(-SPLIT_PROGRAMS // max(programs, 1))
    return max(1, min(1 << (want - 1).bit_length(), 1 << (max(blocks, 1).bit_length() - 1)))


def _view_attention(
    rows: jax.Array,
    k: jax.Array,
    v: jax.Array,
    idx: jax.Array,
    positions: jax.Array,
    pages: jax.Array,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    *,
    layer: int | jax.Array,
    num_tokens: int,
    sm_scale: float,
    window: int | None,
    soft_cap: float | None,
    interpret: bool,
) -> jax.Array:
    """``view_attention`` on one device's heads: ``rows`` [N, Q, heads, D], ``k``/``v`` [layers,
    kv_heads, pages, page_size, D] (quantized: with their scales [..., page_size, 1])."""
    n, qn, h, d = rows.shape
    num_layers, kvh, num_pages, page_size, _ = k.shape
    g = h // kvh
    m_pad, block_m = tiles(qn, g)
    width = pages.shape[1]
    ppb = pages_per_block(page_size, width)
    block_k = ppb * page_size
    splits = k_splits(n * kvh * (m_pad // block_m), width // ppb) if qn == 1 else 1

    # Queries [N, KVH, M, D], token-major within a KV head's group; padding rows are zeros.
    qs = (rows.astype(jnp.float32) * sm_scale).astype(rows.dtype)
    qs = qs.reshape(n, qn, kvh, g, d).transpose(0, 2, 1, 3, 4).reshape(n, kvh, qn * g, d)
    qs = jnp.pad(qs, ((0, 0), (0, 0), (0, m_pad - qn * g), (0, 0)))
    valid = idx < num_tokens
    q_pos = jnp.where(valid, positions, -1).astype(jnp.int32)  # -1: a padding query sees nothing
    row_pos = jnp.pad(jnp.repeat(q_pos, g, axis=1), ((0, 0), (0, m_pad - qn * g)), constant_values=-1)
    # The blocks each row reads: up to its last query's, from the first its window still sees.
    last = jnp.max(q_pos, axis=1)  # -1 for a padding row: no block
    first = jnp.zeros_like(last)
    if window is not None:
        oldest = jnp.min(jnp.where(valid, positions, jnp.iinfo(jnp.int32).max), axis=1)
        first = jnp.maximum(oldest - (window - 1), 0) // block_k
    end = (last + block_k) // block_k
    bounds = jnp.stack([jnp.minimum(first, end), end], axis=1).astype(jnp.int32)  # [N, 2]
    # Page ids in the merged cache, the layer's offset included (entries past a row's context may
    # be anything: clipped, and masked by position).
    tables = (jnp.clip(pages, 0, num_pages - 1) + layer * kvh * num_pages).astype(jnp.int32)
    merged = (num_layers * kvh * num_pages, page_size, d)  # bitcasts: no data moves

    quantized = k_scale is not None and v_scale is not None
    kernel = functools.partial(
        _kernel, splits=splits, pages_per_block=ppb, block_k=block_k, num_pages=num_pages,
        window=window, soft_cap=soft_cap, quantized=quantized,
    )  # fmt: skip
    grid = (n, kvh, m_pad // block_m, splits)
    out_dtype = rows.dtype if splits == 1 else jnp.float32
    whole = pl.BlockSpec(merged, lambda i, j, t, s: (0, 0, 0))
    scales: tuple[jax.Array, ...] = ()
    if k_scale is not None and v_scale is not None:  # [merged pages, page_size]: bitcasts too
        scales = (k_scale.reshape(merged[:2]), v_scale.reshape(merged[:2]))
    out, lse = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((None, 2), lambda i, j, t, s: (i, 0)),  # bounds
            pl.BlockSpec((None, width), lambda i, j, t, s: (i, 0)),  # tables
            pl.BlockSpec((None, block_m), lambda i, j, t, s: (i, t)),  # row_pos
            pl.BlockSpec((None, None, block_m, d), lambda i, j, t, s: (i, j, t, 0)),  # queries
            whole,  # k
            whole,  # v
            *[pl.BlockSpec(merged[:2], lambda i, j, t, s: (0, 0))] * len(scales),  # their scales
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, block_m, d), lambda i, j, t, s: (s, i, j, t, 0)),
            pl.BlockSpec((None, None, None, block_m), lambda i, j, t, s: (s, i, j, t)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((splits, n, kvh, m_pad, d), out_dtype),
            jax.ShapeDtypeStruct((splits, n, kvh, m_pad), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=_compiler_params(),
        name=f"ragged_paged_attention_m{block_m}_k{block_k}_s{splits}",
    )(bounds, tables, row_pos, qs, k.reshape(merged), v.reshape(merged), *scales)
    if splits == 1:
        o = out[0].astype(jnp.float32)
    else:  # merge the splits' partial softmaxes by their log-sum-exps
        top = jnp.max(lse, axis=0)
        weight = jnp.exp(lse - top[None])
        o = jnp.sum(out * weight[..., None], axis=0) / jnp.maximum(jnp.sum(weight, axis=0), 1e-30)[..., None]
    o = o[:, :, : qn * g].reshape(n, kvh, qn, g, d).transpose(0, 2, 1, 3, 4)
    return o.reshape(n, qn, h, d)


def _kernel(
    bounds_ref: jax.Array,
    tables_ref: jax.Array,
    pos_ref: jax.Array,
    q_ref: jax.Array,
    k_ref: jax.Array,
    v_ref: jax.Array,
    *refs: jax.Array,
    splits: int,
    pages_per_block: int,
    block_k: int,
    num_pages: int,
    window: int | None,
    soft_cap: float | None,
    quantized: bool,
) -> None:
    """One program: a tile of one row's query rows for one KV head, over its split of the row's
    K/V blocks, with an online softmax. ``refs``: the K and V scales when ``quantized``, then the
    outputs: a quantized block is widened to the queries' dtype in registers, its keys' scales
    multiply the scores and its values' the weights."""
    ks_ref = vs_ref = None
    if quantized:
        ks_ref, vs_ref, o_ref, lse_ref = refs
    else:
        o_ref, lse_ref = refs
    head, split = pl.program_id(1), pl.program_id(3)
    first, end = bounds_ref[0], bounds_ref[1]
    per_split = (end - first + splits - 1) // splits
    start = first + split * per_split
    stop = jnp.minimum(end, start + per_split)
    q = q_ref[...]  # [BM, D], scaled
    q_pos = pos_ref[...]  # [BM]
    block_m, d = q.shape

    def body(b: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
        acc, m, denom = carry
        ids = tables_ref[pl.ds(b * pages_per_block, pages_per_block)] + head * num_pages
        keys = k_ref[ids].reshape(block_k, d).astype(q.dtype)
        values = v_ref[ids].reshape(block_k, d).astype(q.dtype)
        s = lax.dot_general(q, keys, _NT, preferred_element_type=jnp.float32)  # [BM, BK]
        if ks_ref is not None:
            s = s * ks_ref[ids].reshape(1, block_k).astype(jnp.float32)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kv_pos = b * block_k + lax.broadcasted_iota(jnp.int32, (block_m, block_k), 1)
        see = kv_pos <= q_pos[:, None]  # causal; a query's position is below its row's length
        if window is not None:
            see &= kv_pos > q_pos[:, None] - window
        s = jnp.where(see, s, _MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        correction = jnp.exp(m - m_new)
        denom = denom * correction + jnp.sum(p, axis=1)
        weights = p if vs_ref is None else p * vs_ref[ids].reshape(1, block_k).astype(jnp.float32)
        acc = acc * correction[:, None] + jnp.dot(
            weights.astype(values.dtype), values, preferred_element_type=jnp.float32
        )
        return acc, m_new, denom

    init = (
        jnp.zeros((block_m, d), jnp.float32),
        jnp.full((block_m,), _MASK_VALUE, jnp.float32),
        jnp.zeros((block_m,), jnp.float32),
    )
    acc, m, denom = lax.fori_loop(start, stop, body, init)
    # A row that read nothing (padding, an empty split) has denom 0: zeros, and a log-sum-exp so
    # low that the merge gives it no weight.
    safe = jnp.maximum(denom, 1e-30)
    o_ref[...] = (acc / safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(safe)


def _compiler_params() -> plgpu.CompilerParams:
    """Triton's launch parameters (ignored by the interpreter)."""
    return plgpu.CompilerParams(num_warps=4, num_stages=2)


def ragged_fit(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int) -> str | None:
    """Why this kernel cannot serve a model on a GPU, or None if it can: Triton blocks need
    power-of-two sizes of at least 16, ``head_dim`` and a K/V block's tokens (whole pages, so a
    page of at least 16 tokens), and query heads grouped evenly on KV heads. Sliding windows and
    soft caps it has. (JAX's decode kernel has the same shape limits: ``gpu_attention.gpu_fit``.)"""
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two >= 16"
    if page_size < 16 or page_size & (page_size - 1):
        return f"page_size {page_size} is not a power of two >= 16"
    if num_heads % num_kv_heads:
        return f"{num_heads} query heads do not group evenly over {num_kv_heads} KV heads"
    return None
