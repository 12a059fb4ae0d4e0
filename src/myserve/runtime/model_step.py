"""The engine's step executables: the model over a ragged token batch, then the sampler.

A step is up to three jitted executables, each called once, dispatched back to back without the
host waiting on any of them:

- ``forward_step``, one per (token bucket, context bucket) (``runtime/buckets.py``): unpacks the
  step's layout (``runtime/step_layout.py``), embeds the flat tokens, runs every decoder layer over
  them (ragged paged attention), and returns the sampling rows' last hidden states, every token's
  hidden state, the scored positions' following tokens and (a deployment that embeds) the pooled
  sums. The KV cache is donated, so XLA updates it in place.
- ``head_step``, one per (sampling rows, mode): final norm, LM head, sampler, penalty counts. The
  *mode* is the host's choice for the step's rows (``HEAD_MODES``): the greedy argmax of raw
  logits, sampling with logit processing and logprobs, or the same with top-k/top-p thresholds.
- ``score_step``, one per token bucket, only for a step that scores prompt positions (echo and
  prompt logprobs): the LM head over every token and the logprob of each following token.

Why not one executable with the sampler's cases inside: the cases were ``lax.cond``/``lax.switch``
on the rows' parameters, and on a GPU XLA copies such a predicate to the host and waits for it,
so the host could not plan step N+1 while the device ran step N (1.5 ms of host wait per step of a
1B model on an H200, `../shared/gpu/`). The host already knows what the step's rows need, so it
picks the executable instead; splitting the sampler from the layers keeps that choice cheap: the
layers (most of the compile time) are compiled once per shape, the small heads once per mode.
``tests/test_step_structure.py`` reads the compiled executables: no conditional, no loop whose
trip count is not known.

Layers are unrolled in the forward executable. A ``lax.scan`` over weights stacked along a layer
axis compiles one layer instead of all of them, but XLA:CPU copies each layer's weights out of
the stack on every step (its dot kernels do not read a dynamic slice in place): measured on
SmolLM2 (30 layers, 2-core CPU), one decode row 34.3 ms scanned against 22.4 ms unrolled, 64 rows
237 against 212 ms; the scan compiled in 0.9 s against 3.7 s. The step count is small, so the
run-time cost decides. Each layer is traced as a nested ``jax.jit`` (``_layer``) called once per
layer with its weights and index: JAX traces and lowers the layer once per bucket instead of once
per layer, and XLA inlines the calls, so the compiled program is the same instruction for
instruction as a Python-unrolled one. The layer's kind (``LayerKind``: its sliding window and
rotary table) is a static argument, so a model whose layers differ (Gemma's sliding and global
layers) traces one layer function per distinct kind, not one per layer.
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
from myserve.ops.ragged_batch import AttentionView, RaggedBatch, kernel_meta
from myserve.runtime.kv_cache import Cache, constrain_cache
from myserve.runtime.mesh import replicated as replicated_on
from myserve.runtime.sampler import SampleOutput, SamplingArrays, sample, token_logprobs
from myserve.runtime.sampling_rows import MAX_TOP_LOGPROBS, STEPS
from myserve.runtime.step_arrays import split_step, unpack_rows, unpack_step
from myserve.runtime.step_layout import Span, StepShape, layout


class StepOutput(NamedTuple):
    """A step's device results: the sampling rows' samples, prompt scores per flat token, and the
    pooling rows' summed hidden states."""

    sampled: SampleOutput
    """tokens [N1], logprobs [N1], top ids and top logprobs [N1, K] (no columns in ``argmax`` mode)."""
    scores: tuple[jax.Array, jax.Array, jax.Array, jax.Array] | None
    """(logprob of the following token [T], top ids [T, K], top logprobs [T, K]); None when nothing is scored."""
    pooled: jax.Array | np.ndarray
    """float32 [N1, embed]: per pooling row (a span's index), the sum of its pooled tokens' final
    hidden states (after the final norm); [N1, 0] in a deployment that does not embed, and on the
    host for a several-token decode call (nothing pools there)."""


