"""The attention op of a ragged step: the pure-JAX reference, and the choice of implementation.

``paged_attention`` is what a decoder layer calls: it writes the step's keys and values into the
cache and attends with the implementation the cache's layout and the batch pick: the TPU kernel
for the kernel's layout (``ops/tpu_attention.py``), otherwise this file's reference, with the
decode rows on the GPU kernel when the batch is marked for it (``ops/gpu_attention.py``), and on a
CPU over each row's own tiles of context rather than the bucket's width (``ops/tiled_decode.py``).
``resolve_backend`` picks the implementation once per deployment.

The reference reads each view's rows (``ops/ragged_batch.py``) in chunks of ``chunk_pages`` pages
of their context (one-token rows, and a CPU's prefill blocks: up to four chunks at once,
``_single_chunk``) with an online softmax (as flash attention does; a plain one when one iteration
reads the whole context), in a loop of static length: the page tables' width, which is
the step's context bucket (``runtime/buckets.py``), divided by the chunk. The host picks the
smallest context bucket holding the step's longest context, so the loop follows the context
without a data-dependent trip count (on a GPU, that is one host round trip per iteration). Rows
are computed together, so a chunk costs the same for every row of a view; padding rows have
``kv_lens == 0``.

Causality is by absolute position: a query at position ``p`` sees cache slots ``<= p`` of its row
(the cache already holds this step's keys), and ``< kv_lens``; where the batch names a later last
visible position (``RaggedBatch.visible``: an image token of Gemma 3 sees its whole image, whose
tokens the scheduler keeps in one step), slots up to that one.

Sliding windows (a layer's static ``window``): a query at position ``p`` sees only positions
``k > p - window``, as transformers masks them. Each row then reads only the chunks its own window
touches: the loop is as long as a window of a row's queries can span (static), and each row starts
at its own first chunk, so pages behind a row's window are not read (the loop's cost follows the
window, not the context). Those pages are **not freed**: a model's full
layers (Gemma alternates them) and the prefix cache read the same page table, and a page holds
every layer's K/V, so one page cannot be freed for some layers only. ``soft_cap``: scores
(already scaled) become ``cap * tanh(s / cap)`` before masking (Gemma 2).
"""

from __future__ import annotations

import functools
import logging
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding

from myserve.errors import ConfigError
from myserve.ops import gpu_ragged_attention, tiled_decode
from myserve.ops.gpu_attention import decode_attention, gpu_fit
from myserve.ops.kv_rotation import rotate
from myserve.ops.paged_cache import KernelKVCache, KVCache, is_quantized, page_scores, write_kv, write_kv_kernel
from myserve.ops.ragged_batch import AttentionView, RaggedBatch
from myserve.ops.reductions import fused_max, fused_sum
from myserve.ops.tpu_attention import kernel_attention, pallas_fit

logger = logging.getLogger(__name__)

AttentionBackend = Literal["auto", "reference", "pallas", "pallas_decode", "pallas_ragged"]
Resolved = Literal["reference", "pallas", "pallas_gpu", "pallas_gpu_ragged"]
"""What ``resolve_backend`` picks: the reference, the TPU kernel, the GPU decode kernel for the
decode rows (blocks on the reference), or our GPU ragged kernel for both views."""

