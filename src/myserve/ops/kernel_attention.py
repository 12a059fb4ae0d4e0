"""The TPU attention path: the Pallas ragged paged attention kernel over a cache in its own layout.

JAX ships the kernel (``jax.experimental.pallas.ops.tpu.ragged_paged_attention``). It takes the
step's flat queries ``[T, heads, D]``, one ``kv_pages`` array ``[pages, page_size, 2 * kv_heads, D]``
(each head's K and V interleaved: combined head ``2h`` is K of head ``h``, ``2h + 1`` its V) and
per-sequence metadata: ``kv_lens``, ``page_indices``, ``cu_q_lens`` (the sequences' queries are
consecutive runs of the flat batch) and ``num_seqs``. It copies pages from HBM by index, so it
can read any pages of any array of that shape.

No copy per call. The head-major cache of the reference path (``ops/paged_attention.py``) would
have to be transposed into the kernel's layout on every call, a copy of the layer's whole cache.
So a deployment that uses the kernel stores its cache in the kernel's layout from the start:
``KernelKVCache.kv`` ``[layers, pages, page_size, 2 * kv_heads, D]``. Merging the leading
``layers`` and ``pages`` axes is a bitcast (no data moves), and layer ``l``'s page ``p`` is then
page ``l * pages + p``: the kernel reads the whole cache with the layer's offset added to the
page table. Writes scatter each token's K and V into its slot of the same array.

The kernel's sequences are the step's attention rows: every single-view row and every block of
the ragged layout (``ops/ragged_attention.py``), ordered by their first flat token. A block is a
run of its sequence's tokens whose context ends at its own last token, so it is a kernel sequence
with ``kv_len`` = its last position + 1 (the kernel puts query ``j`` of a sequence at position
``kv_len - q_len + j``, which is its true position). The metadata is derived on the device from
the views once per step (``kernel_meta``), so the host packs the same arrays for every backend.

Tensor parallelism: the kernel is one custom call that XLA cannot partition, so with KV heads
sharded over the mesh it runs under ``shard_map``, each device on its own heads (K/V pairs stay
together when the combined axis is split in blocks, and query heads are grouped under their KV
head, so each device's queries read only its own KV heads).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from myserve.errors import ConfigError
from myserve.ops.gpu_decode_attention import gpu_fit
from myserve.ops.ragged_attention import RaggedBatch

logger = logging.getLogger(__name__)

AttentionBackend = Literal["auto", "reference", "pallas"]

Kernel = Callable[..., jax.Array]
"""``ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale)``."""


class KernelKVCache(eqx.Module):
    """The paged KV cache in the kernel's layout: ``kv`` [layers, pages, page_size, 2 * kv_heads, head_dim]."""

    kv: jax.Array

    @property
    def num_pages(self) -> int:
        """Pages in the pool (per layer)."""
        return self.kv.shape[1]

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self.kv.shape[2]


class KernelMeta(eqx.Module):
    """The kernel's per-sequence metadata of one step (its sequences are the step's attention rows)."""

    kv_lens: jax.Array
    """[S] context length of each kernel sequence (0 past ``num_seqs``)."""
    page_indices: jax.Array
    """[S, W] each sequence's pages (of one layer)."""
    cu_q_lens: jax.Array
    """[S + 1] where each sequence's queries start in the flat batch."""
    num_seqs: jax.Array
    """[1] sequences in use."""


def kernel_meta(batch: RaggedBatch, num_tokens: int) -> KernelMeta:
    """The kernel's metadata for the rows of ``batch`` (a step of ``num_tokens`` padded tokens).

    Single-view rows and blocks cover the real flat tokens exactly, each a consecutive run; sorted
    by their first token they are the kernel's sequences in flat order (padding rows start at
    ``num_tokens`` and sort last).
    """
    views = [v for v in (batch.single, batch.blocks) if v.idx.shape[0]]
    starts = jnp.concatenate([v.idx[:, 0] for v in views])
    q_lens = jnp.concatenate([jnp.sum(v.idx < num_tokens, axis=1, dtype=jnp.int32) for v in views])
    # A row's context ends at its last query: first position + queries (0 for padding rows).
    kv_lens = jnp.concatenate([jnp.where(q > 0, v.positions[:, 0] + q, 0) for v, q in _split(views, q_lens)])
    pages = jnp.concatenate([v.pages for v in views])
    order = jnp.argsort(starts, stable=True)
    q_sorted = q_lens[order]
    cu_q_lens = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(q_sorted, dtype=jnp.int32)])
    num_seqs = jnp.sum(q_sorted > 0, dtype=jnp.int32).reshape(1)
    return KernelMeta(kv_lens[order].astype(jnp.int32), pages[order], cu_q_lens, num_seqs)


def _split(views: list[Any], q_lens: jax.Array) -> list[tuple[Any, jax.Array]]:
    """Each view with its rows' query counts (``q_lens`` is the views' counts concatenated)."""
    out, at = [], 0
    for v in views:
        n = v.idx.shape[0]
        out.append((v, q_lens[at : at + n]))
        at += n
    return out


