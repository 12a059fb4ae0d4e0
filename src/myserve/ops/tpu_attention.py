"""The TPU attention path: the Pallas ragged paged attention kernel over a cache in its own layout.

JAX ships the kernel (``jax.experimental.pallas.ops.tpu.ragged_paged_attention``). It takes the
step's flat queries ``[T, heads, D]``, one ``kv_pages`` array ``[pages, page_size, 2 * kv_heads, D]``
(each head's K and V interleaved: combined head ``2h`` is K of head ``h``, ``2h + 1`` its V) and
per-sequence metadata: ``kv_lens``, ``page_indices``, ``cu_q_lens`` (the sequences' queries are
consecutive runs of the flat batch) and ``num_seqs``. It copies pages from HBM by index, so it
can read any pages of any array of that shape.

No copy per call. A deployment that uses the kernel stores its cache in the kernel's layout from
the start (``KernelKVCache``, ``ops/paged_cache.py``). Merging the leading ``layers`` and
``pages`` axes is a bitcast (no data moves), and layer ``l``'s page ``p`` is then page
``l * pages + p``: the kernel reads the whole cache with the layer's offset added to the page
table.

The kernel's sequences are the step's attention rows: every single-view row and every block of
the ragged layout (``ops/ragged_batch.py``), ordered by their first flat token, described by
``KernelMeta`` (derived on the device by ``kernel_meta``). The kernel puts query ``j`` of a
sequence at position ``kv_len - q_len + j``, which is a block's true position.

Tensor parallelism: the kernel is one custom call that XLA cannot partition, so with KV heads
sharded over the mesh it runs under ``shard_map``, each device on its own heads (K/V pairs stay
together when the combined axis is split in blocks, and query heads are grouped under their KV
head, so each device's queries read only its own KV heads).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from myserve.ops.paged_cache import KernelKVCache
from myserve.ops.ragged_batch import KernelMeta

logger = logging.getLogger(__name__)

Kernel = Callable[..., jax.Array]
"""``ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
sliding_window=None, soft_cap=None)``."""


def kernel_attention(
    q: jax.Array,
    cache: KernelKVCache,
    layer: int | jax.Array,
    meta: KernelMeta,
    *,
    sm_scale: float,
    window: int | None = None,
    soft_cap: float | None = None,
    cache_sharding: NamedSharding | None = None,
) -> jax.Array:
    """The kernel's attention of flat queries ``q`` [T, heads, D] over layer ``layer`` of ``cache``
    (this step's K/V already written); [T, heads, D] in q's dtype. ``window``, ``soft_cap``: the
    kernel's own ``sliding_window`` (it masks ``k <= p - window``, as transformers does) and
    ``soft_cap``, passed only when set. ``cache_sharding``: the cache's sharding, whose
    combined-heads axis (if split) runs the kernel per device under ``shard_map``."""
    kernel = _tpu_kernel()
    if kernel is None:  # resolve_backend never picks this backend without the kernel
        raise RuntimeError("the Pallas ragged paged attention kernel is not available")
    num_layers, num_pages = cache.kv.shape[:2]
    kv_pages = cache.kv.reshape(num_layers * num_pages, *cache.kv.shape[2:])  # a bitcast
    page_indices = meta.page_indices + layer * num_pages
    options: dict[str, Any] = {"sm_scale": sm_scale}
    if window is not None:
        options["sliding_window"] = window
    if soft_cap is not None:
        options["soft_cap"] = soft_cap
    if cache.kv.dtype.itemsize == 1:  # an fp8 cache: widened in the kernel by its one scale (1)
        options["k_scale"] = options["v_scale"] = 1.0
    call = functools.partial(kernel, **options)
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
