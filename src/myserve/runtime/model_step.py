"""The engine's step: one jitted executable per token bucket, from packed host arrays to sampled tokens.

``model_step`` unpacks the step's layout (``runtime/step_layout.py``), embeds the flat tokens, runs
every decoder layer over them (ragged paged attention), takes each sampling row's last hidden
state through the final norm and the LM head, samples, and counts the samples in the penalty
slots. The KV cache and the penalty counts are donated, so XLA updates them in place.

Layers are unrolled in the one executable. A ``lax.scan`` over weights stacked along a layer axis
compiles one layer instead of all of them, but XLA:CPU copies each layer's weights out of the
stack on every step (its dot kernels do not read a dynamic slice in place): measured on SmolLM2
(30 layers, 2-core CPU), one decode row 34.3 ms scanned against 22.4 ms unrolled, 64 rows 237
against 212 ms; the scan compiled in 0.9 s against 3.7 s. The step count is small (one
executable per token bucket), so the run-time cost decides. Each layer is traced as a nested
``jax.jit`` (``_layer``) called once per layer with its weights and index: JAX traces and lowers
the layer once per bucket instead of once per layer (0.15 s instead of 0.7-1.1 s per bucket for
SmolLM2's 30 layers), and XLA inlines the calls, so the compiled program is the same instruction
for instruction as a Python-unrolled one. The layer's kind (``LayerKind``: its sliding window and
rotary table) is a static argument, so a model whose layers differ (Gemma's sliding and global
layers) traces one layer function per distinct kind, not one per layer.

One executable per bucket serves every sampling mode: whether any row draws (temperature > 0),
whether any row wants logprobs and the top ``MAX_TOP_LOGPROBS``, and whether any prompt position
is scored are each a ``lax.cond`` on the rows' parameters, so a greedy batch without logprobs
pays only the argmax. Two variants per bucket (an argmax-only one chosen by the host) would avoid
the conditionals but double what warmup builds and a warm start loads (0.4-0.9 s per executable
on the 2-core CPU, most of start-up).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from myserve.models.llama import BATCH, POS, DecoderLayer, LlamaModel, decoder_block
from myserve.models.sharding import MeshAxes, kv_cache_sharding
from myserve.models.spec import LayerKind, ModelSpec
from myserve.ops.paged_cache import KernelKVCache
from myserve.ops.ragged_batch import RaggedBatch, kernel_meta
from myserve.runtime.kv_cache import Cache, constrain_cache
from myserve.runtime.mesh import replicated as replicated_on
from myserve.runtime.sampler import SampleOutput, sample, token_logprobs
from myserve.runtime.sampling_rows import MAX_TOP_LOGPROBS
from myserve.runtime.step_arrays import unpack_rows, unpack_step
from myserve.runtime.step_layout import Span, StepShape, layout


class StepOutput(NamedTuple):
    """A step's device results: the sampling rows' samples, prompt scores per flat token, and the
    pooling rows' summed hidden states."""

    sampled: SampleOutput
    """tokens [N1], logprobs [N1], top ids and top logprobs [N1, K] (zeros when no row asked for logprobs)."""
    scores: tuple[jax.Array, jax.Array, jax.Array]
    """(logprob of the following token [T], top ids [T, K], top logprobs [T, K]); zeros when nothing is scored."""
    pooled: jax.Array
    """float32 [N1, embed]: per pooling row (a span's index), the sum of its pooled tokens' final
    hidden states (after the final norm); zeros when no span pools."""


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 7))
def _layer(
    spec: ModelSpec,
    kind: LayerKind,
    treedef: jax.tree_util.PyTreeDef,
    leaves: tuple[jax.Array, ...],
    x: hax.NamedArray,
    batch: RaggedBatch,
    cache: Cache,
    cache_sharding: NamedSharding | None,
    index: jax.Array,
) -> tuple[hax.NamedArray, Cache]:
    """One decoder layer of ``kind`` (weights ``leaves``, layer ``index`` of the cache), traced once
    per bucket and kind."""
    layer: DecoderLayer = jax.tree_util.tree_unflatten(treedef, leaves)
    return decoder_block(spec, layer, x, batch, cache, index, cache_sharding, kind)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4), donate_argnums=(7, 8, 10))
