"""Ragged paged attention: one flat batch of query tokens from many sequences, any mix of prefill
chunks and decode tokens, over the paged KV cache.

A step's tokens are one flat array ``[T]`` (a single "row" of the model's ``[batch, position]``
layout, so the projections and MLP are plain ``[T, embed]`` matmuls with no per-row padding). The
attention then needs, for every token, its own sequence's context. Gathering that context per
token would copy a prefill chunk's context once per token; gathering it per sequence and padding
every sequence's queries to the longest chunk would multiply a decode token's work by the chunk
length. So the host describes the tokens in two *views*, each a gather of the flat tokens:

- the single view ``[N1]``: one query token per row (decode tokens): row ``i`` is flat token
  ``single.idx[i, 0]`` and reads its sequence's pages ``single.pages[i]``;
- the block view ``[N2, Q]``: blocks of up to ``Q`` consecutive tokens of one sequence (prefill
  chunks, cut into blocks): a block's tokens share one gathered context.

Each view reads its rows' pages in chunks of ``chunk_pages`` pages with an online softmax (as
flash attention does), in a ``while_loop`` that stops after the step's longest context: page
tables are full width (``max_model_len`` pages) and no page-width bucket is compiled. Rows are
computed together, so a chunk costs the same for every row of a view; padding rows have
``kv_lens == 0``.

Causality is by absolute position: a query at position ``p`` sees cache slots ``<= p`` of its row
(the cache already holds this step's keys), and ``< kv_lens``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding

from myserve.ops.gpu_decode_attention import decode_attention
from myserve.ops.paged_attention import _MASK_VALUE, KVCache, _gather_pages

if TYPE_CHECKING:
    from myserve.ops.kernel_attention import KernelMeta


class AttentionView(eqx.Module):
    """Rows of query tokens gathered from the flat batch, each with its sequence's page table."""

    idx: jax.Array
    """[N, Q] flat index of each query token; ``T`` (one past the last) for padding."""
    positions: jax.Array
    """[N, Q] absolute position of each query token (anything for padding)."""
    kv_lens: jax.Array
    """[N] context length of the row's sequence after this step (0 for padding rows)."""
    pages: jax.Array
    """[N, W] the sequence's page ids; W is a multiple of the chunk size."""


class RaggedBatch(eqx.Module):
    """Attention metadata of one ragged step. ``positions``, ``q_lens`` and ``write_pages`` have the
    model's ``[batch, position]`` layout with one row of ``T`` tokens, so ``write_kv`` and RoPE read
    them as they read a padded batch."""

    positions: jax.Array
    """[1, T] absolute position of each token (0 for padding)."""
    q_lens: jax.Array
    """[1] number of real tokens (they come first)."""
    write_pages: jax.Array
    """[1, T] page receiving each token's K/V (at offset position % page_size)."""
    single: AttentionView
    blocks: AttentionView
    chunk_pages: int = eqx.field(static=True, default=8)
    """Pages of context each loop iteration reads (static: a compile-time tile size)."""
    kernel: KernelMeta | None = None
    """The same rows as the TPU kernel's sequences (``kernel_attention.kernel_meta``), when it is used."""
    decode_kernel: bool = eqx.field(static=True, default=False)
    """The single view runs on the GPU decode kernel (``ops/gpu_decode_attention.py``)."""

    def with_kernel(self, kernel: KernelMeta) -> RaggedBatch:
        """This batch with the TPU kernel's metadata attached."""
        return self._with(kernel, self.decode_kernel)

    def with_decode_kernel(self) -> RaggedBatch:
        """This batch with its single view marked for the GPU decode kernel."""
        return self._with(self.kernel, True)

    def _with(self, kernel: KernelMeta | None, decode_kernel: bool) -> RaggedBatch:
        return RaggedBatch(
            self.positions,
            self.q_lens,
            self.write_pages,
            self.single,
            self.blocks,
            self.chunk_pages,
            kernel,
            decode_kernel,
        )


