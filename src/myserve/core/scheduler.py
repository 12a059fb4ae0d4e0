"""The scheduler: which tokens of which sequences each engine step computes.

Each step, under a token budget (``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``):

1. running sequences whose prompt is done get one decode token each (oldest admitted first);
2. running sequences still prefilling get their next chunk;
3. waiting sequences are admitted (reusing prefix-cached pages) and get a first chunk.

A sequence needs pages for every token it computes, and a penalty slot while it runs if it uses
penalties. Every resource a sequence holds (pages, prefix-cache references, pages shared with n > 1
siblings, its penalty slot) is given back by one method, ``release``, which finishing, aborting,
preemption and engine errors all go through.

 When the pool runs dry while growing a running
sequence, the most recently admitted running sequence is preempted: its pages are released and it
goes back to the front of the waiting queue to be recomputed later. Nothing is dropped, and a lone
sequence always fits because the service refuses requests longer than the whole pool.

A step holds at most ``max_prefill_chunks`` chunks of more than one token: the runner cuts each
into blocks of attention queries, and the cap keeps every step inside the largest step shape.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING, Protocol

from myserve.core.adapters import AdapterSlots
from myserve.core.images import chunk_bounds
from myserve.core.pages import PageAllocator, chain_hashes
from myserve.core.sequence import SeqStatus, Sequence
from myserve.core.slots import SlotPool

if TYPE_CHECKING:
    from myserve.runtime.lora_files import LoraAdapter


class Proposer(Protocol):
    """Proposes speculative drafts (``core/ngram.py``'s prompt lookup, ``core/draft.py``'s model)."""

    num_tokens: int
    """The longest draft it proposes."""
    host_only: bool
    """Its drafts cost no device work (prompt lookup): proposed for every candidate first."""

    def propose(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Per (sequence, most tokens), a draft continuing its known tokens (possibly empty); the
        sequence's pages already hold the draft's positions."""
        ...


