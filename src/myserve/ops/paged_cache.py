"""The paged KV cache in its two layouts, and the write of a step's keys and values into it.

A token at absolute position ``pos`` of a sequence is stored in page ``pages[pos // page_size]``
at offset ``pos % page_size``; pages come from one pool shared by all sequences. The cache of
every layer is donated into each jitted step, so XLA updates it in place.

The reference layout (``KVCache``), two arrays for the whole model::

    KVCache.k, KVCache.v: [layers, kv_heads, pages + 1, page_size, head_dim]

A quantized cache (``engine.kv_cache_dtype``: ``int8``, ``fp8_e4m3``, ``fp8_e5m2``) holds K and V
in that dtype and, beside them, one scale per token and KV head::

    KVCache.k_scale, KVCache.v_scale: [layers, kv_heads, pages + 1, page_size, 1] bfloat16

A token's head vector is written as ``round(x / s)`` with ``s = max|x| / QMAX`` (the dtype's largest
finite value), so every token uses the dtype's whole range whatever its magnitude (an fp8 key: the
best of ``SCALE_STEPS`` scales from that one up, ``quantize``; keys arrive rotated,
``ops/kv_rotation.py``); a reader
multiplies the scores by the key's scale and the probabilities by the value's (never a dequantized
copy of the pages). Per token rather than per page: a page's scale would have to be fixed by its
first token or its earlier tokens rewritten when a later one is larger, and a per-token scale costs
2 bytes next to ``head_dim`` (64-128), so the pool still holds ~1.9x (bf16) to ~3.8x (f32) the tokens
(``docs/design/ops.md``, "Quantized KV cache"). The trailing axis of 1 keeps the scales' rank the
cache's, so one sharding and one page gather serve both.

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

from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax

from myserve.ops.ragged_batch import RaggedBatch

QUANTIZED_KV = {"int8": jnp.int8, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
"""``engine.kv_cache_dtype`` -> the dtype a quantized cache holds (``fp8`` means ``fp8_e4m3``)."""


def kv_dtype(name: str, model_dtype: jnp.dtype) -> jnp.dtype:
    """The cache dtype of ``engine.kv_cache_dtype`` ``name`` (``auto``: the model's)."""
    name = "fp8_e4m3" if name == "fp8" else name
    return jnp.dtype(model_dtype if name == "auto" else QUANTIZED_KV[name])


def is_quantized(dtype: jnp.dtype) -> bool:
    """Whether a cache of ``dtype`` carries scales (an 8-bit integer or float dtype)."""
    return jnp.dtype(dtype).itemsize == 1


class KVCache(eqx.Module):
    """The paged KV cache of every layer: keys and values, ``[layers, kv_heads, pages + 1, page_size,
    head_dim]`` (the last page: ``spare_page``); quantized, their per-token scales."""

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None = None
    """Quantized: each key's scale, ``[layers, kv_heads, pages + 1, page_size, 1]``; None otherwise."""
    v_scale: jax.Array | None = None
    """Quantized: each value's scale, as ``k_scale``."""
    codes: str | None = eqx.field(static=True, default=None)
    """An fp8 cache held as its bits: the fp8 dtype's name, ``k`` and ``v`` being ``uint8``
    (``stored_dtype`` says when); None when they hold their own dtype."""

    @classmethod
    def of(cls, arrays: Sequence[jax.Array], codes: str | None = None) -> KVCache:
        """The cache around its arrays: K, V and (quantized) their scales."""
        k, v, *scales = arrays
        return cls(k, v, *(scales or (None, None)), codes=codes)  # type: ignore[misc]

    @property
    def code_dtype(self) -> jnp.dtype:
        """The dtype the K/V codes are in (an fp8 one for a cache held as bits)."""
        return jnp.dtype(self.codes) if self.codes is not None else self.k.dtype

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


SCALE_STEPS = 16
"""Candidate scales per vector of a float (fp8) cache: ``2 ** (j / SCALE_STEPS)`` times the
absmax scale (``quantize``)."""


def quantize(x: jax.Array, dtype: jnp.dtype, *, search: bool = False) -> tuple[jax.Array, jax.Array]:
    """``x`` [..., D] as ``dtype`` with one scale per vector: (codes [..., D], scales [..., 1] bf16),
    ``x ~= codes * scales``. ``search`` (float dtypes): the best of ``SCALE_STEPS`` scales per vector
    instead of the absmax one."""
    top = float(jnp.iinfo(dtype).max) if jnp.issubdtype(dtype, jnp.integer) else float(jnp.finfo(dtype).max)
    xf = x.astype(jnp.float32)
    # The scale as stored (bf16), so that codes and scale agree; a zero vector keeps scale 1.
    absmax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    scale = jnp.where(absmax > 0, absmax / top, 1.0).astype(jnp.bfloat16)
    if jnp.issubdtype(dtype, jnp.integer) or not search:
        scaled = jnp.clip(xf / scale.astype(jnp.float32), -top, top)
        codes = jnp.round(scaled) if jnp.issubdtype(dtype, jnp.integer) else scaled
        return codes.astype(dtype), scale
    # A float code's error is relative to each element, so which grid point an element lands on
    # depends on where ``x / s`` falls within its binade: of SCALE_STEPS scales from the absmax one
    # up to twice it, each vector keeps the one whose codes reconstruct it best (squared error). The
    # candidates' codes are estimated by rounding the mantissa in float32 bits (what the cast does
    # in the dtype's normal range; ~2x faster than 16 casts on XLA:CPU), then cast once.
    steps = jnp.asarray([2.0 ** (j / SCALE_STEPS) for j in range(SCALE_STEPS)], jnp.float32)
    scales = (scale.astype(jnp.float32) * steps).astype(jnp.bfloat16)  # [..., SCALE_STEPS]
    wide = scales.astype(jnp.float32)[..., :, None]
    rounded = _round_mantissa(jnp.clip(xf[..., None, :] / wide, -top, top), jnp.finfo(dtype).nmant)
    error = jnp.sum(jnp.square(rounded * wide - xf[..., None, :]), axis=-1)
    best = jnp.take_along_axis(scales, jnp.argmin(error, axis=-1)[..., None], axis=-1)
    return jnp.clip(xf / best.astype(jnp.float32), -top, top).astype(dtype), best


def _round_mantissa(y: jax.Array, bits: int) -> jax.Array:
    """float32 ``y`` rounded to ``bits`` mantissa bits, to nearest even (exponent range unbounded)."""
    drop = 23 - bits
    b = lax.bitcast_convert_type(y, jnp.int32)
    b = (b + ((1 << (drop - 1)) - 1) + ((b >> drop) & 1)) & ~((1 << drop) - 1)
    return lax.bitcast_convert_type(b, jnp.float32)


def stored_dtype(dtype: jnp.dtype, backend: str = "reference") -> jnp.dtype:
    """The dtype a reference-layout cache of ``dtype`` is allocated in: ``uint8`` for fp8 on CPU,
    ``dtype`` otherwise.

    XLA:CPU indexes an fp8 array through a float16 copy of the whole operand: every layer's gather
    (and write) converted the layer's whole pool, every step, so an fp8 SmolLM2 server did not reach
    its steady state in 25 minutes. Held as bits, the pool is gathered and written as int8's is, and
    ``widen`` decodes the few pages gathered."""
    dtype = jnp.dtype(dtype)
    fp8 = jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 1
    return jnp.dtype(jnp.uint8) if fp8 and backend != "pallas" and jax.default_backend() == "cpu" else dtype


def gather_pages(x: jax.Array, layer: int | jax.Array, page_table: jax.Array, heads_sharded: bool) -> jax.Array:
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


def page_scores(
    q: jax.Array,
    cache: KVCache,
    layer: int | jax.Array,
    pages: jax.Array,
    *,
    sm_scale: float,
    soft_cap: float | None,
    heads_sharded: bool,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """The scores of queries ``q`` [KVH, N, M, D] against the keys of each row's ``pages`` [N, P]
    (``span = P * page_size`` positions): scaled, times each key's scale when quantized, capped
    (``soft_cap``, as transformers: before any mask), unmasked: [KVH, N, M, span] float32; the
    rows' values [KVH, N, span, D] in q's dtype (a quantized cache's codes widened here, page by
    page, never a dequantized copy of the cache); and, quantized, the values' scales
    [KVH, N, 1, span] float32, which the caller applies to the softmax weights."""
    kvh, n, _, d = q.shape
    span = pages.shape[1] * cache.page_size
    keys, values = (
        widen(gather_pages(x, layer, pages, heads_sharded).reshape(kvh, n, span, d), cache.code_dtype, q.dtype)
        for x in (cache.k, cache.v)
    )
    s = jnp.einsum("knmd,knsd->knms", q, keys, preferred_element_type=jnp.float32) * sm_scale
    v_scale = None
    if cache.k_scale is not None and cache.v_scale is not None:
        k_scale, v_scale = (
            gather_pages(x, layer, pages, heads_sharded).reshape(kvh, n, 1, span).astype(jnp.float32)
            for x in (cache.k_scale, cache.v_scale)
        )
        s = s * k_scale  # each key's scale: a column of the scores
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    return s, values, v_scale


def widen(codes: jax.Array, code_dtype: jnp.dtype, dtype: jnp.dtype) -> jax.Array:
    """Gathered ``codes`` of a cache whose codes are ``code_dtype`` as ``dtype``: the numbers
    ``codes.astype(dtype)`` gives. An fp8 cache held as bits (``stored_dtype``) arrives as ``uint8``:
    the exponent and mantissa are moved into a float32's (a subnormal by one multiply), integer ops
    that vectorize where XLA:CPU's own fp8 conversion runs element by element. NaN and infinity
    are never written (``quantize`` clips), so they are not decoded."""
    if codes.dtype == jnp.dtype(code_dtype):
        return codes.astype(dtype)
    info = jnp.finfo(code_dtype)
    mant, bias = info.nmant, 1 - info.minexp  # e4m3fn: 3, 7; e5m2: 2, 15
    b = codes.astype(jnp.int32)
    normal = lax.bitcast_convert_type(((b & 0x7F) << (23 - mant)) + ((127 - bias) << 23), jnp.float32)
    subnormal = (b & ((1 << mant) - 1)).astype(jnp.float32) * float(2.0 ** (1 - bias - mant))
    mag = jnp.where((b & (0x7F ^ ((1 << mant) - 1))) == 0, subnormal, normal)
    return jnp.where(b >= 0x80, -mag, mag).astype(dtype)


def write_kv(cache: KVCache, layer: int | jax.Array, k: jax.Array, v: jax.Array, batch: RaggedBatch) -> KVCache:
    """Scatter this step's keys and values ``k``, ``v`` [1, T, kv_heads, head_dim] into their pages
    of layer ``layer`` (quantized with their scales when the cache is; the caller donates the
    cache, so XLA updates it in place)."""
    t = k.shape[1]
    valid = jnp.arange(t)[None, :] < batch.q_lens[:, None]
    # Padding tokens (and stopped rows, whose write page is the spare one) write the spare page.
    page_idx = jnp.where(valid, batch.write_pages, cache.spare_page)
    offset = batch.positions % cache.page_size
    arrays: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    if cache.k_scale is not None and cache.v_scale is not None:
        # Keys carry nearly all of a quantized cache's loss (ops/kv_rotation.py): only they pay for
        # fp8's scale search (16 candidate codings, ~2.5x the plain quantize on CPU).
        codes = cache.code_dtype
        (k, ks), (v, vs) = quantize(k, codes, search=True), quantize(v, codes)
        if cache.k.dtype != codes:  # held as bits (``stored_dtype``)
            k, v = lax.bitcast_convert_type(k, cache.k.dtype), lax.bitcast_convert_type(v, cache.v.dtype)
        arrays, values = (cache.k, cache.v, cache.k_scale, cache.v_scale), (k, v, ks, vs)
    else:
        arrays, values = (cache.k, cache.v), (k, v)
    if t == 1:
        # One token (a one-row decode step): a slice update. XLA:CPU turns a one-update scatter into
        # one too, behind a bounds check and index shuffles of its own, per layer.
        start = (jnp.asarray(layer, jnp.int32), 0, page_idx[0, 0], offset[0, 0], 0)
        new = [
            lax.dynamic_update_slice(a, x.astype(a.dtype).reshape(1, -1, 1, 1, x.shape[-1]), start)
            for a, x in zip(arrays, values, strict=True)
        ]
    else:
        # Indexing [layer, :, page_idx, offset] puts the [1, T] index dims first: updates are [1, T, KVH, D].
        new = [
            a.at[layer, :, page_idx, offset].set(x.astype(a.dtype), mode="promise_in_bounds")
            for a, x in zip(arrays, values, strict=True)
        ]
    return KVCache.of(new, cache.codes)


def write_kv_kernel(
    cache: KernelKVCache, layer: int | jax.Array, k: jax.Array, v: jax.Array, batch: RaggedBatch
) -> KernelKVCache:
    """Scatter this step's keys and values ([1, T, kv_heads, D]) into their slots, K and V interleaved per head."""
    _, t, kvh, d = k.shape
    valid = jnp.arange(t)[None, :] < batch.q_lens[:, None]
    page_idx = jnp.where(valid, batch.write_pages, cache.spare_page)  # padding: one past the pool, dropped
    offset = batch.positions % cache.page_size
    # A quantized kernel cache (fp8 only) holds the values as they are: the kernel's scale is one
    # number per cache (1), so values beyond the dtype's range are clipped to it.
    pairs = jnp.stack([k, v], axis=3).reshape(1, t, 2 * kvh, d)
    if is_quantized(cache.kv.dtype):
        top = float(jnp.finfo(cache.kv.dtype).max)
        pairs = jnp.clip(pairs.astype(jnp.float32), -top, top)
    pairs = pairs.astype(cache.kv.dtype)
    return KernelKVCache(cache.kv.at[layer, page_idx, offset].set(pairs, mode="drop"))
