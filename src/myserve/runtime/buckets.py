"""Static shapes by bucket: decode batch sizes, prefill chunk lengths and page-table widths.

Every jitted step runs at one (rows, tokens per row, pages per row) shape from these sets, so the
number of compilations is fixed and all of them happen at warmup.
"""

from __future__ import annotations

import bisect
import dataclasses
import math

from myserve.config import EngineConfig


def _powers(start: int, stop: int, factor: int = 2) -> tuple[int, ...]:
    values, v = [], start
    while v < stop:
        values.append(v)
        v *= factor
    values.append(stop)
    return tuple(sorted(set(values)))


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The shape sets of one engine."""

    batch: tuple[int, ...]
    """Decode rows per step."""
    tokens: tuple[int, ...]
    """Prefill chunk lengths; the largest is the longest chunk the scheduler makes."""
    pages: tuple[int, ...]
    """Page-table widths; the largest covers ``max_model_len``."""
    page_size: int

    @staticmethod
    def from_config(cfg: EngineConfig, max_model_len: int) -> Buckets:
        """Buckets from the config, with defaults derived from the limits where left empty."""
        max_pages = math.ceil(max_model_len / cfg.page_size)
        batch = cfg.batch_buckets or _powers(1, cfg.max_num_seqs)
        tokens = cfg.token_buckets or _powers(min(16, cfg.max_num_batched_tokens), min(256, cfg.max_num_batched_tokens))
        # A chunk never exceeds the context, so longer chunk buckets would never be used.
        tokens = tuple(t for t in tokens if t < max_pages * cfg.page_size) or (tokens[0],)
        pages = tuple(p for p in (cfg.page_buckets or _powers(min(4, max_pages), max_pages, 4)) if p < max_pages)
        return Buckets(batch=tuple(batch), tokens=tuple(tokens), pages=(*pages, max_pages), page_size=cfg.page_size)

    @property
    def max_chunk(self) -> int:
        """Longest prefill chunk."""
        return self.tokens[-1]

    @staticmethod
    def fit(options: tuple[int, ...], n: int) -> int:
        """The smallest bucket >= n."""
        i = bisect.bisect_left(options, n)
        if i == len(options):
            raise ValueError(f"{n} exceeds the largest bucket {options[-1]}")
        return options[i]

    def prefill_pages(self, num_pages: int, tokens: int) -> int:
        """Page-table width for a chunk of ``tokens`` (bucketed) over ``num_pages`` pages: wide enough for both."""
        return self.fit(self.pages, max(num_pages, -(-tokens // self.page_size)))

    def shapes(self) -> list[tuple[int, int, int]]:
        """Every (rows, tokens per row, pages per row) a step can have: the warmup list."""
        decode = [(b, 1, p) for p in self.pages for b in self.batch]
        prefill = sorted({(1, t, self.prefill_pages(p, t)) for p in self.pages for t in self.tokens})
        return decode + prefill