def model_step(
    shape: StepShape,
    treedef: jax.tree_util.PyTreeDef,
    cache_sharding: NamedSharding | None,
    replicated: NamedSharding | None,
    sampler: bool,
    outer: LlamaModel,
    layers: tuple[tuple[jax.Array, ...], ...],
    cache: Cache,
    counts: jax.Array,
    prompt_mask: jax.Array,
    fed: jax.Array,
    flat: jax.Array,
    ints: jax.Array,
    floats: jax.Array,
    bitmask: jax.Array,
) -> tuple[StepOutput, Cache, jax.Array, jax.Array]:
    """One engine step. ``outer`` is the model without its layers, ``layers`` each layer's leaves
    (flattened once by the executor: a tuple of arrays flattens in C++, equinox modules in Python).
    ``flat`` is ``HostStep.pack()``; ``ints``/``floats`` the sampling rows [N1, ...]; ``bitmask``
    int32 [N1, ceil(V / 32)] the grammar masks of the constrained rows (all ones elsewhere). ``fed`` [F]
    holds the previous step's sampled tokens (F = max_num_seqs + 1 rows, whatever its bucket):
    tokens still in flight on the host are taken from it. Returns this step's, padded the same way.
    ``sampler`` False (an embedding-only deployment): no LM head, no sampling; zeros stand for them.
    """
    if replicated is not None:
        flat = jax.lax.with_sharding_constraint(flat, replicated)
    tokens, batch, sample_idx, following, feed, pool_rows = unpack_step(flat, shape)
    tokens = jnp.where(feed >= 0, fed[jnp.maximum(feed, 0)], tokens)
    x, cache = _forward(shape, treedef, cache_sharding, outer, layers, cache, tokens, batch)
    n1 = shape.singles
    pooled = jax.lax.cond(
        jnp.any(pool_rows >= 0),
        lambda: _pool(outer, x, pool_rows, n1),
        lambda: jnp.zeros((n1, outer.spec.hidden_size), jnp.float32),
    )
    if not sampler:
        k = MAX_TOP_LOGPROBS
        ints, floats = jnp.zeros((n1, k), jnp.int32), jnp.zeros((n1, k), jnp.float32)
        zeros = SampleOutput(ints[:, 0], floats[:, 0], ints, floats)
        return StepOutput(zeros, _no_scores(tokens.shape[0]), pooled), cache, counts, fed
    hidden = x.rearrange((BATCH, POS, "embed")).array[0]  # [T, embed]
    last = hax.named(hidden[sample_idx], (BATCH, "embed"))
    logits = outer.logits(outer.norm(last)).array  # [N1, V]
    sampling, slots, weight, wants_logprobs = unpack_rows(ints, floats)
    out = sample(
        logits,
        sampling,
        counts,
        prompt_mask,
        num_top_logprobs=MAX_TOP_LOGPROBS,
        all_greedy=jnp.all(sampling.temperature <= 0),
        logprobs=jnp.any(wants_logprobs),
        slots=slots,
        bitmask=bitmask,
    )
    scores = jax.lax.cond(
        jnp.any(following >= 0), lambda: _score(outer, x, following), lambda: _no_scores(tokens.shape[0])
    )
    counts = counts.at[slots, out.tokens].add(weight)
    next_fed = jnp.zeros_like(fed).at[: out.tokens.shape[0]].set(out.tokens)
    return StepOutput(out, scores, pooled), cache, counts, next_fed


def _pool(outer: LlamaModel, x: hax.NamedArray, pool_rows: jax.Array, rows: int) -> jax.Array:
    """float32 [rows, embed]: the final-norm hidden states of ``x`` [1, T, embed] summed by pooling
    row (``pool_rows`` [T], -1: not pooled). The host divides a mean by the prompt's length once
    every chunk is in, and normalizes."""
    hidden = outer.norm(x).rearrange((BATCH, POS, "embed")).array[0].astype(jnp.float32)  # [T, embed]
    segments = jnp.where(pool_rows >= 0, pool_rows, rows)  # unpooled tokens sum into a dropped row
    return jax.ops.segment_sum(hidden, segments, num_segments=rows + 1)[:rows]


def _forward(
    shape: StepShape,
    treedef: jax.tree_util.PyTreeDef,
    cache_sharding: NamedSharding | None,
    outer: LlamaModel,
    layers: tuple[tuple[jax.Array, ...], ...],
    cache: Cache,
    tokens: jax.Array,
    batch: RaggedBatch,
) -> tuple[hax.NamedArray, Cache]:
    """Inside the jit: the hidden states [1, T, embed] of the flat ``tokens`` [T] after every decoder
    layer, and the cache with their K/V written."""
    if isinstance(cache, KernelKVCache):  # the TPU kernel's per-sequence view of the rows, once per step
        batch = batch.with_kernel(kernel_meta(batch, shape.tokens))
    elif outer.attention_backend == "pallas_gpu":
        batch = batch.with_decode_kernel()
    x = outer.embed_tokens(tokens[None])  # one row of T tokens: [1, T, embed]
    kinds = outer.spec.layer_kinds()
    for i, leaves in enumerate(layers):
        x, cache = _layer(outer.spec, kinds[i], treedef, leaves, x, batch, cache, cache_sharding, jnp.int32(i))
    return x, constrain_cache(cache, cache_sharding)


