"""ModelRunner: owns the params, the paged KV cache and the penalty state on the mesh; runs steps.

A step runs a padded batch of rows through the model (``runtime/steps.py``: jitted embedding, one
jitted call per layer with the cache donated and updated in place, jitted head), then ``_sample``
draws one token per row on device. A scheduler step becomes
at most one decode call (all single-token rows, ``[B, 1]``) plus one call per prefill chunk
(``[1, T]``); every call's shape is a bucket from ``Buckets``, and ``warmup`` compiles all of them.

Penalty state: sequences that use presence/frequency/repetition penalties get a device *slot*
holding counts of their generated tokens and a mask of their prompt tokens, ``[slots, vocab]``.
Rows without penalties point at a scratch slot. The step adds each sampled token to its row's
counts, so the state never crosses back to the host.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from myserve.engine.params import MAX_TOP_LOGPROBS
from myserve.engine.scheduler import ScheduledBatch, ScheduledChunk
from myserve.engine.sequence import Sequence as Seq
from myserve.models.llama import LlamaModel
from myserve.ops.paged_attention import KVCache
from myserve.runtime.batch_layout import Entry, HostBatch, balance, grouped_batch, row_batch
from myserve.runtime.buckets import Buckets
from myserve.runtime.compile_counter import compile_count
from myserve.runtime.kv_cache import init_kv_cache
from myserve.runtime.sampler import SampleOutput, sample
from myserve.runtime.sampling_rows import (
    CHOICE,
    FLOAT_PARAMS,
    POSITION,
    SLOT,
    TOP_K,
    WEIGHT,
    SamplingRows,
    unpack,
)
from myserve.runtime.steps import LAYERS_PER_CALL, LayerGroups, forward_last_logits, forward_scored, outer_part

logger = logging.getLogger(__name__)

_NO_TOP = np.zeros(0, np.int32)  # top logprobs of a row when no row of its call asked for them
_SLOT_CHUNK = 256  # token ids written into a penalty slot per call


@functools.partial(jax.jit, donate_argnums=1, static_argnums=5)
def _sample(
    logits: jax.Array, counts: jax.Array, prompt_mask: jax.Array, ints: jax.Array, floats: jax.Array, all_greedy: bool
) -> tuple[SampleOutput, jax.Array]:
    """Sample one token per row of ``logits`` [B, V] and count it in the row's penalty slot.

    A separate executable from the model step so it is compiled per batch size only, not per
    (batch, tokens, pages) shape: the sampler costs more to compile than the model.
    ``counts`` [slots, V] int32 and ``prompt_mask`` [slots, V] bool hold penalty state; ``ints`` and
    ``floats`` are the rows' packed ``SamplingRows`` (parameters, penalty slot, whether the sampled
    token is really appended). ``all_greedy``: the host knows no row samples (two executables per
    row count, both compiled at warmup).
    """
    sampling, slots, sampled_weight = unpack(ints, floats)
    out = sample(
        logits, sampling, counts[slots], prompt_mask[slots], num_top_logprobs=MAX_TOP_LOGPROBS, all_greedy=all_greedy
    )
    return out, counts.at[slots, out.tokens].add(sampled_weight)


@functools.partial(jax.jit, donate_argnums=0)
def _copy_page(kv_cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    """Copy one page's K/V in every layer and head (copy-on-write for shared prompts)."""
    return KVCache(
        kv_cache.k.at[:, :, dst].set(kv_cache.k[:, :, src]), kv_cache.v.at[:, :, dst].set(kv_cache.v[:, :, src])
    )


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _write_slot(
    counts: jax.Array, prompt_mask: jax.Array, slot: jax.Array, ids: jax.Array, n: jax.Array, to_prompt: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Record ``ids[:n]`` in a penalty slot: into its prompt mask, or counted as generated tokens."""
    valid = jnp.arange(ids.shape[0]) < n
    prompt_mask = prompt_mask.at[slot, ids].max(valid & to_prompt)
    counts = counts.at[slot, ids].add((valid & ~to_prompt).astype(counts.dtype))
    return counts, prompt_mask


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _clear_slot(counts: jax.Array, prompt_mask: jax.Array, slot: jax.Array) -> tuple[jax.Array, jax.Array]:
    return counts.at[slot].set(0), prompt_mask.at[slot].set(False)


@dataclasses.dataclass
class StepResults:
    """What one step produced, per sequence."""

    sampled: dict[Seq, tuple[int, float, np.ndarray, np.ndarray]] = dataclasses.field(default_factory=dict)
    """Sequences whose chunk ended their known tokens: (token, logprob, top ids, top logprobs)."""
    prompt_scores: list[tuple[Seq, int, np.ndarray, np.ndarray, np.ndarray]] = dataclasses.field(default_factory=list)
    """Scored prompt rows: (sequence, start, logprob of each position's next token [n], top ids, top logprobs)."""


@dataclasses.dataclass(frozen=True)
class _Row:
    """One row of a model call: ``num_tokens`` tokens of ``seq`` from ``start``."""

    seq: Seq
    start: int
    num_tokens: int
    samples: bool
    """The row ends its chunk and the chunk ends the sequence's known tokens: its logits give a token."""

    @property
    def scored(self) -> bool:
        """Whether the row holds prompt positions whose next-token logprobs were asked for."""
        return self.seq.params.prompt_logprobs is not None and self.start < len(self.seq.prompt_ids) - 1


def _entry(row: _Row) -> Entry:
    return Entry(row.seq.tokens(row.start, row.start + row.num_tokens), row.start, row.seq.pages)


def _rows_of(chunk: ScheduledChunk, row_tokens: int) -> list[_Row]:
    """A chunk cut into rows of ``row_tokens`` tokens; only the last row may sample."""
    n = chunk.num_tokens
    return [
        _Row(chunk.seq, chunk.start + k, min(row_tokens, n - k), chunk.samples and k + row_tokens >= n)
        for k in range(0, n, row_tokens)
    ]


class ModelRunner:
    """Device side of the engine: params, KV cache, penalty slots, bucketed jitted steps."""

    def __init__(
        self,
        model: LlamaModel,
        mesh: Mesh,
        mapping,
        *,
        num_pages: int,
        buckets: Buckets,
        max_num_seqs: int,
        eos_ids: Sequence[int] = (),
        layers_per_call: int = LAYERS_PER_CALL,
    ):
        self.model = model
        self.outer = outer_part(model)
        self.groups = LayerGroups.of(model, layers_per_call)
        self.spec = model.spec
        self.buckets = buckets
        self.page_size = buckets.page_size
        self.eos_ids = tuple(eos_ids)
        dtype = model.embed.array.dtype
        self.kv_cache = init_kv_cache(self.spec, num_pages, self.page_size, dtype, mesh, mapping)
        vocab = self.spec.vocab_size
        self.scratch_slot = max_num_seqs
        self.counts = jnp.zeros((max_num_seqs + 1, vocab), jnp.int32)
        self.prompt_mask = jnp.zeros((max_num_seqs + 1, vocab), jnp.bool_)
        self._free_slots = list(range(max_num_seqs))
        self.warmed_up = False

    # -- penalty slots ------------------------------------------------------------------------
    def _assign_slot(self, seq: Seq) -> None:
        """Give a penalty-using sequence a slot filled from its prompt and generated tokens."""
        slot = self._free_slots.pop()
        seq.slot = slot
        self.counts, self.prompt_mask = _clear_slot(self.counts, self.prompt_mask, jnp.int32(slot))
        for ids, to_prompt in ((seq.prompt_ids, True), (seq.output_ids, False)):
            for start in range(0, len(ids), _SLOT_CHUNK):
                part = ids[start : start + _SLOT_CHUNK]
                padded = np.zeros(_SLOT_CHUNK, np.int32)
                padded[: len(part)] = part
                self.counts, self.prompt_mask = _write_slot(
                    self.counts, self.prompt_mask, jnp.int32(slot), padded, jnp.int32(len(part)), jnp.bool_(to_prompt)
                )

    def release(self, seq: Seq) -> None:
        """Free a finished or preempted sequence's penalty slot."""
        if seq.slot is not None:
            self._free_slots.append(seq.slot)
            seq.slot = None

    # -- steps --------------------------------------------------------------------------------
    def _sampling_rows(self, chunks: Sequence[_Row | None], rows: int) -> SamplingRows:
        """The packed sampling rows of a call: row ``i`` samples for ``chunks[i]`` (None = padding)."""
        packed = SamplingRows.empty(rows, self.scratch_slot)
        for i, chunk in enumerate(chunks):
            if chunk is None:
                continue
            seq, p = chunk.seq, chunk.seq.params
            packed.floats[i, : len(FLOAT_PARAMS)] = [getattr(p, name) for name in FLOAT_PARAMS]
            packed.ints[i, TOP_K], packed.ints[i, WEIGHT] = p.top_k, int(chunk.samples)
            packed.ints[i, CHOICE], packed.ints[i, POSITION] = seq.choice, len(seq.output_ids)
            packed.set_seed(i, seq.seed)
            if p.logit_bias:
                ids, values = zip(*p.logit_bias, strict=True)
                packed.set_bias(i, ids, values)
            if len(seq.output_ids) < p.min_tokens:
                packed.set_banned(i, (() if p.ignore_eos else self.eos_ids) + p.stop_token_ids)
            if p.uses_penalties:
                if seq.slot is None:
                    self._assign_slot(seq)
                assert seq.slot is not None
                packed.ints[i, SLOT] = seq.slot
        return packed

    def _dispatch(
        self, chunks: Sequence[_Row | None], host: HostBatch, scored: bool = False, all_greedy: bool | None = None
    ) -> tuple[SampleOutput, tuple | None]:
        """Run one call: ``chunks`` are its rows in order (None = padding), ``host`` their layout.

        ``all_greedy`` picks the sampler executable; by default whether every row is greedy.
        """
        rows = host.tokens.shape[0]
        tokens, batch = host.device()
        scores = None
        if scored:
            following = np.zeros(host.tokens.shape, np.int32)
            for i, c in enumerate(chunks):
                if c is not None:
                    nxt = c.seq.tokens(c.start + 1, c.start + c.num_tokens + 1)
                    following[i, : len(nxt)] = nxt
            logits, scores, self.kv_cache = forward_scored(
                self.model, tokens, batch, self.kv_cache, following, MAX_TOP_LOGPROBS, self.outer, self.groups
            )
        else:
            logits, self.kv_cache = forward_last_logits(
                self.model, tokens, batch, self.kv_cache, self.outer, self.groups
            )
        # Prefill rows are sampled in the smallest batch bucket, so the sampler compiles per bucket.
        sample_rows = Buckets.fit(self.buckets.batch, rows) if rows <= self.buckets.batch[-1] else rows
        if sample_rows != rows:
            logits = jnp.pad(logits, ((0, sample_rows - rows), (0, 0)))
        packed = self._sampling_rows(chunks, sample_rows)
        if all_greedy is None:
            all_greedy = all(c is None or c.seq.params.temperature <= 0 for c in chunks)
        out, self.counts = _sample(logits, self.counts, self.prompt_mask, packed.ints, packed.floats, all_greedy)
        return out, scores

    def _decode_layout(
        self, decodes: Sequence[_Row], rows: int, width: int | None = None
    ) -> tuple[list[_Row | None], HostBatch]:
        """The decode call's rows and layout: grouped (balanced groups) unless groups are of one row.

        ``width`` forces the page width (warmup); by default the smallest bucket that fits.
        """
        bk, group = self.buckets, self.buckets.group_size(rows)
        if group == 1:
            slots: list[_Row | None] = list(decodes)
            need = max((len(c.seq.pages) for c in decodes), default=1)
            width = width or Buckets.fit(bk.decode_widths(rows), need)
            rows_entries = [_entry(c) for c in decodes]
            return slots, row_batch(rows_entries, rows=rows, tokens_per_row=1, width=width, page_size=self.page_size)
        order, most = balance([len(c.seq.pages) for c in decodes], rows, group)
        slots = [None if i is None else decodes[i] for i in order]
        width = width or Buckets.fit(bk.decode_widths(rows), max(most, 1))
        entries = [None if c is None else _entry(c) for c in slots]
        return slots, grouped_batch(entries, group=group, group_width=width, page_size=self.page_size)

    def _prefill_calls(self, prefills: Sequence[ScheduledChunk]) -> list[tuple[list[_Row], int, bool]]:
        """The step's prefill chunks as rows, grouped into calls: (rows, page-table width, scored).

        Rows are grouped by page-table bucket (a short prompt never pays for a long one's pages)
        and by whether they are scored (echo with logprobs), then packed up to the largest row bucket.
        """
        groups: dict[tuple[int, bool], list[_Row]] = {}
        for chunk in prefills:
            width = Buckets.fit(self.buckets.pages, len(chunk.seq.pages))
            for row in _rows_of(chunk, self.buckets.row_tokens):
                groups.setdefault((width, row.scored), []).append(row)
        most = self.buckets.prefill_rows[-1]
        return [
            (rows[i : i + most], width, scored)
            for (width, scored), rows in sorted(groups.items(), key=lambda g: g[0])
            for i in range(0, len(rows), most)
        ]

    def execute(self, batch: ScheduledBatch) -> StepResults:
        """Run one scheduler step: sampled tokens, and prompt scores of rows that asked for them."""
        for src, dst in batch.copies:
            self.kv_cache = _copy_page(self.kv_cache, jnp.int32(src), jnp.int32(dst))
        calls: list[tuple[Sequence[_Row | None], tuple[SampleOutput, tuple | None]]] = []
        if batch.decodes:
            rows = Buckets.fit(self.buckets.batch, len(batch.decodes))
            slots, host = self._decode_layout([_Row(c.seq, c.start, 1, c.samples) for c in batch.decodes], rows)
            calls.append((slots, self._dispatch(slots, host)))
        # Prefill rows run after the decodes, in chunk order: a later row of a chunk reads the K/V
        # its earlier rows wrote in the same call or an earlier one.
        for rows_, width, scored in self._prefill_calls(batch.prefills):
            n = Buckets.fit(self.buckets.prefill_rows, len(rows_))
            host = row_batch(
                [_entry(r) for r in rows_],
                rows=n,
                tokens_per_row=self.buckets.row_tokens,
                width=width,
                page_size=self.page_size,
            )
            calls.append((rows_, self._dispatch(rows_, host, scored)))
        # Every call is dispatched before any result is read, so device work queues back to back.
        results = StepResults()
        for chunks, (out, scores) in calls:
            # One transfer for the call's results; the top-20 arrays only when a row asked for them.
            tops = any(c is not None and c.samples and c.seq.params.logprobs for c in chunks)
            fetched = jax.device_get((out.tokens, out.logprobs) + ((out.top_ids, out.top_logprobs) if tops else ()))
            tokens, logprobs = fetched[0], fetched[1]
            for i, c in enumerate(chunks):
                if c is not None and c.samples:
                    top_ids, top_lps = (fetched[2][i], fetched[3][i]) if tops else (_NO_TOP, _NO_TOP)
                    results.sampled[c.seq] = (int(tokens[i]), float(logprobs[i]), top_ids, top_lps)
            if scores is not None:
                lp, ids, tlp = (np.asarray(a) for a in scores)
                for i, c in enumerate(chunks):
                    if c is not None:
                        n = c.num_tokens
                        results.prompt_scores.append((c.seq, c.start, lp[i, :n], ids[i, :n], tlp[i, :n]))
        return results

    # -- warmup -------------------------------------------------------------------------------
    def warmup(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Compile every bucket shape (rows of padding only: the cache is not touched); returns compiles."""
        before = compile_count()
        shapes = self.buckets.shapes()
        sampled_rows: set[int] = set()  # row counts whose sampling (not greedy) executable is built
        for i, (rows, t, width) in enumerate(shapes):
            # Each shape once greedy; the first of each row count also with the sampling executable.
            modes = (True,) if rows in sampled_rows else (True, False)
            sampled_rows.add(rows)
            if t == 1:
                host = self._decode_layout([], rows, width)[1]
            else:
                host = row_batch([], rows=rows, tokens_per_row=t, width=width, page_size=self.page_size)
            for all_greedy in modes:
                jax.block_until_ready(self._dispatch([], host, all_greedy=all_greedy))
            if t != 1 and width == self.buckets.pages[0]:
                # The scoring head (echo with logprobs) depends on (rows, tokens) only, not the width.
                jax.block_until_ready(self._dispatch([], host, scored=True))
            if progress is not None:
                progress(i + 1, len(shapes))
        # The page copy (page 0 onto itself) and the penalty-slot writers (on the scratch slot) too.
        self.kv_cache = _copy_page(self.kv_cache, jnp.int32(0), jnp.int32(0))
        self.counts, self.prompt_mask = _clear_slot(self.counts, self.prompt_mask, jnp.int32(self.scratch_slot))
        zeros = np.zeros(_SLOT_CHUNK, np.int32)
        self.counts, self.prompt_mask = _write_slot(
            self.counts, self.prompt_mask, jnp.int32(self.scratch_slot), zeros, jnp.int32(0), jnp.bool_(True)
        )
        jax.block_until_ready(self.counts)
        self.warmed_up = True
        return compile_count() - before