# Finite, so a fully masked (padding) row gives a uniform softmax instead of NaN.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def paged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache: KVCache | KernelKVCache,
    layer: int | jax.Array,
    batch: RaggedBatch,
    *,
    sm_scale: float,
    window: int | None = None,
    soft_cap: float | None = None,
    cache_sharding: NamedSharding | None = None,
) -> tuple[jax.Array, KVCache | KernelKVCache]:
    """Write this step's ``k``, ``v`` [1, T, kv_heads, D] into layer ``layer`` of ``cache``, then
    attend: flat queries ``q`` [T, heads, D] -> ([T, heads, D] in q's dtype, the updated cache).

    ``KernelKVCache`` (its batch carrying the kernel's metadata) runs the TPU kernel, ``KVCache``
    the reference (with the decode rows on the GPU kernel when ``batch.decode_kernel``).
    ``window``: the layer's sliding window (None: full attention); ``soft_cap``: the score cap
    (None: none). ``cache_sharding``: the cache's sharding; with its heads split over devices the
    reference gathers pages per head shard and the kernels run per device.

    A quantized cache holds its keys rotated (``ops/kv_rotation.py``): the queries are rotated
    alike here, before any path reads the cache, so the scores are the unrotated ones.
    """
    if is_quantized(cache.kv.dtype if isinstance(cache, KernelKVCache) else cache.k.dtype):
        q, k = rotate(q), rotate(k)
    if isinstance(cache, KernelKVCache):
        assert batch.kernel is not None, "the TPU kernel needs the batch's kernel metadata"
        cache = write_kv_kernel(cache, layer, k, v, batch)
        out = kernel_attention(
            q, cache, layer, batch.kernel,
            sm_scale=sm_scale, window=window, soft_cap=soft_cap, cache_sharding=cache_sharding,
        )  # fmt: skip
        return out, cache
    heads_sharded = cache_sharding is not None and cache_sharding.spec[1:2] not in ((), (None,))
    cache = write_kv(cache, layer, k, v, batch)
    out = ragged_attention(
        q, cache, layer, batch,
        sm_scale=sm_scale, window=window, soft_cap=soft_cap, heads_sharded=heads_sharded, cache_sharding=cache_sharding,
    )  # fmt: skip
    return out, cache


