"""Prompt-lookup drafts for speculative decoding (vLLM's ``"method": "ngram"``): the tokens that
followed the last time the sequence's final n-gram appeared in it.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the sequence's last n tokens are
searched for earlier in the sequence (prompt and output); the longest n that matches proposes the
up to ``k`` tokens after its most recent occurrence with ``k`` tokens after it (else the earliest).
Text that repeats its input (code edits, JSON echoes, quoting) drafts well; other text drafts
nothing and decodes as usual. Host only, no model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from myserve.core.sequence import Sequence as SequenceState


def propose(tokens: Sequence[int], k: int, n_max: int, n_min: int = 1) -> list[int]:
    """Up to ``k`` draft tokens continuing ``tokens`` (empty when no n-gram of ``n_min..n_max``
    tokens at the end occurred before)."""
    total = len(tokens)
    if k <= 0 or total < n_min + 1:
        return []
    seq = np.asarray(tokens, np.int64)
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        tail = seq[total - n :]
        # Windows of n tokens starting at 0..total-n-1 (the tail itself excluded), most recent first.
        windows = np.lib.stride_tricks.sliding_window_view(seq[: total - 1], n)
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            # The most recent occurrence with k tokens after it, else the one with the most.
            full = hits[hits + n + k <= total]
            start = int(full[-1] if full.size else hits[0]) + n
            return [int(t) for t in seq[start : start + k]]
    return []


class PromptLookup:
    """The scheduler's proposer (``scheduler.Proposer``) of prompt-lookup drafts."""

    host_only = True

    def __init__(self, num_tokens: int, n_max: int, n_min: int = 1):
        self.num_tokens = num_tokens
        self.n_max = n_max
        self.n_min = n_min

    def propose(self, wanted: list[tuple[SequenceState, int]]) -> list[list[int]]:
        """Each sequence's draft of at most its count of tokens (host only)."""
        return [propose(seq.tokens(0, seq.num_known), k, self.n_max, self.n_min) for seq, k in wanted]