class ForwardOutput(NamedTuple):
    """What ``forward_step`` hands to the head and score executables (it stays on the device)."""

    last: jax.Array
    """[N1, embed] the last hidden state of each sampling row (before the final norm)."""
    hidden: jax.Array
    """[T, embed] every flat token's last hidden state (read by ``score_step`` only)."""
    following: jax.Array
    """int32 [T]: each scored position's following token, -1 elsewhere."""
    pooled: jax.Array
    """float32 [N1, embed] pooled sums, or [N1, 0] when ``pool`` is off."""
    ints: jax.Array
    """The step's sampling rows (``SamplingRows.ints``), cut out of the one transfer for the head."""
    floats: jax.Array
    """``SamplingRows.floats``, likewise."""


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


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4), donate_argnums=(7,))
def forward_step(
    shape: StepShape,
    treedef: jax.tree_util.PyTreeDef,
    cache_sharding: NamedSharding | None,
    replicated: NamedSharding | None,
    pool: bool,
    outer: LlamaModel,
    layers: tuple[tuple[jax.Array, ...], ...],
    cache: Cache,
    fed: jax.Array,
    packed: jax.Array,
    images: tuple[jax.Array, jax.Array, jax.Array] | None = None,
) -> tuple[ForwardOutput, Cache]:
    """The model over one step. ``outer`` is the model without its layers, ``layers`` each layer's
    leaves (flattened once by the executor: a tuple of arrays flattens in C++, equinox modules in
    Python). ``packed`` is the step's one transfer (``pack_step``: ``HostStep.pack()`` and the
    sampling rows, which go on to the head as outputs). ``fed`` [F] holds the previous step's sampled tokens
    (F = max_num_seqs + 1 rows, whatever its bucket): tokens still in flight on the host are taken
    from it. ``pool`` (static): the deployment embeds, so the pooled sums are computed (a
    ``segment_sum``: cheap beside the layers, so no step decides it on the device). ``images``: a
    step holding image tokens (its own executable, ``("forward_images", shape)``): (embeddings
    [T, embed], ends [T], M-RoPE streams [3, T]) replacing the token embeddings of the flat tokens
    whose end is not 0 (``StepCall.image_ends``, ``image_rope``)."""
    if replicated is not None:
        packed = jax.lax.with_sharding_constraint(packed, replicated)
    flat, ints, floats = split_step(packed, shape)
    tokens, batch, sample_idx, following, feed, pool_rows = unpack_step(flat, shape)
    tokens = jnp.where(feed >= 0, fed[jnp.maximum(feed, 0)], tokens)
    x, cache = _forward(shape, treedef, cache_sharding, outer, layers, cache, tokens, batch, images)
    n1 = shape.singles
    hidden = x.rearrange((BATCH, POS, "embed")).array[0]  # [T, embed]
    if pool:
        pooled = _pool(outer, x, pool_rows, n1)
    else:
        pooled = jnp.zeros((n1, 0), jnp.float32)
    out = ForwardOutput(hidden[sample_idx], hidden, following, pooled, ints, floats)
    if replicated is not None:  # the head and score executables were built for replicated inputs
        out = ForwardOutput(*(jax.lax.with_sharding_constraint(a, replicated) for a in out))
    return out, cache


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(4, 6))
def head_step(
    mode: str,
    replicated: NamedSharding | None,
    outer: LlamaModel,
    last: jax.Array,
    counts: jax.Array,
    prompt_mask: jax.Array,
    fed: jax.Array,
    ints: jax.Array,
    floats: jax.Array,
    bitmask: jax.Array,
) -> tuple[SampleOutput, jax.Array, jax.Array]:
    """The sampling rows of one step: ``last`` [N1, embed] through the final norm and the LM head,
    then the sampler in ``mode`` (``sampling_rows.HEAD_MODES``, static). ``ints``/``floats`` are the sampling rows
    [N1, ...]; ``bitmask`` int32 [N1, ceil(V / 32)] the grammar masks of the constrained rows (all
    ones elsewhere). Each sampled token is counted in its row's penalty slot (``counts``, donated);
    returns the samples, the counts, and ``fed`` [F] (donated) holding this step's tokens."""
    if replicated is not None:
        ints = jax.lax.with_sharding_constraint(ints, replicated)
    sampling, slots, weight, _ = unpack_rows(ints, floats)
    out = _sample_rows(mode, outer, last, sampling, slots, counts, prompt_mask, bitmask)
    counts = counts.at[slots, out.tokens].add(weight)
    next_fed = jnp.zeros_like(fed).at[: out.tokens.shape[0]].set(out.tokens)
    return out, counts, next_fed


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5), donate_argnums=(8, 9, 11))
def decode_loop(
    shape: StepShape,
    steps: int,
    mode: str,
    treedef: jax.tree_util.PyTreeDef,
    cache_sharding: NamedSharding | None,
    replicated: NamedSharding | None,
    outer: LlamaModel,
    layers: tuple[tuple[jax.Array, ...], ...],
    cache: Cache,
    counts: jax.Array,
    prompt_mask: jax.Array,
    fed: jax.Array,
    packed: jax.Array,
    bitmask: jax.Array,
) -> tuple[SampleOutput, Cache, jax.Array, jax.Array]:
    """Several decode tokens per call: ``steps`` (static) iterations of the model and the sampler
    over a step of one-token rows only (``shape``: N1 rows, no blocks; row ``r`` is flat token ``r``
    and sampling row ``r``; ``packed`` as ``forward_step``'s), each row's sampled token fed to its
    next iteration on the device.

    Row ``r`` decodes its own ``ints[r, STEPS]`` tokens (at most ``steps``: the host caps it by the
    row's ``max_tokens`` and context, and sets 1 for a row whose grammar needs the host between
    tokens) and stops after a token among its banned ids (EOS and stop token ids; banned outright
    while its iteration is below ``BAN_STEPS``, for ``min_tokens``). A stopped row writes no more
    K/V, counts no more penalty tokens, and keeps its last token for the next step to feed.
    Seeds advance by position, so the tokens are those of ``steps`` single steps. Returns the
    samples ``[steps, N1]`` (top logprobs ``[steps, N1, K]``), the cache, the counts and ``fed``.
    """
    if replicated is not None:
        packed = jax.lax.with_sharding_constraint(packed, replicated)
    flat, ints, floats = split_step(packed, shape)
    tokens, batch, _, _, feed, _ = unpack_step(flat, shape)
    tokens = jnp.where(feed >= 0, fed[jnp.maximum(feed, 0)], tokens)
    sampling, slots, weight, _ = unpack_rows(ints, floats)
    row_steps = ints[:, STEPS]
    view = batch.single
    pos0 = view.positions[:, 0]
    page_size, dropped = cache.page_size, cache.spare_page  # a write there leaves the pool untouched
    stop_ids = sampling.banned_ids  # [N1, MAX_BANNED], -1 padding

    def body(
        carry: tuple[Cache, jax.Array, jax.Array, jax.Array], i: jax.Array
    ) -> tuple[tuple[Cache, jax.Array, jax.Array, jax.Array], SampleOutput]:
        cache, counts, tokens, done = carry
        active = (i < row_steps) & ~done & (weight > 0)
        pos = pos0 + i
        write = jnp.take_along_axis(view.pages, (pos // page_size)[:, None], axis=1)[:, 0]
        step_batch = RaggedBatch(
            pos[None],
            jnp.full((1,), tokens.shape[0], jnp.int32),
            jnp.where(active, write, dropped)[None],  # an inactive row writes nothing
            AttentionView(view.idx, pos[:, None], jnp.where(active, pos + 1, 0), view.pages),
            batch.blocks,
            chunk_pages=shape.chunk_pages,
            adapters=batch.adapters,
            rope_offsets=batch.rope_offsets,
        )
        x, cache = _forward(shape, treedef, cache_sharding, outer, layers, cache, tokens, step_batch)
        hidden = x.rearrange((BATCH, POS, "embed")).array[0]
        params = dataclasses.replace(sampling, position=sampling.position + i)
        out = _sample_rows(mode, outer, hidden, params, slots, counts, prompt_mask, bitmask, i)
        counts = _replicate(counts.at[slots, out.tokens].add(weight * active), replicated)
        stopped = jnp.any((out.tokens[:, None] == stop_ids) & (stop_ids >= 0), axis=1)
        done = done | (active & stopped)
        return (cache, counts, jnp.where(active, out.tokens, tokens), done), out

    done = jnp.zeros(tokens.shape, bool)
    (cache, counts, last, _), outs = jax.lax.scan(body, (cache, counts, tokens, done), jnp.arange(steps))
    next_fed = jnp.zeros_like(fed).at[: last.shape[0]].set(last)
    # The state goes back in the shardings the next call was built for: left to XLA, the counts
    # follow the vocabulary-sharded logits (P(None, 'model') on a mesh) and every call after fails.
    counts, next_fed = _replicate(counts, replicated), _replicate(next_fed, replicated)
    return outs, constrain_cache(cache, cache_sharding), counts, next_fed


def _replicate(x: jax.Array, replicated: NamedSharding | None) -> jax.Array:
    """``x`` constrained to ``replicated`` (as it is, without a mesh)."""
    return x if replicated is None else jax.lax.with_sharding_constraint(x, replicated)


def _sample_rows(
    mode: str,
    outer: LlamaModel,
    last: jax.Array,
    sampling: SamplingArrays,
    slots: jax.Array,
    counts: jax.Array,
    prompt_mask: jax.Array,
    bitmask: jax.Array,
    iteration: int | jax.Array = 0,
) -> SampleOutput:
    """Inside the jit: rows' last hidden states ``last`` [N1, embed] through the final norm and the
    LM head, then the sampler in ``mode`` (``sampling_rows.HEAD_MODES``)."""
    logits = outer.logits(outer.norm(hax.named(last, (BATCH, "embed")))).array  # [N1, V]
    return sample(
        logits,
        sampling,
        counts,
        prompt_mask,
        num_top_logprobs=MAX_TOP_LOGPROBS,
        all_greedy=mode == "argmax",
        logprobs=mode != "argmax",
        processed=mode != "argmax",
        filtered=mode == "filter",
        slots=slots,
        bitmask=None if mode == "argmax" else bitmask,
        iteration=iteration,
    )


@jax.jit
def score_step(
    outer: LlamaModel, hidden: jax.Array, following: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Prompt scores of one step: the logprob of each flat token's following token (``following``
    [T], -1 where not scored) with the top K, and its rank (1 + the tokens more likely), from
    ``hidden`` [T, embed]."""
    logits = outer.logits(outer.norm(hax.named(hidden[None], (BATCH, POS, "embed")))).array[0]  # [T, V]
    targets = jnp.maximum(following, 0)
    chosen, top_ids, top_lps = token_logprobs(logits, targets, MAX_TOP_LOGPROBS)
    target_logit = jnp.take_along_axis(logits, targets[:, None], axis=-1)
    ranks = 1 + jnp.sum(logits > target_logit, axis=-1, dtype=jnp.int32)
    return chosen, top_ids, top_lps, ranks


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
    images: tuple[jax.Array, jax.Array, jax.Array] | None = None,
) -> tuple[hax.NamedArray, Cache]:
    """Inside the jit: the hidden states [1, T, embed] of the flat ``tokens`` [T] after every decoder
    layer, and the cache with their K/V written; ``images`` as ``forward_step``'s."""
    if isinstance(cache, KernelKVCache):  # the TPU kernel's per-sequence view of the rows, once per step
        batch = batch.with_kernel(kernel_meta(batch, shape.tokens))
    elif outer.attention_backend == "pallas_gpu":
        batch = batch.with_decode_kernel()
    elif outer.attention_backend == "pallas_gpu_ragged":
        batch = batch.with_ragged_kernel()
    x = outer.embed_tokens(tokens[None])  # one row of T tokens: [1, T, embed]
    if images is not None:  # image tokens take the vision tower's embeddings (after any embedding scale)
        embeds, ends, rope = images
        mask = ends > 0
        if outer.spec.mrope_section:  # image tokens at their rows and columns (M-RoPE)
            batch = batch.with_image_rope(rope)
        x = hax.named(jnp.where(mask[None, :, None], embeds[None].astype(x.dtype), x.array), x.axes)
        if outer.spec.bidirectional_images:  # each image token sees its image's last token (on the reference)
            batch = batch.with_visible(jnp.where(mask, ends - 1, batch.positions[0])[None].astype(jnp.int32))
    kinds = outer.spec.layer_kinds()
    for i, leaves in enumerate(layers):
        x, cache = _layer(outer.spec, kinds[i], treedef, leaves, x, batch, cache, cache_sharding, jnp.int32(i))
    return x, constrain_cache(cache, cache_sharding)


def _all_logits(outer: LlamaModel, x: hax.NamedArray) -> jax.Array:
    """Float32 logits [T, V] of every flat token of hidden states ``x`` [1, T, embed]."""
    return outer.logits(outer.norm(x)).array[0]


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


def lora_leaf_indices(model: LlamaModel) -> tuple[int, ...]:
    """Where a layer's LoRA stacks sit among its flattened leaves (``split_model``'s), in
    ``LoraLayer`` field order; empty when the layers hold none."""
    layer = model.layers[0]
    if layer.lora is None:
        return ()
    leaves = jax.tree_util.tree_leaves(layer)
    ids = {id(leaf): j for j, leaf in enumerate(leaves)}
    return tuple(ids[id(leaf)] for leaf in jax.tree_util.tree_leaves(layer.lora))


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
