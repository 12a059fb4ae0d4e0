"""Padded-row forwards over the paged KV cache, a group of layers per jitted call: what
``python -m myserve.generate`` and the parity tests run. The serving engine's step is
``runtime/model_step.py``.

A forward is ``embed -> decoder blocks -> head``, each a jitted function called from Python. The
decoder layers run in groups of about ``LAYERS_PER_CALL``: ``_blocks`` unrolls one group and is
compiled once per step shape (and group size), then called for every group with that group's
weights and first layer index; the cache is donated, so XLA writes each layer's K/V in place.

Why groups (SmolLM2, 30 layers, measured on the 2-core CPU): the whole model in one trace compiles
in ~9 s per shape; one layer per call compiles in ~1.3 s but its 30 calls cost ~10 % per step
(about 0.3 ms of fixed cost per call: output allocation, donation, executor start); groups of 5-6
run as fast as the whole model and compile in ~2 s. Shapes are static per call: callers pad token
rows and batch sizes to buckets so the number of distinct compilations stays small.
"""

from __future__ import annotations

import dataclasses
import functools

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from myserve.models.llama import DecoderLayer, LlamaModel, decoder_block
from myserve.models.spec import ModelSpec
from myserve.ops.paged_attention import PageBatch
from myserve.runtime.batch_layout import Entry, row_batch
from myserve.runtime.kv_cache import Cache, constrain_cache

LAYERS_PER_CALL = 6
"""Decoder layers unrolled into one jitted call (see the module docstring)."""


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=6)
def _blocks(
    spec: ModelSpec,
    treedef: jax.tree_util.PyTreeDef,
    cache_sharding: NamedSharding | None,
    leaves: tuple[jax.Array, ...],
    x: hax.NamedArray,
    batch: PageBatch,
    cache: Cache,
    first_layer: jax.Array,
) -> tuple[hax.NamedArray, Cache]:
    layers: tuple[DecoderLayer, ...] = jax.tree_util.tree_unflatten(treedef, leaves)
    for j, layer in enumerate(layers):
        x, cache = decoder_block(spec, layer, x, batch, cache, first_layer + j, cache_sharding)
    return x, constrain_cache(cache, cache_sharding)


@jax.jit
def _embed(outer: LlamaModel, tokens: jax.Array) -> hax.NamedArray:
    return outer.embed_tokens(tokens)


def _last_hidden(outer: LlamaModel, x: hax.NamedArray, batch: PageBatch) -> hax.NamedArray:
    """Final-norm hidden state (batch, embed) of each row's last real token."""
    last = jnp.clip(batch.q_lens - 1, 0, None)
    rows = x.rearrange(("batch", "position", "embed"))
    picked = rows.array[jnp.arange(rows.array.shape[0]), last]
    return outer.norm(hax.named(picked, (rows.resolve_axis("batch"), rows.resolve_axis("embed"))))


@jax.jit
def _last_logits(outer: LlamaModel, x: hax.NamedArray, batch: PageBatch) -> jax.Array:
    # Only each row's last token goes through the LM head: most of a small model's prefill FLOPs.
    return outer.logits(_last_hidden(outer, x, batch)).array


@jax.jit
def _all_logits(outer: LlamaModel, x: hax.NamedArray) -> jax.Array:
    return outer.logits(outer.norm(x)).array


def outer_part(model: LlamaModel) -> LlamaModel:
    """The model without its layers (embedding, final norm, LM head): what the non-layer steps take."""
    return eqx.tree_at(lambda m: m.layers, model, ())


