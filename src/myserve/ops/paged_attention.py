"""Paged attention: the KV-cache layout, the cache write and the attention read, with a backend switch.

Cache layout of the reference path (two arrays for the whole model, donated into every jitted
step; the TPU kernel's layout is in ``ops/kernel_attention.py``)::

    KVCache.k, KVCache.v: [layers, kv_heads, pages, page_size, head_dim]

Head-major: the pages of one KV head are one contiguous block, so gathering a row's pages for a
head gives its keys as a contiguous ``[context, head_dim]`` matrix. The attention then computes
``K @ q^T`` with the keys as the left operand of a plain GEMM. With K/V interleaved per token (the
TPU kernel's layout) XLA:CPU has to transpose the gathered keys of every layer of every step, and
that transpose, the gather and tiny per-head batched dots cost SmolLM2 about 2x the time of all its
matmuls at 32 concurrent decodes (measured: 6.5 -> 3.4 ms per layer). ``kv_heads`` shards over the
``model`` mesh axis.

Queries arrive as a padded batch ``[B, T]``: row ``b`` holds ``q_lens[b]`` new tokens of one
sequence (a prefill chunk, or a single decode token), the rest is padding. Token ``(b, t)`` sits at
absolute position ``positions[b, t]`` and is stored in page ``page_table[b, pos // page_size]`` at
offset ``pos % page_size``; after the write, row ``b``'s context is ``kv_lens[b]`` tokens long. The
new tokens are always the tail of their sequence, so causal masking by position is exact.
"""

from __future__ import annotations

import math
from typing import Protocol

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax

# Finite, so a fully masked (padding) row gives a uniform softmax instead of NaN.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


class KVCache(eqx.Module):
    """The paged KV cache of every layer: keys and values, ``[layers, kv_heads, pages, page_size, head_dim]``."""

    k: jax.Array
    v: jax.Array

    @property
    def num_pages(self) -> int:
        """Pages in the pool."""
        return self.k.shape[2]

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self.k.shape[3]


class PageBatch(eqx.Module):
    """Attention metadata of one step: where each query token is and which pages hold its context.

    All fields are int32 device arrays; padding rows have ``q_lens == kv_lens == 0``; each row
    reads its pages ``page_table`` [B, P]. The padded-row layout of ``python -m myserve.generate``
    and the parity tests; the serving engine's steps are ragged (``ops/ragged_attention.py``).
    """

    positions: jax.Array
    """[B, T] absolute position of each query token (anything for padding tokens)."""
    q_lens: jax.Array
    """[B] number of real (non-padding) query tokens in each row."""
    kv_lens: jax.Array
    """[B] context length of each row after this step's tokens are written."""
    write_pages: jax.Array
    """[B, T] page receiving each query token's K/V (at offset position % page_size)."""
    page_table: jax.Array
    """[B, P] page ids of each row's sequence, in order; entries past its length are ignored."""


class TokenSlots(Protocol):
    """Where a step's tokens go in the cache: what ``write_kv`` reads (``PageBatch``, ``RaggedBatch``)."""

    @property
    def positions(self) -> jax.Array: ...  # [B, T]
    @property
    def q_lens(self) -> jax.Array: ...  # [B]
    @property
    def write_pages(self) -> jax.Array: ...  # [B, T]


def write_kv(cache: KVCache, layer: int | jax.Array, k: jax.Array, v: jax.Array, batch: TokenSlots) -> KVCache:
    """Scatter this step's keys and values into their pages.

    Args:
        cache: the whole cache (the caller donates it, so XLA updates it in place).
        layer: the layer being written.
        k, v: [B, T, kv_heads, head_dim]
        batch: positions and pages of the step's tokens.
    """
    t = k.shape[1]
    valid = jnp.arange(t)[None, :] < batch.q_lens[:, None]
    # Padding tokens target an out-of-range page, and mode="drop" discards those writes.
    page_idx = jnp.where(valid, batch.write_pages, cache.num_pages)
    offset = batch.positions % cache.page_size
    # Indexing [layer, :, page_idx, offset] puts the [B, T] index dims first: updates are [B, T, KVH, D].
    new_k = cache.k.at[layer, :, page_idx, offset].set(k.astype(cache.k.dtype), mode="drop")
    new_v = cache.v.at[layer, :, page_idx, offset].set(v.astype(cache.v.dtype), mode="drop")
    return KVCache(new_k, new_v)


