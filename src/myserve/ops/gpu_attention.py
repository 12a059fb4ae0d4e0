"""The GPU attention path: JAX's Pallas (Triton) paged decode kernel for a step's one-token rows.

JAX ships the kernel (``jax.experimental.pallas.ops.gpu.paged_attention``). It serves one query
token per sequence: ``q`` [B, heads, D] over ``k_pages``/``v_pages`` [kv_heads, pages, page_size, D]
with a page table [B, W] and context lengths [B], splitting each sequence's pages over ``k_splits``
programs (flash-decoding) and skipping the pages past its length. So on a GPU it takes the step's
single view (the decode rows, ``ops/ragged_batch.py``), and the block view (prefill chunks)
keeps the reference (``ops/attention.py``), in the same executable.

No copy per call. The reference cache ``[layers, kv_heads, pages, page_size, D]``
(``ops/paged_cache.py``) is read as it lies: merging its leading axes is a bitcast to
``[1, layers * kv_heads * pages, page_size, D]``, one "KV head" whose page
``(layer * kv_heads + h) * pages + p`` is page ``p`` of head ``h`` of ``layer``. Each (row, KV
head) pair becomes one of the kernel's sequences, with its ``g`` query heads and its page table
shifted by that offset. (Slicing the layer out of the cache instead
would copy the layer's whole cache on every call: a custom call reads whole buffers.) The grid is
then the same as the kernel's own over KV heads: one program per (row, KV head, k split).

The kernel does not scale its scores, so the queries are scaled by ``sm_scale`` first.

Tensor parallelism: with KV heads sharded over ``model`` the merge would cross devices, so the
call runs under ``shard_map``, each device on its own heads (query heads are grouped under their
KV head, so a block split of the heads axis keeps each group with its KV head).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from myserve.ops.gpu_ragged_attention import ragged_fit as triton_fit
from myserve.ops.paged_cache import KVCache

logger = logging.getLogger(__name__)

Kernel = Callable[..., jax.Array]
"""``paged_attention(q, k_pages, v_pages, block_tables, lengths, *, pages_per_compute_block, k_splits)``."""

BLOCK_H = 16
"""Query heads per program (the kernel's default): a KV head's group is padded up to it, since a
Triton dot needs at least 16 rows."""


def decode_attention(
    q: jax.Array,
    cache: KVCache,
    layer: int | jax.Array,
    kv_lens: jax.Array,
    pages: jax.Array,
    *,
    sm_scale: float,
    cache_sharding: NamedSharding | None = None,
) -> jax.Array:
    """The kernel's attention of one query token per row, ``q`` [N, heads, D], over layer ``layer``
    of ``cache`` (this step's K/V already written): row ``n`` reads ``kv_lens[n]`` tokens of its
    pages ``pages[n]`` [N, W]. Returns [N, heads, D] in q's dtype (rows with ``kv_lens == 0``: zeros).
    ``cache_sharding``: the cache's sharding; with its KV heads split the kernel runs per device."""
    call = functools.partial(_decode, layer=layer, sm_scale=sm_scale)
    heads = None if cache_sharding is None else cache_sharding.spec[1] if len(cache_sharding.spec) > 1 else None
    args = (q, cache.k, cache.v, kv_lens, pages, cache.k_scale, cache.v_scale)
    if heads is None:
        return call(*args)
    cached = P(None, heads)  # K, V and (quantized) their scales: KV heads split
    per_device = jax.shard_map(
        call,
        mesh=cache_sharding.mesh,  # type: ignore[union-attr]
        in_specs=(P(None, heads, None), cached, cached, P(), P(), cached, cached),
        out_specs=P(None, heads, None),
        check_vma=False,
    )
    return per_device(*args)  # type: ignore[no-any-return]


def _decode(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_lens: jax.Array,
    pages: jax.Array,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    *,
    layer: int | jax.Array,
    sm_scale: float,
) -> jax.Array:
    """``decode_attention`` on one device's heads: ``k``/``v`` [layers, kv_heads, pages, page_size, D]
    (quantized: their scales [..., page_size, 1], which the kernel applies to scores and weights)."""
    kernel = _gpu_kernel()
    if kernel is None:  # resolve_backend never picks this backend without the kernel
        raise RuntimeError("the Pallas paged decode attention kernel is not available")
    n, h, d = q.shape
    num_layers, kvh, num_pages, page_size, _ = k.shape
    g = h // kvh
    width = pages.shape[1]
    k_splits, per_block = split_sizes(width)
    # (row, KV head) pairs are the kernel's sequences, row-major: pair n * kvh + j is head j of row n.
    qs = (q.astype(jnp.float32) * sm_scale).astype(q.dtype).reshape(n * kvh, g, d)
    # Entries past a row's length may be anything; the kernel loads whole compute blocks, so clip them.
    heads = (layer * kvh + jnp.arange(kvh, dtype=pages.dtype)) * num_pages  # [KVH]
    tables = (jnp.clip(pages, 0, num_pages - 1)[:, None, :] + heads[None, :, None]).reshape(n * kvh, width)
    lengths = jnp.repeat(kv_lens.astype(jnp.int32), kvh)
    merged = (1, num_layers * kvh * num_pages, page_size, d)  # bitcasts: no data moves
    scales = {}
    if k_scale is not None and v_scale is not None:
        scales = {f"{name}_scales_pages": x.reshape(merged[:-1]) for name, x in (("k", k_scale), ("v", v_scale))}
    out = kernel(
        qs,
        k.reshape(merged),
        v.reshape(merged),
        tables,
        lengths,
        pages_per_compute_block=per_block,
        k_splits=k_splits,
        **scales,
    )
    # The kernel divides by (sum + eps), so a row with no context is already zeros.
    return out.reshape(n, h, d).astype(q.dtype)


def split_sizes(width: int) -> tuple[int, int]:
    """``(k_splits, pages_per_compute_block)`` for page tables ``width`` pages wide: up to 16 splits
    and 8 pages per block, each dividing what it must (the kernel asserts both)."""
    k_splits = math.gcd(width, 16)
    return k_splits, math.gcd(width // k_splits, 8)


@functools.cache
def _gpu_kernel() -> Kernel | None:
    """JAX's paged decode attention kernel for GPUs, or None where it does not import."""
    try:
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
    except ImportError as e:
        logger.warning("Pallas GPU paged attention unavailable (%s); using the reference", e)
        return None
    return paged_attention  # type: ignore[no-any-return]


def gpu_fit(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    *,
    sliding_window: bool = False,
    soft_cap: bool = False,
) -> str | None:
    """Why the GPU decode kernel cannot serve this model, or None if it can. Triton blocks need
    power-of-two sizes of at least 16: ``head_dim``, and a compute block's tokens (``page_size`` a
    power of two; the smallest block is one page, so at least 16 tokens per page). The kernel
    masks only by length: no sliding window and no score soft cap (``sliding_window``,
    ``soft_cap``: whether some layer of the model has one)."""
    if sliding_window:
        return "the kernel has no sliding-window attention"
    if soft_cap:
        return "the kernel has no attention soft cap"
    shapes = triton_fit(num_heads, num_kv_heads, head_dim, page_size)
    if shapes is not None:
        return shapes
    if _gpu_kernel() is None:
        return "the kernel does not import"
    return None