def write_kv_kernel(
    cache: KernelKVCache, layer: int | jax.Array, k: jax.Array, v: jax.Array, batch: RaggedBatch
) -> KernelKVCache:
    """Scatter this step's keys and values ([1, T, kv_heads, D]) into their slots, K and V interleaved per head."""
    _, t, kvh, d = k.shape
    valid = jnp.arange(t)[None, :] < batch.q_lens[:, None]
    # Padding tokens target an out-of-range page, and mode="drop" discards those writes.
    page_idx = jnp.where(valid, batch.write_pages, cache.num_pages)
    offset = batch.positions % cache.page_size
    pairs = jnp.stack([k, v], axis=3).reshape(1, t, 2 * kvh, d).astype(cache.kv.dtype)
    return KernelKVCache(cache.kv.at[layer, page_idx, offset].set(pairs, mode="drop"))


def kernel_attention(
    q: jax.Array,
    cache: KernelKVCache,
    layer: int | jax.Array,
    meta: KernelMeta,
    *,
    sm_scale: float,
    cache_sharding: NamedSharding | None = None,
) -> jax.Array:
    """The kernel's attention of flat queries ``q`` [T, heads, D] over layer ``layer`` of ``cache``
    (this step's K/V already written); [T, heads, D] in q's dtype. ``cache_sharding``: the cache's
    sharding, whose combined-heads axis (if split) runs the kernel per device under ``shard_map``."""
    kernel = _tpu_kernel()
    if kernel is None:  # resolve_backend never picks this backend without the kernel
        raise RuntimeError("the Pallas ragged paged attention kernel is not available")
    num_layers, num_pages = cache.kv.shape[:2]
    kv_pages = cache.kv.reshape(num_layers * num_pages, *cache.kv.shape[2:])  # a bitcast
    page_indices = meta.page_indices + layer * num_pages
    call = functools.partial(kernel, sm_scale=sm_scale)
    heads = None if cache_sharding is None else cache_sharding.spec[3] if len(cache_sharding.spec) > 3 else None
    if heads is None:
        return call(q, kv_pages, meta.kv_lens, page_indices, meta.cu_q_lens, meta.num_seqs)
    per_device = jax.shard_map(
        call,
        mesh=cache_sharding.mesh,  # type: ignore[union-attr]
        in_specs=(P(None, heads, None), P(None, None, heads, None), P(), P(), P(), P()),
        out_specs=P(None, heads, None),
        check_vma=False,
    )
    return per_device(q, kv_pages, meta.kv_lens, page_indices, meta.cu_q_lens, meta.num_seqs)


@functools.cache
def _tpu_kernel() -> Kernel | None:
    """JAX's ragged paged attention kernel, or None where it does not import."""
    try:
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention
    except ImportError as e:
        logger.warning("Pallas ragged paged attention unavailable (%s); using the reference", e)
        return None
    return ragged_paged_attention  # type: ignore[no-any-return]


def pallas_fit(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int) -> str | None:
    """Why the ragged paged attention kernel cannot serve these shapes, or None if it can.

    The kernel's own ``static_validate_inputs`` on abstract shapes, plus the TPU tiling it needs:
    ``head_dim`` is the lane dimension of its blocks (a multiple of 128) and a page must hold a
    whole sublane tile of tokens (``page_size`` a multiple of 8).
    """
    if head_dim % 128:
        return f"head_dim {head_dim} is not a multiple of 128"
    if page_size % 8:
        return f"page_size {page_size} is not a multiple of 8"
    try:
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import static_validate_inputs
    except ImportError as e:
        return f"the kernel does not import ({e})"
    seqs, pages_per_seq, tokens = 8, 4, 64
    shape: Any = jax.ShapeDtypeStruct  # the validator reads only shapes and dtypes
    try:
        static_validate_inputs(
            shape((tokens, num_heads, head_dim), jnp.bfloat16),
            shape((64, page_size, 2 * num_kv_heads, head_dim), jnp.bfloat16),
            shape((seqs,), jnp.int32),
            shape((seqs, pages_per_seq), jnp.int32),
            shape((seqs + 1,), jnp.int32),
            shape((1,), jnp.int32),
        )
    except (ValueError, AssertionError) as e:
        return str(e) or "the kernel rejects the shapes"
    return None


def resolve_backend(
    backend: AttentionBackend, *, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int
) -> Literal["reference", "pallas", "pallas_gpu"]:
    """Pick the attention implementation. ``auto`` and ``pallas``: on TPU the Pallas ragged kernel
    (``pallas``), on GPU the Pallas paged decode kernel for the decode rows (``pallas_gpu``,
    ``ops/gpu_decode_attention.py``), each when it imports and the model's shapes fit it; the
    reference otherwise (``pallas`` instead fails with the reason). ``reference`` forces the
    reference."""
    if backend == "reference":
        return "reference"
    platform = jax.default_backend()
    if platform == "tpu":
        misfit = pallas_fit(num_heads, num_kv_heads, head_dim, page_size)
        if misfit is None and _tpu_kernel() is None:
            misfit = "the kernel does not import"
        picked: Literal["pallas", "pallas_gpu"] = "pallas"
    elif platform in ("gpu", "cuda", "rocm"):
        misfit = gpu_fit(num_heads, num_kv_heads, head_dim, page_size)
        picked = "pallas_gpu"
    elif backend == "pallas":
        raise ConfigError("engine.attention_backend 'pallas' needs a TPU or a GPU; use 'auto' or 'reference'")
    else:
        return "reference"
    if misfit is None:
        return picked
    if backend == "pallas":
        raise ConfigError(f"engine.attention_backend 'pallas' cannot serve this model: {misfit}")
    logger.warning("Pallas attention kernel not used (%s); using the reference", misfit)
    return "reference"
