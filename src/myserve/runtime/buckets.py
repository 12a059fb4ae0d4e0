"""Static shapes by bucket: rows per call, prefill row width and page-table widths.

Every jitted step runs at one (rows, tokens per row, page width) shape from these sets, so the
number of compilations is fixed and all of them happen at warmup. A decode call is ``[rows, 1]``
with its rows' pages read per group of ``decode_group`` rows; a prefill call is
``[rows, row_tokens]``: each prefill chunk is cut into rows of ``row_tokens`` prompt tokens, and
all the rows of a step go into as few calls as possible. Page widths are powers of two by default
(the attention reads every page of the width, so coarser buckets cost more at run time).
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
    """Decode rows per call."""
    prefill_rows: tuple[int, ...]
    """Prefill rows per call; the largest holds a whole step's token budget."""
    row_tokens: int
    """Prompt tokens per prefill row."""
    pages: tuple[int, ...]
    """Page-table widths; the largest covers ``max_model_len``."""
    page_size: int
    decode_group: int = 1
    """Decode rows whose pages are read together (grouped layout); 1 = each row its own pages."""

    @staticmethod
    def from_config(cfg: EngineConfig, max_model_len: int, min_rows: int = 1, decode_group: int = 1) -> Buckets:
        """Buckets from the config, with defaults derived from the limits where left empty.

        ``min_rows``: decode calls are padded to at least this many rows (int8 matmuls are slow below 8).
        ``decode_group``: rows per group of the grouped decode layout (1 = rows layout).
        """
        max_pages = math.ceil(max_model_len / cfg.page_size)
        rows = cfg.batch_buckets or _powers(1, cfg.max_num_seqs)
        # Prefill calls have row_tokens tokens per row, so they never need min_rows rows.
        max_rows = math.ceil(cfg.max_num_batched_tokens / cfg.prefill_row_tokens)
        prefill_rows = tuple(sorted({b for b in rows if b < max_rows} | {max_rows}))
        batch = tuple(sorted({max(b, min(min_rows, rows[-1])) for b in rows}))
        pages = tuple(p for p in (cfg.page_buckets or _powers(min(4, max_pages), max_pages)) if p < max_pages)
        return Buckets(
            batch=tuple(batch),
            prefill_rows=prefill_rows,
            row_tokens=min(cfg.prefill_row_tokens, max_model_len),
            pages=(*pages, max_pages),
            page_size=cfg.page_size,
            decode_group=decode_group,
        )

    @staticmethod
    def fit(options: tuple[int, ...], n: int) -> int:
        """The smallest bucket >= n."""
        i = bisect.bisect_left(options, n)
        if i == len(options):
            raise ValueError(f"{n} exceeds the largest bucket {options[-1]}")
        return options[i]

    def group_size(self, rows: int) -> int:
        """Rows per group of a decode call of ``rows`` rows."""
        return min(self.decode_group, rows)

    def decode_widths(self, rows: int) -> tuple[int, ...]:
        """Page widths of a decode call of ``rows`` rows: per group, so the row widths times its size.

        Grouped calls also get the midpoint between each two consecutive widths (1.5x steps instead
        of 2x): their attention reads every slot of the width, and at 32 decodes of 300 tokens
        (38 pages per pair) a width of 48 instead of 64 made the whole step 17 % faster (395 -> 329 ms).
        """
        g = self.group_size(rows)
        widths = [g * p for p in self.pages]
        if g > 1:
            widths += [(a + b) // 2 for a, b in zip(widths, widths[1:], strict=False) if b - a >= 4]
        return tuple(sorted(set(widths)))

    def shapes(self) -> list[tuple[int, int, int]]:
        """Every (rows, tokens per row, page width) a step can have: the warmup list.

        The width is per row for prefill calls and per group of rows for decode calls.
        """
        decode = [(b, 1, w) for b in self.batch for w in self.decode_widths(b)]
        prefill = [(r, self.row_tokens, p) for p in self.pages for r in self.prefill_rows]
        return decode + prefill
