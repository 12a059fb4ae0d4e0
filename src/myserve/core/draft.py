"""Draft-model proposals for speculative decoding (vLLM's ``{"model": DIR}``).

A smaller model with the target's vocabulary runs in the same core on its own executor: its own
weights and its own paged KV cache, as many pages as the target's and indexed by the same page
ids, so a sequence's page table serves both and nothing is allocated twice. The draft's cache of
a sequence is its own business: ``Sequence.draft_computed`` says how far it holds the sequence's
tokens, and the draft catches up lazily when the sequence next speculates (the whole prompt the
first time, one or two tokens after each verified step). A prefix-cache hit or an n > 1 sibling's
shared pages are recomputed into the draft's cache (the same tokens at the same positions: the
same K/V), so the draft never trusts K/V another sequence wrote.

One proposal, for every speculating sequence of a step at once:

1. catch-up calls (no sampling) for tokens beyond one final chunk each, when there are any;
2. one call over each sequence's final chunk, ending at its last known token, whose sampling row
   draws the first draft token;
3. the other ``k - 1`` draft tokens: one several-token decode call (``decode_loop``, once built in
   the background) fed on the device from step 2's rows, else ``k - 1`` one-token calls.

Each draft position draws with the request's own sampling parameters, seed and output position:
the very key the target's verification row at that position uses (``runtime/sampler.py``). The
verification keeps a draft token only where the target's own draw equals it, which is rejection
sampling against a draft that is a point mass: the target distribution is kept exactly (a seeded
request's tokens are those of plain decoding), and sharing the Gumbel noise makes a draft that
resembles the target agree with it at any temperature, not only greedily.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from myserve.core.runner import shape_built
from myserve.core.sequence import Sequence as Seq
from myserve.runtime.buckets import Buckets
from myserve.runtime.device import Device
from myserve.runtime.sampling_rows import LOGPROBS, STEPS, SamplingRows, head_mode
from myserve.runtime.step_layout import HostStep, Span, StepShape, layout
from myserve.runtime.step_ops import CompileSteps, StepCall

logger = logging.getLogger(__name__)


class DraftProposer:
    """Proposes drafts with a draft model on ``device`` (its executor), from the engine thread."""

    host_only = False

    def __init__(
        self, device: Device, *, buckets: Buckets, num_tokens: int, max_num_seqs: int, eos_ids: Sequence[int] = ()
    ):
        """``buckets``: the target's step shapes (the draft's steps fit the same budget);
        ``num_tokens``: the longest draft (``engine.num_speculative_tokens``)."""
        self.device = device
        self.buckets = buckets
        self.num_tokens = num_tokens
        self.page_size = buckets.page_size
        self.scratch_slot = max_num_seqs
        self.eos_ids = tuple(eos_ids)
        self.loop_steps = num_tokens - 1
        """Iterations of the several-token call drawing a draft's tokens after its first."""
        self.warmed_up = False
        self._loops_ready = False
        self._usable: set[StepShape] = set()

    # -- warmup -------------------------------------------------------------------------------
    def compile_ops(self) -> tuple[CompileSteps, CompileSteps]:
        """The draft's builds: the target's forwards and heads (no prompt scorer: a draft scores
        nothing), and in the background the narrower context buckets and the several-token call."""
        now, later = self.buckets.compile_ops(self.loop_steps if self.loop_steps > 1 else None)
        return CompileSteps(now.shapes, now.heads), later

    def warmup(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Build the draft's step executables (``compile_ops``) before the engine serves."""
        now, later = self.compile_ops()
        self.device.run([now], progress)
        if later.count:
            self.device.run([later])
        self.warmed_up = True

    # -- proposals ----------------------------------------------------------------------------
    def propose(self, wanted: list[tuple[Seq, int]]) -> list[list[int]]:
        """Per (sequence, most tokens), a draft of that many tokens (fewer after a stop token)
        continuing its known tokens; the pages of the draft's positions are already the
        sequence's. Runs the draft model (waits for it)."""
        lasts = [seq.num_known for seq, _ in wanted]
        finals = self._final_starts(wanted, lasts)
        self._catch_up([(seq, seq.draft_computed, final) for (seq, _), final in zip(wanted, finals, strict=True)])
        spans = [
            Span(seq.tokens(f, n), f, seq.pages, True) for (seq, _), f, n in zip(wanted, finals, lasts, strict=True)
        ]
        host, call = self._call(spans, wanted, 0)
        rows = {i: self._row(host.sample_rows, i) for i in range(len(wanted))}
        reads = [(self.device.run([call])[0], rows, 1)]  # (output, sampling row of each draft, draws)
        more = [i for i, (_, k) in enumerate(wanted) if k > 1]
        if more:
            reads += self._continue(wanted, lasts, more, rows)
        drafts: list[list[int]] = [[] for _ in wanted]
        for out, at, draws in reads:
            tokens = self.device.read(out, tops=False, scored=False).tokens
            for i, row in at.items():
                drafts[i] += [int(t) for t in tokens[:draws, row]] if draws > 1 else [int(tokens[row])]
        for i, ((seq, k), last) in enumerate(zip(wanted, lasts, strict=True)):
            drafts[i] = self._cut(seq, drafts[i][:k])
            seq.draft_computed, seq.draft_ahead = last, min(k, len(drafts[i])) - 1
        return drafts

    def _final_starts(self, wanted: list[tuple[Seq, int]], lasts: list[int]) -> list[int]:
        """Where each sequence's final chunk starts: its last known token, and as many tokens before
        it as the draft has yet to compute while one step holds them all (the budget's tokens,
        ``max_prefill_chunks`` chunks of several); the rest is caught up first."""
        room = self.buckets.tokens[-1] - len(wanted)
        chunks = 0
        starts = []
        for (seq, _), last in zip(wanted, lasts, strict=True):
            behind = max(0, last - 1 - seq.draft_computed)
            extra = min(behind, room) if chunks < self.buckets.max_prefill_chunks else 0
            room -= extra
            chunks += extra > 0
            starts.append(last - 1 - extra)
        return starts

    def _catch_up(self, pending: list[tuple[Seq, int, int]]) -> None:
        """Compute the draft's K/V of tokens ``[start, stop)`` of each sequence, as many steps as
        the budget needs (none when nothing is behind); nothing samples."""
        pending = [p for p in pending if p[2] > p[1]]
        while pending:
            spans: list[Span] = []
            rest: list[tuple[Seq, int, int]] = []
            tokens = chunks = 0
            for seq, start, stop in pending:
                n = min(stop - start, self.buckets.tokens[-1] - tokens)
                if n > 1 and chunks >= self.buckets.max_prefill_chunks:
                    n = 1
                if n <= 0 or len(spans) >= self.buckets.max_num_seqs:
                    rest.append((seq, start, stop))
                    continue
                spans.append(Span(seq.tokens(start, start + n), start, seq.pages, False))
                tokens, chunks = tokens + n, chunks + (n > 1)
                if start + n < stop:
                    rest.append((seq, start + n, stop))
            _, call = self._call(spans, [], 0)
            self.device.run([call])
            pending = rest

    def _continue(
        self, wanted: list[tuple[Seq, int]], lasts: list[int], more: list[int], rows: dict[int, int]
    ) -> list[tuple[object, dict[int, int], int]]:
        """The draft tokens after the first, of ``wanted[i]`` for ``i`` in ``more``, each fed on the
        device from its sampling row ``rows[i]`` of the call before: one several-token call when
        built and the page tables fit it, else one call per token. Returns what to read, as
        ``propose`` reads it."""
        if self.loop_steps > 1 and self._loops_built():
            spans = [Span([0], lasts[i], wanted[i][0].pages, True, feed=rows[i]) for i in more]
            shape = self.buckets.fit_decode(spans)
            if shape is not None:
                host = layout(spans, shape, self.page_size)
                packed = self._rows([wanted[i] for i in more], shape.singles, 1)
                packed.ints[: len(more), STEPS] = [wanted[i][1] - 1 for i in more]
                for j, i in enumerate(more):
                    seq = wanted[i][0]
                    stops = (() if seq.params.ignore_eos else self.eos_ids) + seq.params.stop_token_ids
                    packed.set_banned(j, stops, steps=0)  # a row stops after one: no K/V past it
                mode = head_mode(packed.ints, packed.floats, len(more))
                call = StepCall(host.pack(), shape, packed.ints, packed.floats, mode=mode, steps=self.loop_steps)
                at = {i: self._row(host.sample_rows, j) for j, i in enumerate(more)}
                return [(self.device.run([call])[0], at, self.loop_steps)]
        reads: list[tuple[object, dict[int, int], int]] = []
        feeds = {i: rows[i] for i in more}
        for j in range(1, max(wanted[i][1] for i in more)):
            live = [i for i in more if wanted[i][1] > j]
            spans = [Span([0], lasts[i] + j - 1, wanted[i][0].pages, True, feed=feeds[i]) for i in live]
            host, call = self._call(spans, [wanted[i] for i in live], j)
            feeds = {i: self._row(host.sample_rows, m) for m, i in enumerate(live)}
            reads.append((self.device.run([call])[0], feeds, 1))
        return reads

    @staticmethod
    def _row(rows: list[int | None], j: int) -> int:
        row = rows[j]
        assert row is not None, "a proposing span samples"
        return row

    def _call(self, spans: list[Span], sampling: list[tuple[Seq, int]], offset: int) -> tuple[HostStep, StepCall]:
        """One step call over ``spans``, the sampling ones drawing output position ``offset`` on."""
        shape = self.buckets.fit(spans, self._built)
        host = layout(spans, shape, self.page_size)
        packed = self._rows(sampling, shape.singles, offset)
        mode = head_mode(packed.ints, packed.floats, len(sampling))
        return host, StepCall(host.pack(), shape, packed.ints, packed.floats, mode=mode)

    def _rows(self, sampling: list[tuple[Seq, int]], rows: int, offset: int) -> SamplingRows:
        """Sampling rows drawing each sequence's output token ``offset`` after its known ones, with
        its own parameters and seed (its logit bias too; nothing else edits a draft's logits, and
        no logprobs are computed)."""
        packed = SamplingRows.empty(rows, self.scratch_slot)
        seqs = [seq for seq, _ in sampling]
        params = [seq.params for seq in seqs]
        generated = [len(seq.output_ids) + offset for seq in seqs]
        packed.set_leading(params, [s.seed for s in seqs], [s.choice for s in seqs], generated)
        packed.ints[: len(seqs), LOGPROBS] = 0
        for i, p in enumerate(params):
            if p.logit_bias:
                ids, values = zip(*p.logit_bias, strict=True)
                packed.set_bias(i, ids, values)
        return packed

    def _cut(self, seq: Seq, draft: list[int]) -> list[int]:
        """The draft up to its first stop token (EOS unless ignored, stop token ids), kept: the
        target stops there if it agrees, so nothing after it is worth verifying."""
        stops = set(seq.params.stop_token_ids) | (set() if seq.params.ignore_eos else set(self.eos_ids))
        end = next((j + 1 for j, t in enumerate(draft) if t in stops), len(draft))
        return draft[:end]

    def _built(self, shape: StepShape) -> bool:
        return shape_built(self.device, self._usable, shape)

    def _loops_built(self) -> bool:
        if not self._loops_ready:
            self._loops_ready = self.device.background_builds_done(0)
        return self._loops_ready