@dataclasses.dataclass(frozen=True)
class ScheduledChunk:
    """``num_tokens`` tokens of ``seq`` starting at position ``start``; ``samples`` if they end its known tokens."""

    seq: Sequence
    start: int
    num_tokens: int
    steps: int = 1
    """Tokens a one-token decode chunk produces in this call (> 1: a several-token decode call,
    its pages reserved; the sequence's tokens up to ``start + steps - 1`` count as computed)."""
    draft: tuple[int, ...] = ()
    """A speculating decode's draft tokens, after its last known token (``num_tokens`` counts
    them): each position samples, and the draft is kept as far as the samples agree with it."""

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's last known token, so its logits give a new token
        (never for an embedding request's chunk, whose hidden states are pooled instead)."""
        known_end = self.start + self.num_tokens - len(self.draft)
        return known_end == self.seq.num_tokens and self.seq.pool_type is None

    @property
    def sample_count(self) -> int:
        """Sampling rows this chunk takes: one, or one per position of a speculating decode."""
        return 1 + len(self.draft)


@dataclasses.dataclass(frozen=True)
class ScheduledBatch:
    """One step's work: single-token decodes and multi-token prefill chunks."""

    decodes: list[ScheduledChunk]
    prefills: list[ScheduledChunk]
    preempted: list[Sequence]
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    """(source page, destination page) copies to make before the step: copy-on-write of a shared
    prompt's last page for the later choices of an n > 1 request."""
    fill_slots: list[Sequence] = dataclasses.field(default_factory=list)
    """Sequences given a penalty slot this step: the slot must be filled from their tokens (prompt
    and any output from before a preemption) before the step samples."""
    adapter_writes: list[tuple[int, LoraAdapter]] = dataclasses.field(default_factory=list)
    """LoRA adapters to write into device slots before the step (``core/adapters.py``)."""
    weights: int = 0
    """The weight slot the step runs on: only sequences of that version of the weights are in it."""
    saves: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    """(device page, host slot): evicted prefix pages to copy to the host tier first (``core/host_tier.py``)."""
    loads: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    """(host slot, device page): prefix pages to fill from the host tier, after the saves."""

    @property
    def empty(self) -> bool:
        """No work this step."""
        return not self.decodes and not self.prefills


class Scheduler:
    """Waiting queue, running list and the step planner. Not thread-safe: the engine thread owns it."""

    def __init__(
        self,
        allocator: PageAllocator,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_prefill_chunk: int,
        max_prefill_chunks: int | None = None,
        decode_steps: int = 1,
        decode_steps_pages: int | None = None,
        adapters: AdapterSlots | None = None,
        speculate: Proposer | None = None,
    ):
        """``decode_steps``: tokens a decode may produce per call when the step is decodes only and
        nothing needs the host between tokens (1: one per call); ``decode_steps_pages``: the most
        pages such a sequence may hold (the several-token calls' page tables); ``adapters``: the
        LoRA slots a sequence naming an adapter needs while it runs (None: no adapters served);
        ``speculate``: proposes decodes' drafts (prompt lookup, ``core/ngram.py``, or a draft model,
        ``core/draft.py``; None: no speculation)."""
        self.speculate = speculate
        self.allocator = allocator
        self.decode_steps = decode_steps
        self.decode_steps_pages = decode_steps_pages
        self.page_size = allocator.page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_chunk = max_prefill_chunk
        self.max_prefill_chunks = max_prefill_chunks
        self.adapters = adapters
        self.slots = SlotPool(max_num_seqs)  # at most max_num_seqs run, each holds at most one
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence."""
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished, aborted or failed sequence and release what it holds (cached full pages
        stay cached). Finishing a finished sequence does nothing."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.release(seq)
        seq.status = SeqStatus.FINISHED

    def release(self, seq: Sequence) -> None:
        """Give back every resource ``seq`` holds: one reference to each of its pages (prefix-cache
        hits and pages shared with n > 1 siblings are references like any other) and its penalty slot.
        The one release path: finish, abort, preemption and engine errors all come here."""
        # Last page first: the eviction order then drops a prefix's tail before its head (a head
        # evicted first would leave the rest unreachable, as vLLM's free queue reasons too).
        self.allocator.release(seq.pages[::-1])
        seq.pages = []
        if seq.slot is not None:
            self.slots.release(seq.slot, seq)
            seq.slot = None
        if seq.adapter_slot is not None:
            assert self.adapters is not None
            self.adapters.release(seq.adapter_slot)
            seq.adapter_slot = None

    def _preempt(self, seq: Sequence) -> None:
        """Stop a running sequence: release what it holds and requeue it at the front for recompute."""
        self.running.remove(seq)
        self.release(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _start_running(self, seq: Sequence, fill_slots: list[Sequence]) -> None:
        """Admission's last step: running, with a penalty slot (to fill) if it uses penalties."""
        seq.mark_admitted()
        self.running.append(seq)
        if seq.params.uses_penalties:
            seq.slot = self.slots.acquire(seq)
            fill_slots.append(seq)

    def has_work(self) -> bool:
        """Whether any sequence is waiting or running."""
        return bool(self.waiting or self.running)

    def _pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-(seq.num_computed + num_tokens) // self.page_size) - len(seq.pages))

    def schedule(self, weights: int = 0) -> ScheduledBatch:
        """Plan the next step, of the sequences on weight slot ``weights`` only (while a new version
        of the weights replaces the old one, the engine alternates steps of each)."""
        budget = self.max_num_batched_tokens
        chunks: dict[Sequence, ScheduledChunk] = {}
        preempted: list[Sequence] = []

        def grow(seq: Sequence, num_tokens: int) -> bool:
            """Pages for ``num_tokens`` more tokens, preempting the newest; False if ``seq`` itself went."""
            nonlocal budget
            need = self._pages_needed(seq, num_tokens)
            while not self.allocator.can_allocate(need):
                victim = max(self.running, key=lambda s: s.admitted_at)
                self._preempt(victim)
                preempted.append(victim)
                dropped = chunks.pop(victim, None)  # it may already be in this step: its pages are gone
                if dropped is not None:
                    budget += dropped.num_tokens
                if victim is seq:
                    return False
            seq.pages.extend(self.allocator.allocate(need))
            return True

        multi = 0  # chunks of more than one token so far (capped by max_prefill_chunks)
        cap = self.max_prefill_chunks if self.max_prefill_chunks is not None else 1 << 30
        by_age = sorted((s for s in self.running if s.weights == weights), key=lambda s: s.admitted_at)
        # Decodes first (oldest first), so running requests keep streaming under load.
        for seq in by_age:
            # A sequence whose token in flight reaches max_len finishes when it is read: no decode.
            if seq.num_tokens >= seq.max_len:
                continue
            if budget > 0 and seq.status is SeqStatus.RUNNING and seq.num_pending == 1 and grow(seq, 1):
                chunks[seq] = ScheduledChunk(seq, seq.num_computed, 1)
                budget -= 1
        # Then the next chunk of running sequences still prefilling; a chunk shrinks to the free
        # pages rather than preempting, unless not even one token fits.
        waits = False  # a running prompt's whole image did not fit the budget: admit no one before it
        for seq in by_age:
            if budget == 0 or seq.status is not SeqStatus.RUNNING or seq.num_pending <= 1 or multi >= cap:
                continue
            fits = (len(seq.pages) + self.allocator.num_free) * self.page_size - seq.num_computed
            least = chunk_bounds(seq.images, seq.num_computed, 0)[0]  # (an image attending both ways: whole)
            want = min(seq.num_pending, budget, self.max_prefill_chunk, max(fits, least))
            n = chunk_bounds(seq.images, seq.num_computed, want)[1]
            waits |= n < least
            if n >= least and grow(seq, n):
                chunks[seq] = ScheduledChunk(seq, seq.num_computed, n)
                budget -= n
                multi += n > 1
        # Then admissions in arrival order (preempted sequences are back at the front); none in a
        # step that had to preempt, which would only thrash. Later choices of an n > 1 request
        # wait (without blocking the queue) until the first choice has computed the prompt.
        copies: list[tuple[int, int]] = []
        fill_slots: list[Sequence] = []
        for seq in list(self.waiting) if not preempted and not waits else []:
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            if seq.weights != weights:
                continue
            parent = seq.parent
            if parent is not None and parent.status is not SeqStatus.FINISHED:
                if parent.status is not SeqStatus.RUNNING or parent.num_computed < len(seq.prompt_ids):
                    continue
                if not self._acquire_adapter(seq):
                    continue
                first = self._admit_sibling(seq, parent, copies)
            else:
                if multi >= cap and seq.num_tokens > 1:
                    break  # its first chunk would be one chunk too many
                if not self._acquire_adapter(seq):
                    continue  # every adapter slot is in use by other adapters: later requests may go
                first = self._admit(seq, budget)
            if first == 0:
                self.release(seq)  # (its adapter slot)
                break
            multi += first > 1
            self.waiting.remove(seq)
            self._start_running(seq, fill_slots)
            chunks[seq] = ScheduledChunk(seq, seq.num_computed, first)
            budget -= first
        if self.speculate is not None:
            budget, multi = self._speculate(chunks, budget, multi, cap)
        # Decodes: one-token chunks that score no prompt position (the runner lays out both kinds alike).
        decodes = [c for c in chunks.values() if c.num_tokens == 1 and not c.seq.scores_prompt(c.start)]
        prefills = [c for c in chunks.values() if c.num_tokens > 1 or c.seq.scores_prompt(c.start)]
        if self.decode_steps > 1 and decodes and not prefills and not preempted and not copies:
            decodes = [self._several(c) for c in decodes]
        writes = self.adapters.take_pending() if self.adapters is not None else []
        # The host tier's copies go with the next step that runs (only a step writes a page).
        saves, loads = self.allocator.take_transfers() if decodes or prefills else ([], [])
        return ScheduledBatch(decodes, prefills, preempted, copies, fill_slots, writes, weights, saves, loads)

    def _speculate(self, chunks: dict[Sequence, ScheduledChunk], budget: int, multi: int, cap: int) -> tuple[int, int]:
        """Turn decodes that may speculate into a draft's worth of positions, oldest first, while the
        step has sampling rows (one per position: at most ``max_num_seqs`` in all), token budget and
        free pages for them (never preempting); the budget and multi-token chunks left.

        A host-only proposer's drafts are known first, and only those that drafted something take
        rows. A draft model's sequences are reserved their longest draft (pages too: it writes its
        own K/V of the draft's positions), proposed at once (one batch), and what a shorter draft
        did not use goes back."""
        proposer = self.speculate
        assert proposer is not None
        spare = self.max_num_seqs - sum(c.sample_count for c in chunks.values() if c.samples)
        eligible = [
            (seq, min(proposer.num_tokens, seq.max_len - seq.num_tokens - 1))  # the token after the draft samples too
            for seq, chunk in sorted(chunks.items(), key=lambda item: item[0].admitted_at)
            if chunk.num_tokens == 1 and chunk.samples and seq.may_speculate
        ]
        known = proposer.propose(eligible) if proposer.host_only and eligible else None
        wanted: list[tuple[Sequence, int]] = []
        drafts: list[list[int]] = []
        for i, (seq, room) in enumerate(eligible):
            if spare <= 0 or budget <= 0 or multi >= cap:
                break
            k = min(room, spare, budget)
            if known is not None:
                drafts.append(known[i][:k])
                k = len(drafts[-1])
            need = self._pages_needed(seq, 1 + k)
            if k <= 0 or not self.allocator.can_allocate(need):
                if known is not None:
                    drafts.pop()
                continue
            seq.pages.extend(self.allocator.allocate(need))
            wanted.append((seq, k))
            spare, budget, multi = spare - k, budget - k, multi + 1
        if known is None and wanted:
            drafts = proposer.propose(wanted)
        for (seq, k), draft in zip(wanted, drafts, strict=True):
            draft = draft[:k]
            budget += k - len(draft)
            if draft:
                chunks[seq] = ScheduledChunk(seq, seq.num_computed, 1 + len(draft), draft=tuple(draft))
            else:
                multi -= 1
            self._keep_pages(seq, seq.num_computed + 1 + len(draft))
        return budget, multi

    def trim_pages(self, seq: Sequence) -> None:
        """Give back the pages a verified draft reserved beyond the sequence's tokens (its rejected
        positions' KV is dropped with them)."""
        if seq.status is SeqStatus.RUNNING:
            self._keep_pages(seq, seq.num_tokens)

    def _keep_pages(self, seq: Sequence, tokens: int) -> None:
        """Give back ``seq``'s pages beyond those its first ``tokens`` positions need."""
        keep = -(-tokens // self.page_size)
        if len(seq.pages) > keep:
            self.allocator.release(seq.pages[keep:])
            del seq.pages[keep:]

    def _acquire_adapter(self, seq: Sequence) -> bool:
        """The slot of ``seq``'s adapter (if it names one); False when no slot can hold it now."""
        name = seq.params.adapter
        if name is None or seq.adapter_slot is not None:
            return True
        assert self.adapters is not None, "the engine core refuses adapters it does not serve"
        seq.adapter_slot = self.adapters.acquire(name)
        return seq.adapter_slot is not None

    def _several(self, chunk: ScheduledChunk) -> ScheduledChunk:
        """A decode of a decode-only step made several tokens long where nothing needs the host
        between them: as many as ``decode_steps``, the sequence's length allows and free pages hold
        (never preempting for them). A constrained sequence (its grammar mask needs the host after
        every token) or an embedding keeps one."""
        seq = chunk.seq
        if seq.constrained or seq.pool_type is not None:
            return chunk
        steps = min(self.decode_steps, seq.max_len - seq.num_tokens)
        need = self._pages_needed(seq, steps)
        if steps <= 1 or not self.allocator.can_allocate(need):
            return chunk
        if self.decode_steps_pages is not None and len(seq.pages) + need > self.decode_steps_pages:
            return chunk
        seq.pages.extend(self.allocator.allocate(need))
        return dataclasses.replace(chunk, steps=steps)

    def _admit_sibling(self, seq: Sequence, parent: Sequence, copies: list[tuple[int, int]]) -> int:
        """Pages for a later choice: its first choice's prompt pages; it computes only the last prompt token.

        Full pages before the last prompt token are shared; the page holding the last prompt token
        is copied (copy-on-write), because this choice rewrites that token and then appends its own.
        """
        n = len(seq.prompt_ids)
        shared = parent.pages[: (n - 1) // self.page_size]
        if not self.allocator.can_allocate(1):
            return 0
        self.allocator.share(shared)
        page = self.allocator.allocate(1)[0]
        copies.append((parent.pages[len(shared)], page))
        seq.pages = [*shared, page]
        seq.page_hashes = parent.page_hashes[: len(shared)]
        seq.num_cached_pages = len(shared)
        seq.num_computed = n - 1
        return 1

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Pages for ``seq``: its prefix-cached ones and those of a first chunk; the chunk's size, or 0 if short."""
        root = {} if seq.hash_root is None else {"parent": seq.hash_root}
        hashes = chain_hashes(seq.hash_tokens(0, seq.num_tokens), self.page_size, **root)
        # A prompt that is scored (prompt logprobs) or mean/cls pooled must be computed whole: no cached pages.
        scored = (seq.params.prompt_logprobs is not None and not seq.output_ids) or seq.pools_every_token
        cached = [] if scored else self.allocator.match_prefix(hashes, seq.num_tokens)
        hosted = [] if scored else self.allocator.match_host(hashes, len(cached), seq.num_tokens)
        known = len(cached) + len(hosted)  # pages whose K/V exist: on the device, or in host memory
        computed = known * self.page_size
        want = min(seq.num_tokens - computed, budget, self.max_prefill_chunk)
        least, first = chunk_bounds(seq.images, computed, want)  # (an image attending both ways: whole)
        need = -(-(computed + first) // self.page_size) - len(cached)
        if first < least or not self.allocator.can_allocate(need):
            self.allocator.release(cached)
            self.allocator.unpin_host(hosted)
            return 0
        self.allocator.record_lookup(seq.num_tokens, len(cached) * self.page_size, len(hosted) * self.page_size)
        fresh = self.allocator.allocate(need)
        self.allocator.load(hosted, fresh[: len(hosted)], hashes[len(cached) : known])
        seq.pages = cached + fresh
        seq.page_hashes = hashes[:known]
        seq.num_cached_pages = known
        seq.num_computed = computed
        seq.num_prefix_hit_tokens += computed
        return first

    def after_step(self, batch: ScheduledBatch) -> None:
        """Once a step is dispatched: its chunks count as computed, each sampling chunk's token is in
        flight (``Sequence.num_inflight``, until the reader appends it), and newly full pages whose
        tokens are known are offered to the prefix cache. Nothing here waits for the device: the
        next step is planned on these counts while this one runs."""
        for chunk in (*batch.decodes, *batch.prefills):
            seq = chunk.seq
            if seq.status is not SeqStatus.RUNNING:
                continue  # finished or aborted before the step was dispatched
            if chunk.draft:  # only the known token is surely computed: the reader keeps what agreed
                seq.num_computed = max(seq.num_computed, chunk.start + 1)
                seq.speculating = True
            else:
                seq.num_computed = max(seq.num_computed, chunk.start + chunk.num_tokens + chunk.steps - 1)
            if chunk.samples:
                seq.num_inflight += chunk.steps
            for page, page_hash in seq.update_page_hashes(self.page_size):
                self.allocator.cache_page(page, page_hash)