@functools.cache
def layer_groups(num_layers: int, per_call: int = LAYERS_PER_CALL) -> tuple[tuple[int, int], ...]:
    """(start, stop) of each group: as even as possible, so at most two group sizes get compiled."""
    n = -(-num_layers // per_call)
    bounds = [round(i * num_layers / n) for i in range(n + 1)]
    return tuple(zip(bounds[:-1], bounds[1:], strict=True))


@dataclasses.dataclass(frozen=True)
class LayerGroups:
    """The decoder layers cut into jitted calls, each group's weights flattened once.

    A jit call flattens its pytree arguments on every call, and equinox modules and haliax
    NamedArrays flatten in Python: ~0.5 ms per call of 5-6 layers, 1.5 ms of a 9 ms single-request
    decode step of a 1B model on an H100. A tuple of plain arrays flattens in C++.
    """

    groups: tuple[tuple[jax.Array, jax.tree_util.PyTreeDef, tuple[jax.Array, ...]], ...]
    """(index of the group's first layer, treedef of its layers, their leaves) per group."""
    cache_sharding: NamedSharding | None = None
    """The KV cache's sharding, kept explicitly on every group's output (None: left to XLA)."""

    @staticmethod
    def of(
        model: LlamaModel, per_call: int = LAYERS_PER_CALL, cache_sharding: NamedSharding | None = None
    ) -> LayerGroups:
        """The groups of ``model``, about ``per_call`` layers each (see ``layer_groups``)."""
        groups = []
        for start, stop in layer_groups(len(model.layers), per_call):
            leaves, treedef = jax.tree_util.tree_flatten(model.layers[start:stop])
            groups.append((jnp.int32(start), treedef, tuple(leaves)))
        return LayerGroups(tuple(groups), cache_sharding)


def run_layers(
    model: LlamaModel, x: hax.NamedArray, batch: PageBatch, cache: Cache, groups: LayerGroups | None = None
) -> tuple[hax.NamedArray, Cache]:
    """Every decoder layer, a group per jitted call; the cache is donated through the chain.

    ``groups`` is ``LayerGroups.of(model)``, passed by callers that step often.
    """
    groups = groups or LayerGroups.of(model)
    for start, treedef, leaves in groups.groups:
        x, cache = _blocks(model.spec, treedef, groups.cache_sharding, leaves, x, batch, cache, start)
    return x, cache


def forward_last_logits(
    model: LlamaModel,
    tokens: jax.Array,
    batch: PageBatch,
    kv_cache: Cache,
    outer: LlamaModel | None = None,
    groups: LayerGroups | None = None,
) -> tuple[jax.Array, Cache]:
    """Logits of each row's last real token: float32 [B, vocab], and the updated cache.

    ``outer`` (``outer_part(model)``) and ``groups`` (``LayerGroups.of(model)``) are passed by
    callers that step often.
    """
    outer = outer_part(model) if outer is None else outer
    x, kv_cache = run_layers(model, _embed(outer, tokens), batch, kv_cache, groups)
    return _last_logits(outer, x, batch), kv_cache


def forward_all_logits(
    model: LlamaModel, tokens: jax.Array, batch: PageBatch, kv_cache: Cache
) -> tuple[jax.Array, Cache]:
    """Logits of every query token: float32 [B, T, vocab], and the updated cache."""
    outer = outer_part(model)
    x, kv_cache = run_layers(model, _embed(outer, tokens), batch, kv_cache)
    return _all_logits(outer, x), kv_cache


def page_batch(
    starts: list[int],
    q_lens: list[int],
    page_tables: list[list[int]],
    *,
    tokens_per_row: int,
    pages_per_row: int,
    page_size: int,
) -> PageBatch:
    """Host-side construction of a rows-layout ``PageBatch``: row ``b`` has ``q_lens[b]`` new tokens
    from ``starts[b]``. Rows are padded to ``tokens_per_row`` tokens and page tables to ``pages_per_row``."""
    entries = [Entry([0] * n, start, pages) for start, n, pages in zip(starts, q_lens, page_tables, strict=True)]
    host = row_batch(
        entries, rows=len(entries), tokens_per_row=tokens_per_row, width=pages_per_row, page_size=page_size
    )
    return host.device()[1]
