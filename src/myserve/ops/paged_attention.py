"""Paged attention: the KV-cache write and the attention read, with a backend switch.

Cache layout (one array for the whole model, donated into every jitted step)::

    kv_cache: [layers, pages, page_size, 2 * kv_heads, head_dim]

K and V are interleaved along the head axis (K of head h at ``2h``, V at ``2h + 1``). That is the
"combined" layout the TPU ragged paged attention kernel reads, so a TPU step needs no per-step
re-layout, and sharding ``kv_heads`` over the ``model`` mesh axis keeps each K/V pair on one device.

Queries arrive as a padded batch ``[B, T]``: row ``b`` holds ``q_lens[b]`` new tokens of one
sequence (a prefill chunk, or a single decode token), the rest is padding. Token ``(b, t)`` sits at
absolute position ``positions[b, t]`` and is stored in page ``page_table[b, pos // page_size]`` at
offset ``pos % page_size``; after the write, row ``b``'s context is ``kv_lens[b]`` tokens long. The
new tokens are always the tail of their sequence, so causal masking by position is exact.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp

logger = logging.getLogger(__name__)

AttentionBackend = Literal["auto", "reference", "pallas"]

# Finite, so a fully masked (padding) row gives a uniform softmax instead of NaN.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


class PageBatch(eqx.Module):
    """Attention metadata of one step: where each query token is and which pages hold its context.

    All fields are int32 device arrays; padding rows have ``q_lens == kv_lens == 0``.
    """

    positions: jax.Array
    """[B, T] absolute position of each query token (anything for padding tokens)."""
    q_lens: jax.Array
    """[B] number of real (non-padding) query tokens in each row."""
    kv_lens: jax.Array
    """[B] context length of each row after this step's tokens are written."""
    page_table: jax.Array
    """[B, P] page ids of each row's sequence, in order; entries past its length are ignored."""


def write_kv(kv_cache: jax.Array, layer: jax.Array, k: jax.Array, v: jax.Array, batch: PageBatch) -> jax.Array:
    """Scatter this step's keys and values into their pages.

    Args:
        kv_cache: [layers, pages, page_size, 2 * kv_heads, head_dim]
        layer: int32 scalar, the layer being written.
        k, v: [B, T, kv_heads, head_dim]
        batch: positions and page table of the step.
    Returns:
        The updated cache (the caller donates the input, so XLA updates it in place).
    """
    num_pages, page_size = kv_cache.shape[1], kv_cache.shape[2]
    b, t, kvh, d = k.shape
    pos = batch.positions
    valid = jnp.arange(t)[None, :] < batch.q_lens[:, None]
    page_idx = jnp.take_along_axis(batch.page_table, jnp.clip(pos // page_size, 0, None), axis=1)
    # Padding tokens target an out-of-range page, and mode="drop" discards those writes.
    page_idx = jnp.where(valid, page_idx, num_pages)
    offset = pos % page_size
    kv = jnp.stack([k, v], axis=-2).reshape(b, t, 2 * kvh, d).astype(kv_cache.dtype)
    return kv_cache.at[layer, page_idx, offset].set(kv, mode="drop")


def reference_paged_attention(
    q: jax.Array, kv_cache: jax.Array, layer: jax.Array, batch: PageBatch, *, sm_scale: float
) -> jax.Array:
    """Pure-JAX paged attention; runs everywhere and is the numerical reference for kernels.

    Gathers each row's pages into a contiguous [P * page_size] context, then does masked grouped-
    query attention with a float32 softmax.

    Args:
        q: [B, T, heads, head_dim]
        kv_cache: [layers, pages, page_size, 2 * kv_heads, head_dim]
        layer: int32 scalar.
        batch: step metadata.
    Returns:
        [B, T, heads, head_dim] in q's dtype.
    """
    b, t, h, d = q.shape
    _, _, page_size, kvh2, _ = kv_cache.shape
    kvh = kvh2 // 2
    group = h // kvh
    # One gather with the layer folded into the indices: slicing kv_cache[layer] first would copy
    # a whole layer of the cache every step.
    ctx = kv_cache[layer, batch.page_table]  # [B, P, page_size, 2*kvh, D]
    ctx = ctx.reshape(b, -1, kvh, 2, d)
    keys, values = ctx[..., 0, :], ctx[..., 1, :]  # [B, S, kvh, D]
    s = keys.shape[1]

    qg = q.reshape(b, t, kvh, group, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, keys, preferred_element_type=jnp.float32) * sm_scale
    kv_pos = jnp.arange(s)
    mask = (kv_pos[None, None, :] <= batch.positions[:, :, None]) & (
        kv_pos[None, None, :] < batch.kv_lens[:, None, None]
    )  # [B, T, S]
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, values, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q.dtype)


@functools.cache
def _tpu_kernel():  # pragma: no cover - needs a TPU
    try:
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention
    except ImportError as e:
        logger.warning("Pallas ragged paged attention unavailable (%s); using the reference", e)
        return None
    return ragged_paged_attention


def _pallas_paged_attention(
    q: jax.Array, kv_cache: jax.Array, layer: jax.Array, batch: PageBatch, *, sm_scale: float
) -> jax.Array:  # pragma: no cover - needs a TPU
    """TPU path: pack the padded rows into the kernel's ragged layout, run it, unpack."""
    kernel = _tpu_kernel()
    b, t, h, d = q.shape
    # Real tokens of all rows packed to the front, in row order: cu_q_lens describes them.
    valid = (jnp.arange(t)[None, :] < batch.q_lens[:, None]).reshape(-1)
    order = jnp.argsort(~valid, stable=True)
    q_ragged = q.reshape(b * t, h, d)[order]
    cu_q_lens = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(batch.q_lens).astype(jnp.int32)])
    num_seqs = jnp.sum(batch.q_lens > 0, dtype=jnp.int32).reshape(1)
    out = kernel(q_ragged, kv_cache[layer], batch.kv_lens, batch.page_table, cu_q_lens, num_seqs, sm_scale=sm_scale)
    unpacked = jnp.zeros_like(out).at[order].set(out)
    return unpacked.reshape(b, t, h, d)


def resolve_backend(backend: AttentionBackend) -> Literal["reference", "pallas"]:
    """Pick the attention implementation: the Pallas ragged kernel on TPU if it imports, else reference."""
    if backend == "reference":
        return "reference"
    on_tpu = jax.default_backend() == "tpu"
    if backend == "pallas" and not on_tpu:
        raise ValueError("attention_backend 'pallas' needs a TPU; use 'auto' or 'reference'")
    if on_tpu and _tpu_kernel() is not None:
        return "pallas"
    return "reference"


def paged_attention(
    q: jax.Array,
    kv_cache: jax.Array,
    layer: jax.Array,
    batch: PageBatch,
    *,
    backend: Literal["reference", "pallas"] = "reference",
) -> jax.Array:
    """Attention of ``q`` [B, T, heads, head_dim] over each row's paged context (already written)."""
    sm_scale = 1.0 / math.sqrt(q.shape[-1])
    if backend == "pallas":  # pragma: no cover - needs a TPU
        return _pallas_paged_attention(q, kv_cache, layer, batch, sm_scale=sm_scale)
    return reference_paged_attention(q, kv_cache, layer, batch, sm_scale=sm_scale)
