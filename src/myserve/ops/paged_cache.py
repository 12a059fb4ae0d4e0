"""The paged KV cache in its two layouts, and the write of a step's keys and values into it.

A token at absolute position ``pos`` of a sequence is stored in page ``pages[pos // page_size]``
at offset ``pos % page_size``; pages come from one pool shared by all sequences. The cache of
every layer is donated into each jitted step, so XLA updates it in place.

The reference layout (``KVCache``), two arrays for the whole model::

    KVCache.k, KVCache.v: [layers, kv_heads, pages + 1, page_size, head_dim]

The page past the pool (``spare_page``) is never handed out: it takes the writes of padding
tokens and of rows that stopped, so a write needs no bounds check. (Dropping an out-of-range write
instead costs XLA:CPU a check and an index reshuffle per layer, two of the few dozen small ops a
decode token's layer is.)

Head-major: the pages of one KV head are one contiguous block, so gathering a row's pages for a
head gives its keys as a contiguous ``[context, head_dim]`` matrix, and the reference attention
computes ``q @ K^T`` with the keys as they lie (a GEMM with a transposed operand). With K/V interleaved per
token XLA:CPU has to transpose the gathered keys of every layer of every step, and that transpose,
the gather and tiny per-head batched dots cost SmolLM2 about 2x the time of all its matmuls at 32
concurrent decodes (measured: 6.5 -> 3.4 ms per layer). The GPU decode kernel reads this layout too.

The TPU kernel's layout (``KernelKVCache``), one array::

    KernelKVCache.kv: [layers, pages, page_size, 2 * kv_heads, head_dim]

each head's K and V interleaved (combined head ``2h`` is K of head ``h``, ``2h + 1`` its V): the
kernel's own layout, so it reads the cache in place (``ops/tpu_attention.py``). Transposing the
reference layout into it on every call would copy the layer's whole cache. Both layouts hold the
same bytes per page; ``kv_heads`` shards over the ``model`` mesh axis in both.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax

from myserve.ops.ragged_batch import RaggedBatch


class KVCache(eqx.Module):
    """The paged KV cache of every layer: keys and values, ``[layers, kv_heads, pages + 1, page_size,
    head_dim]`` (the last page: ``spare_page``)."""

    k: jax.Array
    v: jax.Array

    @property
    def num_pages(self) -> int:
        """Pages in the pool (the spare page not counted)."""
        return self.k.shape[2] - 1

    @property
    def spare_page(self) -> int:
        """The page a write goes to when it must leave the pool untouched (never handed out)."""
        return self.k.shape[2] - 1

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self.k.shape[3]


class KernelKVCache(eqx.Module):
    """The paged KV cache in the TPU kernel's layout: ``kv`` [layers, pages, page_size, 2 * kv_heads, head_dim]."""

    kv: jax.Array

    @property
    def num_pages(self) -> int:
        """Pages in the pool (per layer)."""
        return self.kv.shape[1]

    @property
    def spare_page(self) -> int:
        """Where a write goes that must leave the pool untouched: one past it (the write drops it)."""
        return self.kv.shape[1]

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self.kv.shape[2]


def write_kv(cache: KVCache, layer: int | jax.Array, k: jax.Array, v: jax.Array, batch: RaggedBatch) -> KVCache:
    """Scatter this step's keys and values ``k``, ``v`` [1, T, kv_heads, head_dim] into their pages
    of layer ``layer`` (the caller donates the cache, so XLA updates it in place)."""
    t = k.shape[1]
    valid = jnp.arange(t)[None, :] < batch.q_lens[:, None]
    # Padding tokens (and stopped rows, whose write page is the spare one) write the spare page.
    page_idx = jnp.where(valid, batch.write_pages, cache.spare_page)
    offset = batch.positions % cache.page_size
    if t == 1:
        # One token (a one-row decode step): a slice update. XLA:CPU turns a one-update scatter into
        # one too, behind a bounds check and index shuffles of its own, per layer.
        start = (jnp.asarray(layer, jnp.int32), 0, page_idx[0, 0], offset[0, 0], 0)
        new_k = lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype).reshape(1, -1, 1, 1, k.shape[-1]), start)
        new_v = lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype).reshape(1, -1, 1, 1, v.shape[-1]), start)
        return KVCache(new_k, new_v)
    # Indexing [layer, :, page_idx, offset] puts the [1, T] index dims first: updates are [1, T, KVH, D].
    new_k = cache.k.at[layer, :, page_idx, offset].set(k.astype(cache.k.dtype), mode="promise_in_bounds")
    new_v = cache.v.at[layer, :, page_idx, offset].set(v.astype(cache.v.dtype), mode="promise_in_bounds")
    return KVCache(new_k, new_v)


def write_kv_kernel(
    cache: KernelKVCache, layer: int | jax.Array, k: jax.Array, v: jax.Array, batch: RaggedBatch
) -> KernelKVCache:
    """Scatter this step's keys and values ([1, T, kv_heads, D]) into their slots, K and V interleaved per head."""
    _, t, kvh, d = k.shape
    valid = jnp.arange(t)[None, :] < batch.q_lens[:, None]
    page_idx = jnp.where(valid, batch.write_pages, cache.spare_page)  # padding: one past the pool, dropped
    offset = batch.positions % cache.page_size
    pairs = jnp.stack([k, v], axis=3).reshape(1, t, 2 * kvh, d).astype(cache.kv.dtype)
    return KernelKVCache(cache.kv.at[layer, page_idx, offset].set(pairs, mode="drop"))
