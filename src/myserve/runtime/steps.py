"""Jitted model steps over the paged KV cache.

The model (an equinox pytree) and the step metadata are ordinary arguments; the cache is donated so
XLA writes this step's K/V into it in place. Shapes are static per call: callers pad token rows and
batch sizes to buckets so the number of distinct compilations stays small.
"""

from __future__ import annotations

import functools

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np

from myserve.models.llama import LlamaModel
from myserve.ops.paged_attention import PageBatch


@functools.partial(jax.jit, donate_argnums=3)
def forward_all_logits(
    model: LlamaModel, tokens: jax.Array, batch: PageBatch, kv_cache: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Logits of every query token: float32 [B, T, vocab], and the updated cache."""
    hidden, kv_cache = model(tokens, batch, kv_cache)
    return model.logits(hidden).array, kv_cache


@functools.partial(jax.jit, donate_argnums=3)
def forward_last_logits(
    model: LlamaModel, tokens: jax.Array, batch: PageBatch, kv_cache: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Logits of each row's last real token: float32 [B, vocab], and the updated cache.

    Only those rows go through the LM head, which is most of the FLOPs of a small model's prefill.
    """
    hidden, kv_cache = model(tokens, batch, kv_cache)
    last = jnp.clip(batch.q_lens - 1, 0, None)
    rows = hidden.rearrange(("batch", "position", "embed")).array[jnp.arange(tokens.shape[0]), last]
    named = hax.named(rows, (hidden.resolve_axis("batch"), hidden.resolve_axis("embed")))
    return model.logits(named).array, kv_cache


def page_batch(
    starts: list[int],
    q_lens: list[int],
    page_tables: list[list[int]],
    *,
    tokens_per_row: int,
    pages_per_row: int,
) -> PageBatch:
    """Host-side construction of a ``PageBatch``: row ``b`` has ``q_lens[b]`` new tokens from ``starts[b]``.

    Rows are padded to ``tokens_per_row`` tokens and their page tables to ``pages_per_row`` entries.
    """
    b = len(starts)
    positions = np.zeros((b, tokens_per_row), np.int32)
    table = np.zeros((b, pages_per_row), np.int32)
    for i, (start, pages) in enumerate(zip(starts, page_tables, strict=True)):
        positions[i] = start + np.arange(tokens_per_row)
        table[i, : len(pages)] = pages
    q = np.asarray(q_lens, np.int32)
    kv = np.where(q > 0, np.asarray(starts, np.int32) + q, 0).astype(np.int32)
    return PageBatch(
        positions=jnp.asarray(positions),
        q_lens=jnp.asarray(q),
        kv_lens=jnp.asarray(kv),
        page_table=jnp.asarray(table),
    )
