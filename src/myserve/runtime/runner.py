"""ModelRunner: turns scheduler steps into device ops, and the ops' results into tokens.

A step runs padded batches of rows through the model (``runtime/steps.py``: jitted embedding,
decoder layers in groups, head), then the sampler draws one token per row on device. A scheduler
step becomes at most one decode call (all single-token rows, ``[B, 1]``) plus prefill calls of rows
of ``prefill_row_tokens`` tokens; every call's shape is a bucket from ``Buckets``, and ``warmup``
compiles all of them. With ``decode_steps`` > 1, a decode call the scheduler gave several steps
becomes a chain of calls in one dispatch: every call after the first takes its tokens from the
previous call's samples on the device (``ModelCall.chained``), and the host reads all of them at
once. The runner is host-only: it plans a step as ops (``runtime/executor.py``) and
hands them to its ``Device``, an ``Executor`` on this process's mesh or, on a multi-host mesh, one
that broadcasts them to the other processes first.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import jax
import numpy as np

from myserve.engine.scheduler import ScheduledBatch, ScheduledChunk
from myserve.engine.sequence import Sequence as Seq
from myserve.runtime.batch_layout import Entry, HostBatch, balance, grouped_batch, row_batch
from myserve.runtime.buckets import Buckets
from myserve.runtime.executor import (
    MAX_STOP_IDS,
    SLOT_CHUNK,
    CallOutput,
    ClearSlot,
    CopyPage,
    ModelCall,
    Op,
    WriteSlot,
    fetch,
)
from myserve.runtime.sampling_rows import (
    CHOICE,
    FLOAT_PARAMS,
    POSITION,
    SLOT,
    TOP_K,
    WEIGHT,
    SamplingRows,
)

logger = logging.getLogger(__name__)

_NO_TOP = np.zeros(0, np.int32)  # top logprobs of a row when no row of its call asked for them


class Device(Protocol):
    """Where a runner's ops run: ``Executor`` or a multi-host broadcaster in front of one."""

    def run(self, ops: Sequence[Op]) -> list[CallOutput]:
        """Apply ``ops`` in order; the outputs of the model calls among them."""
        ...


@dataclasses.dataclass
class PlannedStep:
    """A step's ops, and each model call's rows (None = padding) in the order of its calls."""

    ops: list[Op]
    rows: list[Sequence[_Row | None]]


@dataclasses.dataclass
class PendingStep:
    """A dispatched step: each model call's rows (None = padding) and its device outputs."""

    calls: list[tuple[Sequence[_Row | None], CallOutput]]


@dataclasses.dataclass
class StepResults:
    """What one step produced, per sequence."""

    sampled: dict[Seq, list[tuple[int, float, np.ndarray, np.ndarray]]] = dataclasses.field(default_factory=dict)
    """Sequences whose chunk ended their known tokens: (token, logprob, top ids, top logprobs) of
    each step they ran, in order (several for a multi-step decode; those after an EOS or stop are
    garbage the caller drops)."""
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
    steps: int = 1
    """Decode steps of the row in this dispatch (see ``ScheduledChunk.steps``)."""
    ahead: int = 0
    """Which of them this is: the row's tokens are ``ahead`` positions past the known ones."""

    def step(self, i: int) -> _Row | None:
        """The row in step ``i`` of a multi-step decode; None once its steps are done."""
        return dataclasses.replace(self, start=self.start + i, ahead=i) if i < self.steps else None

    @property
    def scored(self) -> bool:
        """Whether the row holds prompt positions whose next-token logprobs were asked for."""
        return self.seq.scores_prompt(self.start)


def _entry(row: _Row) -> Entry:
    # A later step of a multi-step decode: its token is sampled on the device (any id here).
    tokens = [0] if row.ahead else row.seq.tokens(row.start, row.start + row.num_tokens)
    return Entry(tokens, row.start, row.seq.pages)


def _wants_top(rows: Sequence[_Row | None]) -> bool:
    """Whether a row of a call samples a token whose top logprobs were asked for."""
    return any(r is not None and r.samples and bool(r.seq.params.logprobs) for r in rows)


def _wants_logprobs(rows: Sequence[_Row | None]) -> bool:
    """Whether a row of a call samples a token whose logprob was asked for (top entries or not)."""
    return any(r is not None and r.samples and r.seq.params.logprobs is not None for r in rows)


def _rows_of(chunk: ScheduledChunk, row_tokens: int) -> list[_Row]:
    """A chunk cut into rows of ``row_tokens`` tokens; only the last row may sample."""
    n = chunk.num_tokens
    return [
        _Row(chunk.seq, chunk.start + k, min(row_tokens, n - k), chunk.samples and k + row_tokens >= n)
        for k in range(0, n, row_tokens)
    ]