def _view_attention(
    q: jax.Array,
    cache: KVCache,
    layer: int | jax.Array,
    view: AttentionView,
    *,
    chunk_pages: int,
    sm_scale: float,
    heads_sharded: bool,
    window: int | None = None,
    soft_cap: float | None = None,
    visible: jax.Array | None = None,
) -> jax.Array:
    """Attention of one view's rows. q: [T + 1, heads, D] (last row zeros) -> [N, Q, heads, D] float32.
    ``visible`` [T + 1]: each flat token's last visible position (None: its own).

    The loop reads ``width / chunk_pages`` chunks of each row's page table (static). With a
    ``window``, each row starts at the chunk holding the oldest position its first query still
    sees (a row's queries are consecutive from ``positions[:, 0]``), and the loop is only as long
    as a window plus the row's queries can span."""
    _, h, d = q.shape
    n, qn = view.idx.shape
    kvh = cache.k.shape[1]
    g = h // kvh
    m_rows = qn * g
    # [KVH, N, Q * g, D]: the queries of a row that read one KV head, query-major. Scores are
    # [KVH, N, Q * g, span], keys last: the softmax reduces the minor axis and its output is the
    # values product's left operand as XLA:CPU's dot takes it, with no transposed copy between.
    qm = q[view.idx].reshape(n, qn, kvh, g, d).transpose(2, 0, 1, 3, 4).reshape(kvh, n, m_rows, d)
    q_pos = jnp.repeat(view.positions, g, axis=1)  # [N, Q * g]
    q_last = q_pos if visible is None else jnp.repeat(visible[view.idx], g, axis=1)
    span = chunk_pages * cache.page_size
    num_chunks = view.pages.shape[1] // chunk_pages
    steps, first = num_chunks, jnp.zeros((n,), jnp.int32)
    if window is not None and visible is None:  # (a row's image may reach past its queries: read every chunk)
        # A row's queries see positions positions[:, 0] - window + 1 .. positions[:, 0] + qn - 1.
        steps = min(num_chunks, (window + qn - 2) // span + 2)
        oldest = jnp.maximum(view.positions[:, 0] - (window - 1), 0)
        first = jnp.clip(oldest // span, 0, num_chunks - steps).astype(jnp.int32)

    def scores(i: int | jax.Array) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """Chunk ``i``'s masked scores [KVH, N, M, span], values [KVH, N, span, D] and, quantized,
        the values' scales [KVH, N, 1, span]."""
        if steps == num_chunks:  # every row reads chunk i
            pages = lax.dynamic_slice_in_dim(view.pages, i * chunk_pages, chunk_pages, axis=1)
            kv_pos = jnp.broadcast_to(i * span + jnp.arange(span), (n, span))
        else:  # each row its own chunk
            chunk = first + jnp.asarray(i, jnp.int32)
            pages = jnp.take_along_axis(view.pages, chunk[:, None] * chunk_pages + jnp.arange(chunk_pages), axis=1)
            kv_pos = chunk[:, None] * span + jnp.arange(span)  # [N, span]
        mask = (kv_pos[:, None, :] <= q_last[:, :, None]) & (kv_pos[:, None, :] < view.kv_lens[:, None, None])
        if window is not None:
            mask &= kv_pos[:, None, :] > q_pos[:, :, None] - window
        s, values, v_scale = page_scores(
            qm, cache, layer, pages, sm_scale=sm_scale, soft_cap=soft_cap, heads_sharded=heads_sharded
        )
        return jnp.where(mask[None], s, _MASK_VALUE), values, v_scale  # [KVH, N, M, span]

    def weighted(p: jax.Array, values: jax.Array, v_scale: jax.Array | None) -> jax.Array:
        """The values summed by weights ``p`` [KVH, N, M, span] (times each value's scale when
        quantized): [KVH, N, M, D] float32."""
        if v_scale is not None:
            p = p * v_scale
        return jnp.einsum("knms,knsd->knmd", p.astype(values.dtype), values, preferred_element_type=jnp.float32)

    if steps == 1:
        # One chunk (most decode steps): a plain softmax. The online one's first iteration gives
        # the same numbers (its corrections multiply zeros), through more small ops: a decode
        # token's layer is dozens of them, each costing more to run than to compute on a CPU.
        s, values, v_scale = scores(0)
        p = jnp.exp(s - fused_max(s, axis=3, keepdims=True))
        denom, acc = fused_sum(p, axis=3), weighted(p, values, v_scale)
    else:

        def body(
            i: int | jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]
        ) -> tuple[jax.Array, jax.Array, jax.Array]:
            m, denom, acc = carry
            s, values, v_scale = scores(i)
            m_new = jnp.maximum(m, fused_max(s, axis=3))
            p = jnp.exp(s - m_new[..., None])
            correction = jnp.exp(m - m_new)
            denom = denom * correction + fused_sum(p, axis=3)
            acc = acc * correction[..., None] + weighted(p, values, v_scale)
            return m_new, denom, acc

        init = (
            jnp.full((kvh, n, m_rows), _MASK_VALUE, jnp.float32),
            jnp.zeros((kvh, n, m_rows), jnp.float32),
            jnp.zeros((kvh, n, m_rows, d), jnp.float32),
        )
        _, denom, acc = lax.fori_loop(0, steps, body, init)
    out = acc / jnp.maximum(denom, 1e-30)[..., None]
    return out.reshape(kvh, n, qn, g, d).transpose(1, 2, 0, 3, 4).reshape(n, qn, h, d)


SINGLE_CHUNKS = 4
"""One-token rows (and on CPU prefill blocks) read up to this many chunks per iteration of the
attention's loop."""


def _single_chunk(width: int, chunk_pages: int) -> int:
    """Pages per loop iteration for the single view's one-token rows: the most chunks, up to
    ``SINGLE_CHUNKS``, that divide the page-table width. A decode row's iteration costs more in
    fixed work (a gather, two small dots, the softmax's updates: tens of small ops) than in what
    it reads, so fewer, longer iterations are cheaper: the yardstick's 8-token decode calls at a
    512-token context took 0.54 ms a token in 128-token chunks against 0.41 in one (2-core CPU).
    Sliding-window layers keep one chunk: their loop skips the chunks behind the window."""
    for factor in range(SINGLE_CHUNKS, 1, -1):
        if width % (chunk_pages * factor) == 0:
            return chunk_pages * factor
    return chunk_pages


def ragged_attention(
    q: jax.Array,
    cache: KVCache,
    layer: int | jax.Array,
    batch: RaggedBatch,
    *,
    sm_scale: float,
    window: int | None = None,
    soft_cap: float | None = None,
    heads_sharded: bool = False,
    cache_sharding: NamedSharding | None = None,
) -> jax.Array:
    """Attention of flat queries ``q`` [T, heads, D] over their sequences' paged context (this
    step's K/V already written); returns [T, heads, D] in q's dtype (padding tokens: zeros). Pure
    JAX, except the single view on the GPU decode kernel when ``batch.decode_kernel`` (which reads
    ``cache_sharding`` to run per device when heads are split). ``window``, ``soft_cap``: as
    ``paged_attention``; the GPU decode kernel has neither (``resolve_backend`` does not pick it
    then). ``batch.ragged_kernel``: every view on our GPU ragged kernel (``ops/gpu_ragged_attention.py``)."""
    if batch.decode_kernel and (window is not None or soft_cap is not None):
        raise ValueError("the GPU decode kernel has no sliding window or soft cap")
    t, h, d = q.shape
    padded = jnp.concatenate([q, jnp.zeros((1, h, d), q.dtype)])
    views = [view for view in (batch.single, batch.blocks) if view.idx.shape[0]]
    outputs = []
    visible = None if batch.visible is None else jnp.concatenate([batch.visible[0], jnp.zeros(1, jnp.int32)])
    for view in views:
        if batch.ragged_kernel:
            rows = gpu_ragged_attention.view_attention(
                padded, cache, layer, view, num_tokens=t, sm_scale=sm_scale,
                window=window, soft_cap=soft_cap, cache_sharding=cache_sharding,
            )  # fmt: skip
            outputs.append(rows.reshape(-1, h, d))
            continue
        if batch.decode_kernel and view is batch.single:
            rows = decode_attention(
                padded[view.idx[:, 0]], cache, layer, view.kv_lens, view.pages,
                sm_scale=sm_scale, cache_sharding=cache_sharding,
            )  # fmt: skip
            outputs.append(rows.astype(jnp.float32).reshape(-1, h, d))
            continue
        chunk = batch.chunk_pages
        # Longer iterations where they are cheap: a one-token row's scores are small, and a CPU's
        # memory holds a prompt's (a 300-token prompt's first token on the 16-layer yardstick:
        # 49 -> 40 ms); an accelerator's blocks keep the chunk that bounds their scores' memory.
        # (A window's loop skips whole chunks behind it.)
        if window is None and (view is batch.single or jax.default_backend() == "cpu"):
            chunk = _single_chunk(view.pages.shape[1], chunk)
        reference = functools.partial(
            _view_attention, padded, cache, layer, view,
            chunk_pages=chunk, sm_scale=sm_scale, heads_sharded=heads_sharded,
            window=window, soft_cap=soft_cap, visible=visible,
        )  # fmt: skip
        if view is batch.single and window is None and visible is None and cpu_tiled_decode():
            # Each row's own context rather than the bucket's (a window's loop already skips).
            rows = tiled_decode.single_view_attention(
                padded, cache, layer, view,
                sm_scale=sm_scale, soft_cap=soft_cap, heads_sharded=heads_sharded, dense=reference,
            )  # fmt: skip
        else:
            rows = reference()
        outputs.append(rows.reshape(-1, h, d))
    # Each token's row, gathered (a scatter of rows into the tokens is an op of its own and a
    # bounds check per layer on XLA:CPU; the gather fuses into the output projection's input).
    stacked = jnp.concatenate([*outputs, jnp.zeros((1, h, d), jnp.float32)])
    out = stacked.at[token_rows(views, t)].get(mode="promise_in_bounds")
    return out.astype(q.dtype)


def cpu_tiled_decode() -> bool:
    """Whether one-token rows read their own tiles (``ops/tiled_decode.py``): on a CPU, unless
    ``CPU_TILED_DECODE`` is off (the kernel-budget tests read XLA:CPU's HLO as a GPU's stand-in,
    and a GPU never runs that path)."""
    return CPU_TILED_DECODE and jax.default_backend() == "cpu"


CPU_TILED_DECODE = True


def token_rows(views: list[AttentionView], num_tokens: int) -> jax.Array:
    """[T] where each flat token's attention output sits among ``views``' rows stacked (each view's
    rows flattened, in order), or one past them for a token no view holds (padding). The same for
    every layer, so XLA computes it once per step."""
    total = sum(view.idx.size for view in views)
    rows = jnp.full((num_tokens + 1,), total, jnp.int32)
    at = 0
    for view in views:
        # Padding entries all point at token T, which is dropped.
        rows = rows.at[view.idx.reshape(-1)].set(at + jnp.arange(view.idx.size, dtype=jnp.int32))
        at += view.idx.size
    return rows[:num_tokens]


def resolve_backend(
    backend: AttentionBackend,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    sliding_window: bool = False,
    soft_cap: bool = False,
    kv_cache_dtype: str = "auto",
) -> Resolved:
    """Pick the attention implementation. ``auto`` and ``pallas``: the platform's kernel where it
    imports and the model fits it, the reference otherwise (an explicit choice instead fails with
    the reason). On TPU the Pallas ragged kernel (``pallas``). On GPU our ragged kernel for both
    views of the step (``pallas_gpu_ragged``, ``ops/gpu_ragged_attention.py``: sliding windows and
    soft caps too): measured on an H200 against JAX's paged decode kernel with the reference's
    prefill, 64 x 4k-token prompts 6.8x faster (prefill 121k against 13.7k tokens/s) and one
    4k-token stream 1.08x (``../shared/gpu/2026-11-28-h200/``); where it does not fit, the decode
    kernel (``pallas_gpu``, ``ops/gpu_attention.py``). ``pallas_ragged`` and ``pallas_decode`` name
    the two GPU kernels; ``reference`` forces the reference.
    ``sliding_window``, ``soft_cap``: whether any layer of the model has one (the TPU kernel and
    our GPU kernel do both, the GPU decode kernel neither). ``kv_cache_dtype``: ``int8`` needs a scale
    per token, which the TPU kernel does not take (one per cache: fp8 only)."""
    if backend == "reference":
        return "reference"
    platform = jax.default_backend()
    gpu = platform in ("gpu", "cuda", "rocm")
    if backend in ("pallas_decode", "pallas_ragged") and not gpu:
        raise ConfigError(f"engine.attention_backend {backend!r} needs a GPU; use 'auto', 'pallas' or 'reference'")
    picked: Resolved
    if platform == "tpu":
        misfit = pallas_fit(num_heads, num_kv_heads, head_dim, page_size)  # it imports the kernel's module
        if kv_cache_dtype == "int8":
            misfit = "an int8 KV cache needs a scale per token, the kernel takes one per cache (use fp8)"
        picked = "pallas"
    elif gpu and backend != "pallas_decode":
        misfit = gpu_ragged_attention.ragged_fit(num_heads, num_kv_heads, head_dim, page_size)
        picked = "pallas_gpu_ragged"
        if misfit is not None and backend != "pallas_ragged":  # auto / pallas: the decode kernel next
            logger.info("the ragged GPU attention kernel does not fit (%s); trying the decode kernel", misfit)
            misfit = gpu_fit(
                num_heads, num_kv_heads, head_dim, page_size, sliding_window=sliding_window, soft_cap=soft_cap
            )
            picked = "pallas_gpu"
    elif gpu:
        misfit = gpu_fit(num_heads, num_kv_heads, head_dim, page_size, sliding_window=sliding_window, soft_cap=soft_cap)
        picked = "pallas_gpu"
    elif backend == "pallas":
        raise ConfigError("engine.attention_backend 'pallas' needs a TPU or a GPU; use 'auto' or 'reference'")
    else:
        return "reference"
    if misfit is None:
        return picked
    if backend != "auto":
        raise ConfigError(f"engine.attention_backend {backend!r} cannot serve this model: {misfit}")
    logger.warning("Pallas attention kernel not used (%s); using the reference", misfit)
    return "reference"
