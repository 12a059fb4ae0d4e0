"""Sequence: the host-side state of one choice of one request as it moves through the engine."""

from __future__ import annotations

import enum
import itertools
import logging
import random
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from myserve.core.images import ImageSpan, hash_tokens
from myserve.core.pages import PageHash, chain_hashes
from myserve.wire.outputs import RequestOutput, TokenLogprob
from myserve.wire.params import SamplingParams

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from myserve.core.token_masks import TokenFilter
    from myserve.grammar import GrammarMatcher

_admission_counter = itertools.count()


class SeqStatus(enum.Enum):
    """Where a sequence is: waiting for admission, running (holding pages), or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One choice of a request: its tokens, its pages, and how many of its tokens are in the KV cache.

    There is no prefill or decode mode: ``num_computed`` catches up with ``num_tokens`` a chunk at
    a time, and whenever a step computes the last known token, the sampled token is appended.

    With overlapped steps, a token sampled by a step that is dispatched but not yet read is *in
    flight* (``num_inflight``): it counts in ``num_tokens``, so the scheduler plans the
    next step as if it were known, and the device feeds it to that step; ``tokens`` and
    ``num_known`` cover only the tokens the host has.
    """

    def __init__(
        self,
        request_id: str,
        choice: int,
        prompt_ids: list[int],
        params: SamplingParams,
        max_len: int,
        parent: Sequence | None = None,
        seed: int | None = None,
    ):
        self.request_id = request_id
        self.choice = choice
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        # Choices after the first wait for it to compute the prompt, then share its pages.
        self.parent = parent
        # Without a request seed each choice still gets a fixed one (``seed``: the engine's draw),
        # so preemption and recompute cannot change its samples.
        if params.seed is not None:
            self.seed = params.seed
        else:
            self.seed = seed if seed is not None else random.getrandbits(32)
        self.max_len = max_len  # prompt + output may not exceed this (model context or max_tokens)
        self.status = SeqStatus.WAITING
        self.pages: list[int] = []
        self.num_computed = 0
        self.page_hashes: list[PageHash] = []  # chained hashes of this sequence's full, computed pages
        self.num_cached_pages = 0  # pages of page_hashes already offered to the prefix cache
        self.admitted_at = -1  # admission order; the newest running sequence is preempted first
        # Device slot of its penalty state while it runs (when it uses penalties): the scheduler's
        # SlotPool owns the bookkeeping, and ``Scheduler.release`` gives it back.
        self.slot: int | None = None
        # Tokens sampled by dispatched steps not read yet: 0 or 1 when a step is planned (2 for a
        # moment between dispatching a step and reading the one before).
        self.num_inflight = 0
        self.num_prefix_hit_tokens = 0
        self.finish_reason: str | None = None
        # Logprobs of prompt tokens by position, when the request scores its prompt.
        self.prompt_scores: dict[int, TokenLogprob] | None = None
        # Grammar state of a constrained request (``params.grammar``), advanced by its output tokens.
        self.matcher: GrammarMatcher | None = None
        # A matcher waiting for ``params.grammar_after`` to appear in the output (reasoning first).
        self.pending_matcher: GrammarMatcher | None = None
        # The request's allowed_token_ids / bad_words mask (shared by its choices), or None.
        self.token_filter: TokenFilter | None = None
        # The device slot of its LoRA adapter while it runs (``core/adapters.py``), and the root of
        # its pages' hash chain (an adapter's pages are its own in the prefix cache).
        self.adapter_slot: int | None = None
        self.hash_root: bytes | None = None
        # A speculating decode of it is in flight: its tokens are unknown until the reader decides
        # how much of the draft held (the engine reads that step before planning the next).
        self.speculating = False
        # A draft model's cache of it (``core/draft.py``): positions below ``draft_computed`` hold
        # the draft's K/V of its tokens; the ``draft_ahead`` after them hold K/V of the draft's own
        # proposals, which stay valid as far as verification keeps the draft (``keep_draft``).
        self.draft_computed = 0
        self.draft_ahead = 0
        # The weight slot of the version of the weights it runs on (``core/engine_weights.py``).
        self.weights = 0
        # An embedding request's pooling (``Pooler.type``: last, mean or cls), set at admission;
        # None for generation. Its chunks sample nothing: their hidden states are pooled instead.
        self.pool_type: str | None = None
        # Pooled sums read back so far, by chunk start: (chunk tokens, float32 [hidden]).
        self.pool_parts: dict[int, tuple[int, np.ndarray]] = {}
        # The prompt's images (``core/images.py``): their positions take the vision tower's
        # embeddings, and their page hashes the image's content key.
        self.images: tuple[ImageSpan, ...] = ()

    @property
    def pools_every_token(self) -> bool:
        """Its pooling reads hidden states from the prompt's start (mean, cls): no prefix-cache hit
        may skip computing them."""
        return self.pool_type is not None and self.pool_type != "last"

    def pool_range(self, start: int, n: int) -> tuple[int, int] | None:
        """Which tokens of a chunk of ``n`` from ``start`` pool, as offsets (first, stop) in the
        chunk; None if none does."""
        if self.pool_type == "mean":
            return 0, n
        if self.pool_type == "last":
            return (n - 1, n) if start + n == len(self.prompt_ids) else None
        if self.pool_type == "cls":
            return (0, 1) if start == 0 else None
        return None  # generation

    @property
    def constrained(self) -> bool:
        """Its next tokens are (or may soon be) masked by a grammar or a token filter: a step's mask
        needs its last token."""
        return (
            self.matcher is not None
            or self.pending_matcher is not None
            or self.token_filter is not None
            or self.speculating
        )

    @property
    def may_speculate(self) -> bool:
        """Whether its next decode may verify a draft: its tokens are all known, nothing masks its
        samples, no penalty state would need the draft's tokens, and min_tokens is reached (each
        position then samples exactly as a plain decode at that position would)."""
        p = self.params
        return (
            self.num_inflight == 0
            and not self.constrained
            and not p.uses_penalties
            and self.pool_type is None
            and len(self.output_ids) >= p.min_tokens
        )

    def advance_grammar(self, token: int) -> bool:
        """Feed an appended output token to the grammar (activating a pending one once the output ends
        with ``grammar_after``); False if the grammar refused it."""
        if self.matcher is not None:
            return self.matcher.accept(token)
        after = self.params.grammar_after
        if self.pending_matcher is not None and self.output_ids[-len(after) :] == list(after):
            self.matcher, self.pending_matcher = self.pending_matcher, None
        return True

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens, in flight included."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_inflight

    @property
    def num_known(self) -> int:
        """Prompt plus generated tokens the host has read."""
        return len(self.prompt_ids) + len(self.output_ids)

    def token(self, i: int) -> int:
        """Token ``i`` of prompt + output."""
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def tokens(self, start: int, stop: int) -> list[int]:
        """Known tokens ``start:stop`` of prompt + output (shorter when ``stop`` reaches a token in flight)."""
        # Sliced where they lie, not from a copy of the whole sequence: a decode asks for one token
        # of each running sequence every step.
        p = len(self.prompt_ids)
        if stop <= p:
            return self.prompt_ids[start:stop]
        if start >= p:
            return self.output_ids[start - p : stop - p]
        return self.prompt_ids[start:] + self.output_ids[: stop - p]

    def hash_tokens(self, start: int, stop: int) -> list[int]:
        """``tokens(start, stop)`` as page hashes see them: an image's positions carry its key."""
        tokens = self.tokens(start, stop)
        return hash_tokens(tokens, start, self.images) if self.images else tokens

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the KV cache."""
        return self.num_tokens - self.num_computed

    def mark_admitted(self) -> None:
        """Record admission order for preemption."""
        self.status = SeqStatus.RUNNING
        self.admitted_at = next(_admission_counter)

    def scores_prompt(self, start: int) -> bool:
        """Whether a chunk from ``start`` holds prompt positions whose next-token logprobs were asked for."""
        return self.params.prompt_logprobs is not None and start < len(self.prompt_ids) - 1

    def token_finish(self, token: int, eos_ids: tuple[int, ...]) -> tuple[str | None, int | None]:
        """Whether ``token``, just appended, ends this choice: (finish reason, the stop token id that
        ended it). The one place the core decides a token-level finish: "stop" for a stop token id or
        EOS (never for text: stop strings are the front end's), "length" at max_tokens or the context
        (aborts and engine errors are the engine core's ``_finish_request`` and ``_fail``)."""
        params = self.params
        if token in params.stop_token_ids:
            return "stop", token
        if not params.ignore_eos and token in eos_ids:
            return "stop", None
        if len(self.output_ids) >= (params.max_tokens or 1 << 30) or self.num_known >= self.max_len:
            return "length", None
        return None, None

    def take_samples(
        self, samples: Iterable[tuple[int, float, np.ndarray, np.ndarray]], eos_ids: tuple[int, ...]
    ) -> tuple[tuple[int, ...], tuple[TokenLogprob, ...] | None, str | None, int | None]:
        """Append a step's samples (token, logprob, top ids, top logprobs) up to the one that ends
        this choice (those after it are dropped), advancing the grammar: (tokens appended, their
        logprobs if asked for, finish reason, stop token id), the whole step's delta at once."""
        params = self.params
        k = params.logprobs
        tokens: list[int] = []
        logprobs: list[TokenLogprob] = []
        finish: str | None = None
        stop: int | None = None
        for token, logprob, top_ids, top_lps in samples:
            self.output_ids.append(token)
            tokens.append(token)
            if not self.advance_grammar(token):  # the mask allowed only valid tokens
                error = self.matcher.error if self.matcher is not None else ""
                logger.error("request %s: token %d broke its grammar: %s", self.request_id, token, error)
            if k is not None:
                top = tuple((int(i), float(v)) for i, v in zip(top_ids[:k], top_lps[:k], strict=True))
                logprobs.append(TokenLogprob(token, logprob, top))
            finish, stop = self.token_finish(token, eos_ids)
            if finish is not None:
                break
        return tuple(tokens), None if k is None else tuple(logprobs), finish, stop

    def record_prompt_scores(
        self, start: int, lps: np.ndarray, ids: np.ndarray, tlps: np.ndarray, ranks: np.ndarray
    ) -> None:
        """Keep the logprob of each prompt token (after the first) that a scored chunk starting at
        ``start`` computed: ``lps[j]`` is the logprob of the token after position ``start + j``,
        ``ids``/``tlps`` [n, K] the most likely tokens there, ``ranks[j]`` that token's rank."""
        if self.prompt_scores is None:
            self.prompt_scores = {}
        k = self.params.prompt_logprobs or 0
        last = len(self.prompt_ids) - 1  # position whose next token is still a prompt token, at most
        for j in range(min(len(lps), last - start)):
            pos = start + j
            top = tuple((int(i), float(v)) for i, v in zip(ids[j][:k], tlps[j][:k], strict=True))
            self.prompt_scores[pos + 1] = TokenLogprob(self.prompt_ids[pos + 1], float(lps[j]), top, int(ranks[j]))

    def prompt_output(self, finish: str | None = None) -> RequestOutput:
        """The delta carrying the prompt's logprobs (first prompt token: None)."""
        scores = self.prompt_scores or {}
        entries = (None, *(scores.get(i) for i in range(1, len(self.prompt_ids))))
        return RequestOutput(self.request_id, self.choice, prompt_logprobs=entries, finish_reason=finish)

    def reset_for_recompute(self) -> None:
        """After preemption (its pages and slot already released): nothing computed; its tokens so
        far are recomputed on readmission."""
        assert not self.pages and self.slot is None, "release a preempted sequence's resources first"
        self.status = SeqStatus.WAITING
        self.num_computed = 0
        self.num_cached_pages = 0
        self.draft_computed = self.draft_ahead = 0

    def keep_draft(self, held: int) -> None:
        """Verification kept ``held`` draft tokens: the draft model's K/V of as many of its proposals
        (those it computed) is now that of the sequence's tokens."""
        self.draft_computed += min(held, self.draft_ahead)
        self.draft_ahead = 0

    def update_page_hashes(self, page_size: int) -> list[tuple[int, PageHash]]:
        """Hash pages that became full, computed and known; return (page, hash) pairs new since last call."""
        full = min(self.num_computed, self.num_known) // page_size
        if full > len(self.page_hashes):
            start = len(self.page_hashes) * page_size
            parent = self.page_hashes[-1] if self.page_hashes else self.hash_root
            new_tokens = self.hash_tokens(start, full * page_size)
            kwargs = {} if parent is None else {"parent": parent}
            self.page_hashes.extend(chain_hashes(new_tokens, page_size, **kwargs))
        fresh = [(self.pages[i], self.page_hashes[i]) for i in range(self.num_cached_pages, full)]
        self.num_cached_pages = full
        return fresh

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id}#{self.choice}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed}, pages={len(self.pages)})"
        )