class ModelRunner:
    """Host side of the device work: bucketed call layouts, penalty-slot fills, ops, result reading."""

    def __init__(
        self,
        device: Device,
        *,
        buckets: Buckets,
        max_num_seqs: int,
        eos_ids: Sequence[int] = (),
        decode_steps: int = 1,
    ):
        self.device = device
        self.buckets = buckets
        self.page_size = buckets.page_size
        self.eos_ids = tuple(eos_ids)
        self.decode_steps = decode_steps
        self.scratch_slot = max_num_seqs
        """The penalty slot of rows without penalties (the executor has ``max_num_seqs + 1`` slots;
        the scheduler's ``SlotPool`` hands out the others)."""
        self.warmed_up = False

    # -- penalty slots ------------------------------------------------------------------------
    @staticmethod
    def _fill_slot(seq: Seq) -> list[Op]:
        """The ops filling a newly assigned penalty slot from the sequence's prompt and outputs."""
        assert seq.slot is not None
        ops: list[Op] = [ClearSlot(seq.slot)]
        for ids, to_prompt in ((seq.prompt_ids, True), (seq.output_ids, False)):
            for start in range(0, len(ids), SLOT_CHUNK):
                part = ids[start : start + SLOT_CHUNK]
                padded = np.zeros(SLOT_CHUNK, np.int32)
                padded[: len(part)] = part
                ops.append(WriteSlot(seq.slot, padded, len(part), to_prompt))
        return ops

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
            generated = len(seq.output_ids) + chunk.ahead
            packed.ints[i, CHOICE], packed.ints[i, POSITION] = seq.choice, generated
            packed.set_seed(i, seq.seed)
            if p.logit_bias:
                ids, values = zip(*p.logit_bias, strict=True)
                packed.set_bias(i, ids, values)
            if generated < p.min_tokens:
                packed.set_banned(i, (() if p.ignore_eos else self.eos_ids) + p.stop_token_ids)
            if p.uses_penalties:
                assert seq.slot is not None, "the scheduler gives a running penalty sequence its slot"
                packed.ints[i, SLOT] = seq.slot
        return packed

    def _call(
        self,
        chunks: Sequence[_Row | None],
        host: HostBatch,
        ops: list[Op],
        scored: bool = False,
        all_greedy: bool | None = None,
        chained: np.ndarray | None = None,
        logprobs_on: bool | None = None,
    ) -> None:
        """Append the ops of one call: ``chunks`` are its rows in order (None = padding), ``host`` their layout.

        ``all_greedy`` and ``logprobs_on`` pick the sampler executable; by default whether every row
        is greedy, and whether a sampled row asked for logprobs.
        ``chained``: a later step of a multi-step decode, with each row's stop ids (see ``ModelCall``).
        """
        rows = host.tokens.shape[0]
        following = None
        if scored:
            following = np.zeros(host.tokens.shape, np.int32)
            for i, c in enumerate(chunks):
                if c is not None:
                    nxt = c.seq.tokens(c.start + 1, c.start + c.num_tokens + 1)
                    following[i, : len(nxt)] = nxt
        # Prefill rows are sampled in the smallest batch bucket, so the sampler compiles per bucket.
        sample_rows = Buckets.fit(self.buckets.batch, rows) if rows <= self.buckets.batch[-1] else rows
        packed = self._sampling_rows(chunks, sample_rows)
        if all_greedy is None:
            all_greedy = all(c is None or c.seq.params.temperature <= 0 for c in chunks)
        if logprobs_on is None:
            logprobs_on = _wants_logprobs(chunks)
        flat, shapes = host.pack()
        ops.append(
            ModelCall(flat, shapes, packed.ints, packed.floats, all_greedy, logprobs_on, following, chained)
        )

    def _decode_layout(
        self, decodes: Sequence[_Row], rows: int, width: int | None = None
    ) -> tuple[list[_Row | None], Callable[[Sequence[_Row | None]], HostBatch]]:
        """The decode call's row order, and the layout of rows in that order: grouped (balanced
        groups) unless groups are of one row. Every step of a multi-step decode uses the same order
        and width, so a row's sampled token is at the same index in the next call.

        ``width`` forces the page width (warmup); by default the smallest bucket that fits.
        """
        bk, group, size = self.buckets, self.buckets.group_size(rows), self.page_size

        def entries(rs: Sequence[_Row | None]) -> list[Entry | None]:
            return [None if r is None else _entry(r) for r in rs]

        if group == 1:
            slots: list[_Row | None] = list(decodes)
            need = max((len(c.seq.pages) for c in decodes), default=1)
            w = width or Buckets.fit(bk.decode_widths(rows), need)
            return slots, lambda rs: row_batch(entries(rs), rows=rows, tokens_per_row=1, width=w, page_size=size)
        order, most = balance([len(c.seq.pages) for c in decodes], rows, group)
        slots = [None if i is None else decodes[i] for i in order]
        w = width or Buckets.fit(bk.decode_widths(rows), max(most, 1))
        return slots, lambda rs: grouped_batch(entries(rs), group=group, group_width=w, page_size=size)

    def _stop_ids(self, slots: Sequence[_Row | None]) -> np.ndarray:
        """[rows, MAX_STOP_IDS] int32 ids that end each row on the device (-1: none): its
        stop_token_ids, and EOS unless it ignores EOS."""
        stops = np.full((len(slots), MAX_STOP_IDS), -1, np.int32)
        for i, r in enumerate(slots):
            if r is not None:
                p = r.seq.params
                ids = (*p.stop_token_ids, *(() if p.ignore_eos else self.eos_ids))[:MAX_STOP_IDS]
                stops[i, : len(ids)] = ids
        return stops

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

    def plan(self, batch: ScheduledBatch) -> PlannedStep:
        """One scheduler step as ops: page copies, slot fills, then the model calls (host only)."""
        ops: list[Op] = [CopyPage(src, dst) for src, dst in batch.copies]
        for seq in batch.fill_slots:
            ops.extend(self._fill_slot(seq))
        calls: list[Sequence[_Row | None]] = []
        if batch.decodes:
            rows = Buckets.fit(self.buckets.batch, len(batch.decodes))
            decodes = [_Row(c.seq, c.start, 1, c.samples, c.steps) for c in batch.decodes]
            slots, layout = self._decode_layout(decodes, rows)
            self._call(slots, layout(slots), ops)
            calls.append(slots)
            steps = max(c.steps for c in batch.decodes)
            stops = self._stop_ids(slots) if steps > 1 else None
            for i in range(1, steps):
                rows_i = [None if r is None else r.step(i) for r in slots]
                self._call(rows_i, layout(rows_i), ops, chained=stops)
                calls.append(rows_i)
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
            self._call(rows_, host, ops, scored)
            calls.append(rows_)
        return PlannedStep(ops, calls)

    def dispatch(self, planned: PlannedStep) -> PendingStep:
        """Hand a planned step to the device (not awaited)."""
        return PendingStep(list(zip(planned.rows, self.device.run(planned.ops), strict=True)))

    def collect(self, pending: PendingStep) -> StepResults:
        """Wait for a dispatched step: sampled tokens, and prompt scores of rows that asked for them."""
        results = StepResults()
        for chunks, (out, scores) in pending.calls:
            # One transfer for the call's results; the top-20 arrays only when a row asked for them.
            tops = _wants_top(chunks)
            fetched = fetch([out.tokens, out.logprobs] + ([out.top_ids, out.top_logprobs] if tops else []))
            tokens, logprobs = fetched[0], fetched[1]
            for i, c in enumerate(chunks):
                if c is not None and c.samples:
                    top_ids, top_lps = (fetched[2][i], fetched[3][i]) if tops else (_NO_TOP, _NO_TOP)
                    sample = (int(tokens[i]), float(logprobs[i]), top_ids, top_lps)
                    results.sampled.setdefault(c.seq, []).append(sample)
            if scores is not None:
                lp, ids, tlp = fetch(scores)
                for i, c in enumerate(chunks):
                    if c is not None:
                        n = c.num_tokens
                        results.prompt_scores.append((c.seq, c.start, lp[i, :n], ids[i, :n], tlp[i, :n]))
        return results

    # -- warmup -------------------------------------------------------------------------------
    def warmup(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Compile every bucket shape (rows of padding only: the cache is not touched). The service
        counts what was compiled and what was loaded from the cache (``compile_counter``)."""
        shapes = self.buckets.shapes()
        sampled_rows: set[int] = set()  # row counts whose sampling (not greedy) executable is built
        chained_rows: set[int] = set()  # decode row counts whose multi-step chaining is built
        for i, (rows, t, width) in enumerate(shapes):
            ops: list[Op] = []
            if t == 1:
                host = self._decode_layout([], rows, width)[1]([None] * rows)
            else:
                host = row_batch([], rows=rows, tokens_per_row=t, width=width, page_size=self.page_size)
            # Each shape once greedy; the first of each row count also with the other sampler
            # executables (sampling, and each with logprobs).
            self._call([], host, ops, all_greedy=True, logprobs_on=False)
            if rows not in sampled_rows:
                sampled_rows.add(rows)
                for greedy, with_logprobs in ((True, True), (False, False), (False, True)):
                    self._call([], host, ops, all_greedy=greedy, logprobs_on=with_logprobs)
            if t == 1 and self.decode_steps > 1 and rows not in chained_rows:
                # The chaining of multi-step decodes depends on the row count only; twice, as the
                # second link takes the first link's outputs, not the upload's.
                chained_rows.add(rows)
                for _ in range(2):
                    self._call(
                        [], host, ops, all_greedy=True, chained=self._stop_ids([None] * rows), logprobs_on=False
                    )
            if t != 1 and width == self.buckets.pages[0]:
                # The scoring head (echo with logprobs) depends on (rows, tokens) only, not the width.
                self._call([], host, ops, scored=True, logprobs_on=False)
            jax.block_until_ready(self.device.run(ops))
            if progress is not None:
                progress(i + 1, len(shapes))
        # The page copy (page 0 onto itself) and the penalty-slot writers (on the scratch slot) too.
        zeros = np.zeros(SLOT_CHUNK, np.int32)
        slot = self.scratch_slot
        self.device.run([CopyPage(0, 0), ClearSlot(slot), WriteSlot(slot, zeros, 0, True)])
        self.warmed_up = True
