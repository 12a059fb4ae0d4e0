"""Static step shapes: the token buckets, and the fixed parts of every step's layout.

A step runs the executable of the smallest token bucket that holds its tokens (and its one-token
rows and prefill blocks: ``StepShape.fits``), whatever its mix of prefill and decode, so warmup
compiles one executable per bucket and sampler variant. Page tables are full width
(``max_model_len`` pages): the attention's context loop stops at the step's longest context, so
no page-width bucket exists.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from myserve.config import EngineConfig
from myserve.runtime.step_layout import Span, StepShape, count

BLOCK_TOKENS = 32
"""Query tokens per block of a prefill chunk in the attention (``ops/ragged_batch.py``): a
block's tokens share one gathered context, so larger blocks gather less but pad more."""

CHUNK_TOKENS = 128
"""Context tokens the attention reads per loop iteration (rounded to whole pages)."""


def _powers(start: int, stop: int) -> tuple[int, ...]:
    values, v = [], start
    while v < stop:
        values.append(v)
        v *= 2
    return tuple(sorted({*values, stop}))


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The step shapes of one engine."""

    tokens: tuple[int, ...]
    """Token buckets, ascending; the largest is ``max_num_batched_tokens``."""
    max_num_seqs: int
    page_size: int
    max_pages: int
    """Pages of the longest sequence (``max_model_len``)."""
    block_tokens: int = BLOCK_TOKENS
    chunk_pages: int = 1

    @staticmethod
    def from_config(cfg: EngineConfig, max_model_len: int, min_tokens: int = 1) -> Buckets:
        """Buckets from the config: ``engine.token_buckets``, or powers of two up to the step budget.

        ``min_tokens``: steps are padded to at least this many tokens (int8 matmuls are slow below 8 rows).
        """
        top = cfg.max_num_batched_tokens
        chosen = set(cfg.token_buckets) if cfg.token_buckets else set(_powers(1, top))
        floor = min(min_tokens, top)
        tokens = tuple(sorted({max(t, floor) for t in chosen if t < top} | {top}))
        return Buckets(
            tokens=tokens,
            max_num_seqs=cfg.max_num_seqs,
            page_size=cfg.page_size,
            max_pages=math.ceil(max_model_len / cfg.page_size),
            block_tokens=min(BLOCK_TOKENS, top),
            chunk_pages=max(1, CHUNK_TOKENS // cfg.page_size),
        )

    def shape(self, tokens: int) -> StepShape:
        """The shape of one token bucket."""
        return StepShape.of(
            tokens,
            max_num_seqs=self.max_num_seqs,
            block_tokens=self.block_tokens,
            max_pages=self.max_pages,
            chunk_pages=self.chunk_pages,
        )

    def shapes(self) -> list[StepShape]:
        """Every step shape: the warmup list."""
        return [self.shape(t) for t in self.tokens]

    @property
    def max_prefill_chunks(self) -> int:
        """Most multi-token chunks one step may hold so that the largest bucket always fits them
        (each chunk rounds up to whole blocks; see ``StepShape.of``)."""
        top = self.shape(self.tokens[-1])
        return top.blocks - top.tokens // top.block_tokens

    def fit(self, spans: Sequence[Span]) -> StepShape:
        """The smallest shape that holds ``spans``."""
        need = count(spans, self.block_tokens)
        for t in self.tokens:
            shape = self.shape(t)
            if shape.fits(*need):
                return shape
        raise ValueError(f"a step of {need} (tokens, one-token rows, blocks) exceeds the largest bucket")
