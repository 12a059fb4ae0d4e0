"""Token masks that are not grammars: a request's ``allowed_token_ids`` and ``bad_words``, written
into the same bitmask rows the sampler applies for grammars (``runtime/sampler.py::apply_token_bitmask``).

A row is llguidance's format (``grammar.py``): int32 words, bit ``t % 32`` of word ``t // 32`` set
when token ``t`` may be sampled. ``allowed_token_ids`` is one fixed row; a bad word bans its last
token only where the output already ends with the tokens before it (vLLM's rule), so its mask
depends on the output and is made each step from the tokens the host has read.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from myserve.wire.params import SamplingParams


class TokenFilter:
    """One request's ``allowed_token_ids`` and ``bad_words_ids`` as bitmask rows (shared by its choices:
    it holds no per-sequence state)."""

    def __init__(self, params: SamplingParams, vocab_size: int):
        self.vocab_size = vocab_size
        words = -(-vocab_size // 32)
        self._allowed: np.ndarray | None = None
        if params.allowed_token_ids:
            allowed = np.zeros(words, np.uint32)
            ids = np.asarray(params.allowed_token_ids, np.int64)
            np.bitwise_or.at(allowed, ids >> 5, np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32)))
            self._allowed = allowed.view(np.int32)
        self._bad = params.bad_words_ids

    def apply(self, row: np.ndarray, output_ids: Sequence[int]) -> None:
        """Clear the bits of ``row`` (int32 [words], already holding a grammar's mask or all ones) for
        the tokens this request may not sample next, after ``output_ids``. A mask that would allow
        nothing (a grammar needing a token outside ``allowed_token_ids``) is left as the grammar made
        it: the grammar's promise of valid output wins."""
        before = row.copy()
        if self._allowed is not None:
            row &= self._allowed
        bits = row.view(np.uint32)
        n = len(output_ids)
        for word in self._bad:
            prefix = len(word) - 1
            if prefix > n or (prefix and list(output_ids[n - prefix :]) != list(word[:-1])):
                continue
            token = word[-1]
            bits[token >> 5] &= ~np.uint32(1 << (token & 31))
        if not row.any():
            row[:] = before