def _gather_pages(x: jax.Array, layer: int | jax.Array, page_table: jax.Array, heads_sharded: bool) -> jax.Array:
    """Pages ``page_table`` [N, P] of every KV head of one layer: [kv_heads, N, P, page_size * D].

    Unsharded heads: a gather of whole pages as rows of the flattened cache (contiguous
    ``page_size * head_dim`` rows) with in-bounds indices promised, ~25 % faster on XLA:CPU than
    indexing ``x[layer][:, table]``. That flattening merges the ``kv_heads`` axis, so with heads
    sharded over ``model`` XLA would all-gather the whole cache every layer; there a gather that
    keeps ``kv_heads`` as a whole-axis (passthrough) slice runs on each shard's own heads
    (~20 % slower on one CPU device, no collective).
    """
    num_layers, kvh, num_pages = x.shape[:3]
    pages = jnp.clip(page_table, 0, num_pages - 1)
    if heads_sharded:
        x4 = x.reshape(num_layers, kvh, num_pages, -1)
        index = jnp.stack([jnp.broadcast_to(layer, pages.shape).astype(pages.dtype), pages], axis=-1)
        dims = lax.GatherDimensionNumbers(offset_dims=(0, 3), collapsed_slice_dims=(0, 2), start_index_map=(0, 2))
        sizes = (1, kvh, 1, x4.shape[-1])
        return lax.gather(x4, index, dims, slice_sizes=sizes, mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)
    rows = x.reshape(num_layers * kvh * num_pages, -1)
    heads = (layer * kvh + jnp.arange(kvh, dtype=pages.dtype)) * num_pages
    return rows.at[heads[:, None, None] + pages[None]].get(mode="promise_in_bounds")


def reference_paged_attention(
    q: jax.Array,
    cache: KVCache,
    layer: int | jax.Array,
    batch: PageBatch,
    *,
    sm_scale: float,
    heads_sharded: bool = False,
) -> jax.Array:
    """Pure-JAX paged attention; runs everywhere and is the numerical reference for kernels.

    Gathers each row's context pages per KV head into contiguous ``[context, head_dim]`` blocks,
    then does masked grouped-query attention with a float32 softmax; the scores are computed
    context-major (``K @ q^T``) so the gathered keys are used as they lie.

    Args:
        q: [B, T, heads, head_dim]
        cache: the KV cache, this step's tokens already written.
        layer: the layer to read.
        batch: step metadata.
        heads_sharded: the cache's KV heads are sharded over a mesh axis (see ``_gather_pages``).
    Returns:
        [B, T, heads, head_dim] in q's dtype.
    """
    b, t, h, d = q.shape
    kvh = cache.k.shape[1]
    group = h // kvh
    # A query sees its row's context up to its own position (causal).
    pages = batch.page_table
    qm = q.reshape(b, t, kvh, group, d).transpose(0, 2, 1, 3, 4).reshape(b, kvh, t * group, d)
    kv_pos = jnp.arange(pages.shape[1] * cache.page_size)
    mask = (kv_pos[None, :, None] <= batch.positions[:, None, :]) & (
        kv_pos[None, :, None] < batch.kv_lens[:, None, None]
    )  # [B, S, T]
    mask = jnp.repeat(mask, group, axis=2)  # [B, S, T * group]
    keys, values = (_gather_pages(x, layer, pages, heads_sharded).reshape(kvh, b, -1, d) for x in (cache.k, cache.v))
    scores = jnp.einsum("knsd,nkmd->knsm", keys, qm, preferred_element_type=jnp.float32) * sm_scale
    scores = jnp.where(mask[None], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=2).astype(values.dtype)
    out = jnp.einsum("knsm,knsd->nkmd", probs, values, preferred_element_type=jnp.float32)
    out = out.reshape(b, kvh, t, group, d).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, h, d).astype(q.dtype)


def paged_attention(
    q: jax.Array,
    cache: KVCache,
    layer: int | jax.Array,
    batch: PageBatch,
    *,
    heads_sharded: bool = False,
) -> jax.Array:
    """Attention of ``q`` [B, T, heads, head_dim] over each row's paged context (already written).

    ``heads_sharded``: the cache's KV heads are split over devices (tensor parallelism). The
    padded-row layout always uses the reference; the serving engine's ragged steps use the TPU
    kernel where it is picked (``ops/kernel_attention.py``).
    """
    sm_scale = 1.0 / math.sqrt(q.shape[-1])
    return reference_paged_attention(q, cache, layer, batch, sm_scale=sm_scale, heads_sharded=heads_sharded)
