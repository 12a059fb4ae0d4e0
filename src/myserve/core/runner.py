"""ModelRunner: turns scheduler steps into device ops, and the ops' results into tokens.

A scheduler step becomes one ``StepCall``: every chunk of the step (decode tokens and prefill
chunks alike) is a ``Span`` of the flat token batch (``runtime/step_layout.py``), run by the
executable of the smallest token bucket that holds them (``runtime/model_step.py``), sampler
included. Before it come the step's page copies and penalty-slot fills, when it has any. The
runner is host-only and imports no JAX: it plans a step as the runtime's plain-data ops
(``runtime/step_ops.py``) and hands them to its ``Device`` (``runtime/device.py``): an ``Executor``
on this process's mesh, one that broadcasts them to the other processes of a multi-host mesh first,
or the scripted fake of the core's tests.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from myserve.core.decode_pacing import DecodePacer
from myserve.core.host_tier import host_tier_ops
from myserve.core.images import images_in, rope_offset, with_step_images
from myserve.core.prime_order import prime_order, unit_width
from myserve.core.scheduler import ScheduledBatch, ScheduledChunk
from myserve.core.sequence import Sequence as Seq
from myserve.grammar import allocate_bitmask, fill_bitmask
from myserve.runtime.buckets import Buckets
from myserve.runtime.device import Device
from myserve.runtime.sampling_rows import CONSTRAINED, MAX_TOP_LOGPROBS, SLOT, STEPS, SamplingRows, head_mode
from myserve.runtime.step_layout import HostStep, Span, StepShape, layout
from myserve.runtime.step_ops import (
    SLOT_CHUNK,
    ClearSlot,
    CompileSteps,
    CopyPage,
    Op,
    PrimeSteps,
    StepCall,
    WriteAdapter,
    WriteSlot,
)
from myserve.wire import params as wire_params

logger = logging.getLogger(__name__)

# A request may ask for as many top logprobs as the API allows; the step must return that many.
assert wire_params.MAX_TOP_LOGPROBS <= MAX_TOP_LOGPROBS

_NO_TOP = np.zeros(0, np.int32)  # top logprobs of a row when no row of its step asked for them


@dataclasses.dataclass
class PlannedStep:
    """A step's ops and where each chunk's tokens and sample are in its layout; once dispatched,
    the device's output handles too."""

    runner: ModelRunner
    """The runner that planned it (and dispatches and reads it)."""
    ops: list[Op]
    chunks: list[tuple[ScheduledChunk, int, int | None]]
    """(chunk, offset of its first token in the flat batch, its sampling row or None)."""
    scored: bool
    """Some chunk scores prompt positions: the prompt scores are read back."""
    tops: bool
    """Some sampling row asked for top logprobs: they are read back."""
    pooled: bool = False
    """Some chunk pools (an embedding request): the pooled rows are read back."""
    steps: int = 0
    """0: a forward and head step; K >= 1: a decode call of K iterations, whose samples are ``[K, N1]``."""
    outputs: list[Any] = dataclasses.field(default_factory=list)
    """The device's output handles once dispatched (one: the step call's)."""
    decode_iterations: int = 0
    """Model iterations of a decode-only step (K, or 1), timed by ``DecodePacer``; 0 for any other."""
    dispatched_at: float = 0.0
    """``time.perf_counter()`` at dispatch."""


Sample = tuple[int, float, np.ndarray, np.ndarray]
"""One sampled token: (token, logprob, top ids, top logprobs)."""