def _view_attention(
    q: jax.Array,
    cache: KVCache,
    layer: int | jax.Array,
    view: AttentionView,
    *,
    chunk_pages: int,
    sm_scale: float,
    heads_sharded: bool,
) -> jax.Array:
    """Attention of one view's rows. q: [T + 1, heads, D] (last row zeros) -> [N, Q, heads, D] float32."""
    _, h, d = q.shape
    n, qn = view.idx.shape
    kvh = cache.k.shape[1]
    g = h // kvh
    m_rows = qn * g
    # [N, KVH, Q * g, D]: the queries of a row that read one KV head, query-major.
    qm = q[view.idx].reshape(n, qn, kvh, g, d).transpose(0, 2, 1, 3, 4).reshape(n, kvh, m_rows, d)
    q_pos = jnp.repeat(view.positions, g, axis=1)  # [N, Q * g]
    span = chunk_pages * cache.page_size
    num_chunks = (jnp.max(view.kv_lens, initial=0) + span - 1) // span

    def body(i: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
        m, denom, acc = carry
        pages = lax.dynamic_slice_in_dim(view.pages, i * chunk_pages, chunk_pages, axis=1)
        keys, values = (
            _gather_pages(x, layer, pages, heads_sharded).reshape(kvh, n, span, d) for x in (cache.k, cache.v)
        )
        kv_pos = i * span + jnp.arange(span)
        mask = (kv_pos[None, :, None] <= q_pos[:, None, :]) & (kv_pos[None, :, None] < view.kv_lens[:, None, None])
        s = jnp.einsum("knsd,nkmd->knsm", keys, qm, preferred_element_type=jnp.float32) * sm_scale
        s = jnp.where(mask[None], s, _MASK_VALUE)  # [KVH, N, span, M]
        m_new = jnp.maximum(m, s.max(axis=2))
        p = jnp.exp(s - m_new[:, :, None, :])
        correction = jnp.exp(m - m_new)
        denom = denom * correction + p.sum(axis=2)
        pv = jnp.einsum("knsm,knsd->nkmd", p.astype(values.dtype), values, preferred_element_type=jnp.float32)
        acc = acc * correction.transpose(1, 0, 2)[..., None] + pv
        return m_new, denom, acc

    init = (
        jnp.full((kvh, n, m_rows), _MASK_VALUE, jnp.float32),
        jnp.zeros((kvh, n, m_rows), jnp.float32),
        jnp.zeros((n, kvh, m_rows, d), jnp.float32),
    )
    _, denom, acc = lax.fori_loop(0, num_chunks, body, init)
    out = acc / jnp.maximum(denom, 1e-30).transpose(1, 0, 2)[..., None]
    return out.reshape(n, kvh, qn, g, d).transpose(0, 2, 1, 3, 4).reshape(n, qn, h, d)


def ragged_attention(
    q: jax.Array,
    cache: KVCache,
    layer: int | jax.Array,
    batch: RaggedBatch,
    *,
    sm_scale: float,
    heads_sharded: bool = False,
    cache_sharding: NamedSharding | None = None,
) -> jax.Array:
    """Attention of flat queries ``q`` [T, heads, D] over their sequences' paged context (this
    step's K/V already written); returns [T, heads, D] in q's dtype (padding tokens: zeros). Pure
    JAX, except the single view on the GPU decode kernel when ``batch.decode_kernel`` (which reads
    ``cache_sharding`` to run per device when heads are split)."""
    t, h, d = q.shape
    padded = jnp.concatenate([q, jnp.zeros((1, h, d), q.dtype)])
    out = jnp.zeros((t + 1, h, d), jnp.float32)
    for view in (batch.single, batch.blocks):
        if view.idx.shape[0] == 0:
            continue
        if batch.decode_kernel and view is batch.single:
            rows = decode_attention(
                padded[view.idx[:, 0]], cache, layer, view.kv_lens, view.pages,
                sm_scale=sm_scale, cache_sharding=cache_sharding,
            )  # fmt: skip
            out = out.at[view.idx[:, 0]].set(rows.astype(jnp.float32))
            continue
        rows = _view_attention(
            padded, cache, layer, view, chunk_pages=batch.chunk_pages, sm_scale=sm_scale, heads_sharded=heads_sharded
        )
        # Padding entries all point at row T, which is dropped.
        out = out.at[view.idx.reshape(-1)].set(rows.reshape(-1, h, d))
    return out[:t].astype(q.dtype)
