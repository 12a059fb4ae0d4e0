"""The attention metadata of one ragged step: where each flat token sits and whose pages it reads.

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

The host lays the views out (``runtime/step_layout.py``); the attention implementations read them
(``ops/attention.py``). The TPU kernel wants the same rows as per-sequence metadata instead
(``KernelMeta``), derived from the views on the device once per step (``kernel_meta``), so the
host packs the same arrays for every backend.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp


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


class KernelMeta(eqx.Module):
    """The TPU kernel's per-sequence metadata of one step (its sequences are the step's attention rows)."""

    kv_lens: jax.Array
    """[S] context length of each kernel sequence (0 past ``num_seqs``)."""
    page_indices: jax.Array
    """[S, W] each sequence's pages (of one layer)."""
    cu_q_lens: jax.Array
    """[S + 1] where each sequence's queries start in the flat batch."""
    num_seqs: jax.Array
    """[1] sequences in use."""


class RaggedBatch(eqx.Module):
    """Attention metadata of one ragged step. ``positions``, ``q_lens`` and ``write_pages`` have the
    model's ``[batch, position]`` layout with one row of ``T`` tokens, so the cache writes and RoPE
    read them in the model's layout."""

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
    """The same rows as the TPU kernel's sequences (``kernel_meta``), when it is used."""
    decode_kernel: bool = eqx.field(static=True, default=False)
    """The single view runs on the GPU decode kernel (``ops/gpu_attention.py``)."""
    ragged_kernel: bool = eqx.field(static=True, default=False)
    """Both views run on our GPU ragged kernel (``ops/gpu_ragged_attention.py``)."""
    adapters: jax.Array | None = None
    """[1, T] the LoRA slot of each token's sequence (-1: the base model; ``models/lora.py``);
    None: no adapter applies."""
    visible: jax.Array | None = None
    """[1, T] the last position each token attends to, where it is not its own: an image token of
    a model whose images attend both ways (Gemma 3) sees its whole image. None: causal throughout.
    Only the reference attention reads it (a step holding such tokens runs there)."""
    rope_offsets: jax.Array | None = None
    """[1, T] added to each token's position for its rotary position (M-RoPE, Qwen2.5-VL: a token
    after an image sits ``max(rows, columns) - tokens`` of it earlier); None: a model without M-RoPE."""
    image_rope: jax.Array | None = None
    """[3, T] added to ``positions + rope_offsets`` for the temporal, height and width streams of an
    image token (its row and column in the image's grid); None: a step without image tokens."""

    def rope_positions(self, mrope: bool) -> jax.Array:
        """The rotary positions: ``positions`` [1, T], or with ``mrope`` the three streams [3, 1, T]."""
        if not mrope:
            return self.positions
        base = self.positions if self.rope_offsets is None else self.positions + self.rope_offsets
        streams = jnp.broadcast_to(base[None], (3, *base.shape))
        return streams if self.image_rope is None else streams + self.image_rope[:, None, :]

    def with_kernel(self, kernel: KernelMeta) -> RaggedBatch:
        """This batch with the TPU kernel's metadata attached."""
        return self._with(kernel, self.decode_kernel, self.ragged_kernel)

    def with_decode_kernel(self) -> RaggedBatch:
        """This batch with its single view marked for the GPU decode kernel."""
        return self._with(self.kernel, True, False)

    def with_ragged_kernel(self) -> RaggedBatch:
        """This batch with both views marked for the GPU ragged kernel."""
        return self._with(self.kernel, False, True)

    def with_visible(self, visible: jax.Array) -> RaggedBatch:
        """This batch with each token's last visible position (``visible``), on the reference attention."""
        return dataclasses.replace(self, kernel=None, decode_kernel=False, ragged_kernel=False, visible=visible)

    def with_image_rope(self, image_rope: jax.Array) -> RaggedBatch:
        """This batch with its image tokens' M-RoPE streams (``image_rope``)."""
        return dataclasses.replace(self, image_rope=image_rope)

    def _with(self, kernel: KernelMeta | None, decode_kernel: bool, ragged_kernel: bool) -> RaggedBatch:
        return dataclasses.replace(self, kernel=kernel, decode_kernel=decode_kernel, ragged_kernel=ragged_kernel)


def kernel_meta(batch: RaggedBatch, num_tokens: int) -> KernelMeta:
    """The TPU kernel's metadata for the rows of ``batch`` (a step of ``num_tokens`` padded tokens).

    Single-view rows and blocks cover the real flat tokens exactly, each a consecutive run; sorted
    by their first token they are the kernel's sequences in flat order (padding rows start at
    ``num_tokens`` and sort last). A block is a run of its sequence's tokens whose context ends at
    its own last token, so it is a kernel sequence with ``kv_len`` = its last position + 1.
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