@dataclasses.dataclass
class StepResults:
    """What one step produced, per sequence."""

    sampled: dict[Seq, list[Sample]] = dataclasses.field(default_factory=dict)
    """Sequences whose chunk ended their known tokens: their samples, in order."""
    prompt_scores: list[tuple[Seq, int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = dataclasses.field(
        default_factory=list
    )
    """Scored prompt chunks: (sequence, start, logprob of each position's next token [n], top ids, top logprobs)."""
    spent: dict[Seq, int] = dataclasses.field(default_factory=dict)
    """Tokens in flight a sequence's samples account for, where not one per sample (a speculating
    decode: one, whatever the draft gave)."""
    pooled: list[tuple[Seq, int, int, np.ndarray | None]] = dataclasses.field(default_factory=list)
    """Chunks of embedding requests: (sequence, start, tokens, summed hidden states of its pooled
    tokens [embed], or None when none of its tokens pools)."""


def _tops(read: Any, tops: bool, i: int, row: int) -> tuple[np.ndarray, np.ndarray]:
    """Iteration ``i``'s top logprobs of ``row`` in a several-token call's read (none unless asked)."""
    if not tops:
        return _NO_TOP, _NO_TOP
    return read.top_ids[i, row], read.top_logprobs[i, row]


def shape_built(device: Device, seen: set[StepShape], shape: StepShape, steps: int = 0) -> bool:
    """Whether a step may run in ``shape`` on ``device``: its forward is built, or with ``steps`` >= 1
    its decode calls of that many tokens (those of a narrower context bucket, and every decode call,
    are built in the background after ready; until then the step takes a wider one, or a forward
    and head). ``seen`` remembers the shapes found built."""
    if shape in seen:
        return True
    if device.step_ready(shape) if steps == 0 else device.loop_ready(shape, steps):
        seen.add(shape)
        return True
    return False


def span_of(chunk: ScheduledChunk, inflight_rows: dict[Seq, int]) -> Span:
    """A scheduled chunk as a span of the flat batch. Its last token may still be in flight (a
    decode planned while the step sampling its token runs): the device feeds it from that step's
    sampling row, ``inflight_rows[seq]``."""
    seq, start, n = chunk.seq, chunk.start, chunk.num_tokens
    adapter = -1 if seq.adapter_slot is None else seq.adapter_slot
    if chunk.draft:  # its known last token, then the draft: every position samples
        tokens = [*seq.tokens(start, start + 1), *chunk.draft]
        return Span(tokens, start, seq.pages, True, adapter=adapter, sample_count=chunk.sample_count)
    tokens = seq.tokens(start, start + n)
    feed = -1
    if len(tokens) < n:
        # (A several-token call may have more in flight, but their positions were computed by it.)
        assert len(tokens) == n - 1 and seq.num_inflight >= 1, "only the span's last token can be in flight"
        tokens, feed = [*tokens, 0], inflight_rows[seq]
    following = seq.tokens(start + 1, start + n + 1) if seq.scores_prompt(start) else None
    pool = seq.pool_range(start, n) if seq.pool_type is not None else None
    rope = rope_offset(seq.images, start) if seq.images else 0
    return Span(tokens, start, seq.pages, chunk.samples, following, feed, pool, adapter, rope_offset=rope)


class ModelRunner:
    """Host side of the device work: step layouts, penalty-slot fills, ops, result reading."""

    def __init__(
        self,
        device: Device,
        *,
        buckets: Buckets,
        max_num_seqs: int,
        eos_ids: Sequence[int] = (),
        decode_steps: int = 1,
        adapter_zeros: tuple[np.ndarray, ...] = (),
        decode_call_budget_s: float = 0.0,
        images: bool = False,
    ):
        """``decode_steps``: tokens per decode call (K: a decode-only step is one ``decode_loop`` call
        of K iterations once those are built, where ``pacer`` expects it to take at most
        ``decode_call_budget_s``, 0: always);
        ``adapter_zeros``: an empty adapter's arrays (``LoraAdapter.flat()`` shapes) when the model
        has LoRA slots, written at warmup so the slot writer is built then; ``images``: the model takes
        images (its forwards with image embeddings are built at warmup)."""
        self.images = images
        self.adapter_zeros = adapter_zeros
        self.device = device
        self.decode_steps = decode_steps
        self.pacer = DecodePacer(decode_call_budget_s)  # times decode-only calls: is a K-token one short enough
        self._usable: set[StepShape] = set()  # forwards of narrower context buckets seen built
        self._loops_usable: set[StepShape] = set()  # decode calls seen built
        self._loop_pages = 0  # the widest context bucket whose decode calls are all built (0: none)
        self._all_built = False  # every background build done: no narrower forward left to want
        self._to_prime: list[list[PrimeSteps]] = []
        """Executables to run once while the engine is idle (``prime_next``): those built before
        ready, then those built in the background."""
        self.buckets = buckets
        self.page_size = buckets.page_size
        self.eos_ids = tuple(eos_ids)
        self.scratch_slot = max_num_seqs
        """The penalty slot of rows without penalties (the executor has ``max_num_seqs + 1`` slots;
        the scheduler's ``SlotPool`` hands out the others)."""
        self.warmed_up = False
        self._inflight_rows: dict[Seq, int] = {}
        """Sampling row of each sequence in the last planned step (whose tokens may be in flight)."""
        self.spec_drafts = self.spec_draft_tokens = self.spec_accepted = 0
        """Speculating decodes verified, their draft tokens, and the draft tokens that held."""
        self.spec_accepted_per_pos: list[int] = []
        """Draft tokens that held, by position in the draft (vLLM's per-position counter)."""

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
    def _sampling_rows(self, chunks: Sequence[ScheduledChunk], rows: int, several: bool = False) -> SamplingRows:
        """The packed sampling rows of a step: ``chunks[i]``'s rows in order (one, or one per position
        of a speculating decode, each at its own output position). ``several``: a several-token
        decode call, whose rows carry their token counts and their EOS and stop ids (where the device
        stops them; banned only under ``min_tokens``)."""
        packed = SamplingRows.empty(rows, self.scratch_slot)
        expanded = [(chunk, j) for chunk in chunks for j in range(chunk.sample_count)]
        seqs = [chunk.seq for chunk, _ in expanded]
        # The token in flight is generated; a draft's position j samples output token j after.
        generated = [len(c.seq.output_ids) + c.seq.num_inflight + j for c, j in expanded]
        params = [seq.params for seq in seqs]
        packed.set_leading(params, [seq.seed for seq in seqs], [seq.choice for seq in seqs], generated)
        for i, (seq, p, done) in enumerate(zip(seqs, params, generated, strict=True)):
            if p.logit_bias:
                ids, values = zip(*p.logit_bias, strict=True)
                packed.set_bias(i, ids, values)
            stops = (() if p.ignore_eos else self.eos_ids) + p.stop_token_ids
            if several:
                packed.ints[i, STEPS] = expanded[i][0].steps
                if stops:
                    packed.set_banned(i, stops, steps=max(0, p.min_tokens - done))
            elif done < p.min_tokens:
                packed.set_banned(i, stops)
            if p.uses_penalties:
                assert seq.slot is not None, "the scheduler gives a running penalty sequence its slot"
                packed.ints[i, SLOT] = seq.slot
        return packed

    def plan(self, batch: ScheduledBatch) -> PlannedStep:
        """One scheduler step as ops: the host tier's saves and loads, page copies, slot fills, then
        the step call (host only)."""
        ops: list[Op] = host_tier_ops(batch.saves, batch.loads)
        ops += [WriteAdapter(slot, adapter.flat()) for slot, adapter in batch.adapter_writes]
        ops += [CopyPage(src, dst) for src, dst in batch.copies]
        for seq in batch.fill_slots:
            ops.extend(self._fill_slot(seq))
        chunks = [*batch.decodes, *batch.prefills]
        spans = [span_of(c, self._inflight_rows) for c in chunks]
        several = max((c.steps for c in chunks), default=1) > 1
        with_images = images_in(chunks, spans)  # prefill chunks: never in a step of several-token decodes
        shape: StepShape | None = None
        if not with_images and (several or (self.decode_steps == 1 and self._decodes_only(batch))):
            # One call for the step: one-token rows only, each decoding its own count of tokens
            # (K = 1: the forward, head and sampler fused). A step of K > 1 whose rows all decode
            # one token takes a forward and head instead: a K-token call would run K - 1 idle
            # iterations of the whole model.
            shape = self.buckets.fit_decode(spans, self._loop_built)
            assert shape is not None or not several, "the scheduler sizes several-token decodes to fit a call"
        usable = self._built if not with_images else _widest  # (image forwards: built at the widest only)
        steps, shape = (0, self.buckets.fit(spans, usable)) if shape is None else (self.decode_steps, shape)
        if steps == 0 and not with_images and not self._all_built:
            self._want_narrowest(spans, shape)
        host = layout(spans, shape, self.page_size)
        # This step's sampling rows: the next step's spans feed on them while this one is in flight.
        self._inflight_rows = {c.seq: row for c, row in zip(chunks, host.sample_rows, strict=True) if row is not None}
        sampling = [c for c in chunks if c.samples]
        ops.append(with_step_images(self._step_call(host, shape, sampling, steps, batch.weights), with_images))
        offsets = np.cumsum([0, *(c.num_tokens for c in chunks)])
        placed = [(c, int(at), row) for c, at, row in zip(chunks, offsets, host.sample_rows, strict=False)]
        tops = any(bool(c.seq.params.logprobs) for c in sampling)
        timed = steps or int(self._decodes_only(batch))  # (decode-only steps are timed: ``DecodePacer``)
        return PlannedStep(self, ops, placed, host.scored, tops, host.pooled, steps=steps, decode_iterations=timed)

    @staticmethod
    def _decodes_only(batch: ScheduledBatch) -> bool:
        """Whether ``batch`` is one-token decodes alone (no prefill chunk, draft or pooling row): a
        step a decode call (``decode_loop``) can run."""
        return bool(batch.decodes) and not batch.prefills and all(c.seq.pool_type is None for c in batch.decodes)

    def _step_call(
        self, host: HostStep, shape: StepShape, sampling: Sequence[ScheduledChunk], steps: int = 0, weights: int = 0
    ) -> StepCall:
        packed = self._sampling_rows(sampling, shape.singles, several=steps > 0)
        row_seqs = [c.seq for c in sampling for _ in range(c.sample_count)]
        masked = [(seq, i) for i, seq in enumerate(row_seqs) if seq.matcher or seq.token_filter]
        bitmask = rows = None
        if masked:  # each masked row's next-token mask: its grammar state, then its token filter
            rows = np.array([i for _, i in masked], np.int32)
            first = masked[0][0].matcher or masked[0][0].token_filter
            assert first is not None
            bitmask = allocate_bitmask(len(masked), first.vocab_size)
            fill_bitmask([(s.matcher, k) for k, (s, _) in enumerate(masked) if s.matcher is not None], bitmask)
            for k, (s, _) in enumerate(masked):
                if s.token_filter is not None:
                    s.token_filter.apply(bitmask[k], s.output_ids)
            packed.ints[rows, CONSTRAINED] = 1
        mode = head_mode(packed.ints, packed.floats, len(row_seqs))
        return StepCall(
            host.pack(), shape, packed.ints, packed.floats, bitmask, rows, mode, host.scored, steps, weights
        )

    def dispatch(self, planned: PlannedStep) -> PlannedStep:
        """Hand a planned step to the device (not awaited)."""
        planned.outputs = self.device.run(planned.ops)
        planned.dispatched_at = time.perf_counter()
        return planned

    def collect(self, planned: PlannedStep) -> StepResults:
        """Wait for a dispatched step: sampled tokens, and prompt scores of chunks that asked for them."""
        (out,) = planned.outputs
        read = self.device.read(out, tops=planned.tops, scored=planned.scored, pooled=planned.pooled)  # one transfer
        self.pacer.observe(planned)
        results = StepResults()
        # Python numbers once for every row: indexing numpy arrays per row and token is slower.
        tokens, logprobs = read.tokens.tolist(), read.logprobs.tolist()
        for i, (chunk, at, row) in enumerate(planned.chunks):
            seq = chunk.seq
            if seq.pool_type is not None:  # (a chunk that pools no token still reports: it may end the prompt)
                pooled = seq.pool_range(chunk.start, chunk.num_tokens) is not None
                vector = read.pooled[i] if pooled and read.pooled is not None else None
                results.pooled.append((seq, chunk.start, chunk.num_tokens, vector))
            if row is not None and planned.steps:  # [K, N1]: this row's first chunk.steps tokens
                results.sampled[seq] = [
                    (tokens[i][row], logprobs[i][row], *_tops(read, planned.tops, i, row)) for i in range(chunk.steps)
                ]
            elif row is not None and chunk.draft:
                self._verify(chunk, read, row, planned.tops, results)
            elif row is not None:
                results.sampled[chunk.seq] = [(tokens[row], logprobs[row], *self._row_tops(read, planned.tops, row))]
            if planned.scored and chunk.seq.scores_prompt(chunk.start):
                assert read.scores is not None
                lp, ids, tlp, ranks = read.scores
                n = chunk.num_tokens
                results.prompt_scores.append(
                    (chunk.seq, chunk.start, lp[at : at + n], ids[at : at + n], tlp[at : at + n], ranks[at : at + n])
                )
        return results

    def _verify(self, chunk: ScheduledChunk, read: Any, row: int, tops: bool, results: StepResults) -> None:
        """A speculating decode's samples, one per position from ``row``: position j's sample is the
        token after draft token j-1, so the draft holds while each sample equals the next draft
        token; the samples up to the first that differs (or the one after the whole draft) are the
        new tokens, exactly those plain decodes would have sampled (the same rows, seeds and
        positions). The sequence's computed tokens end where the draft stopped holding."""
        seq, draft = chunk.seq, chunk.draft
        got = [int(t) for t in read.tokens[row : row + 1 + len(draft)]]
        held = next((j for j, d in enumerate(draft) if got[j] != d), len(draft))
        results.sampled[seq] = [
            (got[j], float(read.logprobs[row + j]), *self._row_tops(read, tops, row + j)) for j in range(held + 1)
        ]
        results.spent[seq] = 1  # the scheduler counted one token in flight
        seq.num_computed = chunk.start + held + 1
        seq.keep_draft(held)
        seq.speculating = False
        self.spec_drafts += 1
        self.spec_draft_tokens += len(draft)
        self.spec_accepted += held
        if len(self.spec_accepted_per_pos) < len(draft):
            self.spec_accepted_per_pos += [0] * (len(draft) - len(self.spec_accepted_per_pos))
        for j in range(held):
            self.spec_accepted_per_pos[j] += 1

    @staticmethod
    def _row_tops(read: Any, tops: bool, row: int) -> tuple[np.ndarray, np.ndarray]:
        return (read.top_ids[row], read.top_logprobs[row]) if tops else (_NO_TOP, _NO_TOP)

    def _built(self, shape: StepShape) -> bool:
        return shape_built(self.device, self._usable, shape)

    def _want_narrowest(self, spans: list[Span], shape: StepShape) -> None:
        """A step ran wider than it fits (its narrowest forward still queued): want that one next."""
        best = self.buckets.fit(spans)
        if best != shape:
            self.device.want_step(best)
        elif self.device.background_builds_done(0):
            self._all_built = True

    def _loop_built(self, shape: StepShape) -> bool:
        return shape_built(self.device, self._loops_usable, shape, self.decode_steps)

    def decode_call_pages(self) -> int:
        """The widest context bucket (pages) whose decode calls are built for every row count (they
        are built in the background after warmup, narrowest first); 0 while none is. The scheduler
        makes a decode several tokens long only where its pages fit this (``Scheduler._several``),
        so a several-token step always finds a built call (``Buckets.fit_decode``)."""
        if self._loop_pages < self.buckets.decode_widths[-1]:
            rows = self.buckets.decode_rows()
            for width in self.buckets.decode_widths:
                if width > self._loop_pages and all(
                    self._loop_built(self.buckets.decode_shape(r, width)) for r in rows
                ):
                    self._loop_pages = width
                    what = "decode calls built up to %d-token contexts: %d tokens per decode call"
                    logger.info(what, width * self.page_size, self.decode_steps)
        return self._loop_pages

    # -- warmup -------------------------------------------------------------------------------
    def compile_ops(self) -> tuple[CompileSteps, CompileSteps]:
        """The step builds before serving, and those made in the background (``Buckets.compile_ops``)."""
        return self.buckets.compile_ops(self.decode_steps, self.images)

    def warmup(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Build the executable of every step shape (``CompileSteps``: compiled, or loaded from the
        persistent compilation cache), then the page copy and penalty-slot writers. The service
        counts what was compiled and what was loaded (``compile_counter``)."""
        now, later = self.compile_ops()
        self.device.run([now], progress)
        zeros = np.zeros(SLOT_CHUNK, np.int32)
        slot = self.scratch_slot
        self.device.run([CopyPage(0, 0), ClearSlot(slot), WriteSlot(slot, zeros, 0, True)])
        if self.adapter_zeros:  # the adapter-slot writer, with slot 0's zeros (nothing is resident yet)
            self.device.run([WriteAdapter(0, self.adapter_zeros)])
        if later.count:  # wider context buckets, several-token calls: built while serving
            self.device.run([later])
        self._to_prime = [prime_order(now), sorted(PrimeSteps(later).units(), key=unit_width)]
        self.warmed_up = True

    @property
    def primed(self) -> bool:
        """Whether every step executable has run once (``prime_next`` has none left to run)."""
        return not any(self._to_prime)

    def prime_next(self) -> bool | None:
        """Run the next executable that has not yet run, once (``PrimeSteps``: its first run costs
        a step of the 16-layer yardstick 0.1-0.3 s on CPU, which a request would otherwise pay);
        the engine calls this while it has nothing else to do. True: one was primed; False: the
        rest are still building in the background; None: none is left."""
        while self._to_prime and not self._to_prime[0]:
            self._to_prime.pop(0)
            if not self._to_prime:
                logger.info("every step executable has run once (primed while idle)")
        if not self._to_prime:
            return None
        units, at = self._to_prime[0], 0
        if len(self._to_prime) == 1:  # the background builds: each once it is built, in build order
            at = next((i for i, unit in enumerate(units) if self._unit_built(unit)), -1)
            if at < 0:
                return False
        self.device.run([units[at]])
        units.pop(at)  # (only now: `primed` must not turn true while the last one still runs)
        return True

    def _unit_built(self, unit: PrimeSteps) -> bool:
        """Whether the one executable of ``unit`` (a background build: a forward or a decode call)
        is built, without waiting (a decode call: those of its shape in every sampler mode)."""
        steps = unit.steps
        if steps.shapes:  # (asked of the device: the runner's memos hold the shapes steps ran in)
            return self.device.step_ready(steps.shapes[0])
        shape, k, _ = steps.loops[0]
        return self.device.loop_ready(shape, k)


def _widest(_: StepShape) -> bool:
    """``Buckets.fit``'s predicate that takes no narrower context bucket than the widest."""
    return False