def _all_logits(outer: LlamaModel, x: hax.NamedArray) -> jax.Array:
    """Float32 logits [T, V] of every flat token of hidden states ``x`` [1, T, embed]."""
    return outer.logits(outer.norm(x)).array[0]


def _score(outer: LlamaModel, x: hax.NamedArray, following: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Logprob of each flat token's following token (scored prompt positions), with the top K."""
    return token_logprobs(_all_logits(outer, x), jnp.maximum(following, 0), MAX_TOP_LOGPROBS)


def _no_scores(t: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    k = MAX_TOP_LOGPROBS
    return jnp.zeros(t, jnp.float32), jnp.zeros((t, k), jnp.int32), jnp.zeros((t, k), jnp.float32)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=6)
def step_logits(
    shape: StepShape,
    treedef: jax.tree_util.PyTreeDef,
    cache_sharding: NamedSharding | None,
    replicated: NamedSharding | None,
    outer: LlamaModel,
    layers: tuple[tuple[jax.Array, ...], ...],
    cache: Cache,
    flat: jax.Array,
) -> tuple[jax.Array, Cache]:
    """``model_step``'s model without the sampler: the same packed layout (``flat``), layers and
    attention, returning float32 logits [T, V] of every flat token and the updated cache (donated).
    What ``python -m myserve.generate`` and the parity tests run, so parity with transformers is a
    property of the served step."""
    if replicated is not None:
        flat = jax.lax.with_sharding_constraint(flat, replicated)
    tokens, batch, *_ = unpack_step(flat, shape)
    x, cache = _forward(shape, treedef, cache_sharding, outer, layers, cache, tokens, batch)
    return _all_logits(outer, x), cache


def split_model(
    model: LlamaModel,
) -> tuple[LlamaModel, jax.tree_util.PyTreeDef, tuple[tuple[jax.Array, ...], ...]]:
    """What the steps take of a model: its outer part (embedding, final norm, LM head: the model
    without its layers), one layer's treedef, and each layer's leaves, flattened once here (a
    tuple of arrays flattens in C++ on every call)."""
    outer = eqx.tree_at(lambda m: m.layers, model, ())
    layers = tuple(tuple(jax.tree_util.tree_leaves(layer)) for layer in model.layers)
    return outer, jax.tree_util.tree_structure(model.layers[0]), layers


@dataclasses.dataclass(frozen=True)
class StepLogits:
    """``step_logits`` on the host, for one model on a mesh: spans in, each span's logits out."""

    outer: LlamaModel
    treedef: jax.tree_util.PyTreeDef
    layers: tuple[tuple[jax.Array, ...], ...]
    """Each layer's leaves, flattened once (a tuple of arrays flattens in C++ on every call)."""
    cache_sharding: NamedSharding
    replicated: NamedSharding
    page_size: int

    @staticmethod
    def of(model: LlamaModel, mesh: Mesh, mapping: Mapping[str, MeshAxes], page_size: int) -> StepLogits:
        """For ``model`` placed on ``mesh`` by ``mapping``, over a cache of ``page_size``-token pages
        in the model's attention backend's layout (``init_kv_cache(..., model.attention_backend)``)."""
        return StepLogits(
            *split_model(model),
            kv_cache_sharding(mapping, mesh, model.attention_backend),
            replicated_on(mesh),
            page_size,
        )

    def __call__(self, cache: Cache, spans: Sequence[Span], shape: StepShape) -> tuple[np.ndarray, Cache]:
        """One step of ``spans`` (which ``shape`` must fit): the logits [tokens, V] of their tokens in
        order (numpy), and the cache (``cache`` is donated)."""
        host = layout(spans, shape, self.page_size)
        logits, cache = step_logits(
            shape, self.treedef, self.cache_sharding, self.replicated, self.outer, self.layers, cache, host.pack()
        )
        return np.asarray(logits[: sum(len(span.token_ids) for span in spans)]), cache
