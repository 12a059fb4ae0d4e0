"""A jittable pure-JAX implementation of the Pallas ragged paged attention kernel's contract.

The kernel runs only on a TPU, and JAX's own reference of it (``ref_ragged_paged_attention``)
loops in Python over concrete sequence counts, so it cannot run inside a jitted step. Tests put
this function where the kernel goes (``myserve.ops.tpu_attention._tpu_kernel``) to run the
serving step's kernel path on CPU: the cache layout, the writes, the per-sequence metadata and the
layer offsets are then exercised exactly as on a TPU. ``tests/test_kernel_attention.py`` checks it
against JAX's reference first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def contract_attention(
    q: jax.Array,  # [T, heads, D]
    kv_pages: jax.Array,  # [pages, page_size, 2 * kv_heads, D]
    kv_lens: jax.Array,  # [S]
    page_indices: jax.Array,  # [S, W]
    cu_q_lens: jax.Array,  # [S + 1]
    num_seqs: jax.Array,  # [1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> jax.Array:
    """What the kernel returns: each real query token's causal attention over its sequence's pages
    (query ``j`` of sequence ``s`` at position ``kv_lens[s] - q_len + j``); zeros past the real tokens.
    ``sliding_window``: keys at positions ``<= pos - sliding_window`` are masked too; ``soft_cap``:
    scaled scores become ``soft_cap * tanh(s / soft_cap)``; ``k_scale``, ``v_scale``: the cache's
    keys and values are widened to float32 and multiplied by them (a quantized cache)."""
    t, h, d = q.shape
    _, page_size, combined, _ = kv_pages.shape
    kvh = combined // 2
    token = jnp.arange(t)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens[1:], token, side="right"), 0, kv_lens.shape[0] - 1)
    real = token < cu_q_lens[num_seqs[0]]
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (token - cu_q_lens[seq])
    ctx = kv_pages[page_indices[seq]]  # [T, W, page_size, 2 * KVH, D]
    ctx = ctx.reshape(t, -1, kvh, 2, d)
    keys, values = ctx[..., 0, :], ctx[..., 1, :]  # [T, W * page_size, KVH, D]
    if k_scale is not None:
        keys = keys.astype(jnp.float32) * k_scale
    if v_scale is not None:
        values = values.astype(jnp.float32) * v_scale
    group = h // kvh
    qg = q.reshape(t, kvh, group, d)
    scores = jnp.einsum("tkgd,tskd->tkgs", qg, keys.astype(q.dtype), preferred_element_type=jnp.float32) * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    visible = jnp.arange(keys.shape[1])[None, :] <= pos[:, None]  # causal, and inside the context
    if sliding_window is not None:
        visible &= jnp.arange(keys.shape[1])[None, :] > pos[:, None] - sliding_window
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("tkgs,tskd->tkgd", probs, values.astype(jnp.float32)).reshape(t, h, d)
    return jnp.where(real[:, None, None], out, 0).astype(q.dtype)
