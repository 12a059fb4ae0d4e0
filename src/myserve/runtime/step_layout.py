"""Host-side layout of one ragged step: the flat token batch and its attention views, packed.

Plain numpy, built by the runner from the scheduler's chunks (``Span``) and packed into one int32
vector (one transfer per step); ``runtime/step_arrays.py`` cuts it back into device arrays inside
the jitted step. No JAX here: the core plans steps with it.
The shapes depend on the step's token bucket only (``StepShape``), so every step with the same
padded token count runs the same executable whatever its mix of prefill and decode.

Layout (see ``ops/ragged_attention.py``): spans are laid out in order, their tokens contiguous in
the flat batch. A one-token span (a decode, or a sibling's last prompt token) is a row of the
single view; a longer span is cut into blocks of ``block_tokens`` tokens of the block view. A
span that ends its sequence's known tokens samples: its last token's hidden state goes through the
LM head and the sampler, as sampling row ``k`` for the ``k``-th such span. A token sampled by
the step still in flight is fed on the device: ``feed`` names the previous step's sampling row.
An embedding request's span pools instead of sampling: ``pool_rows`` gives each of its pooled
tokens the span's index, and the step sums those tokens' final hidden states into that row.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The static dimensions of one step executable."""

    tokens: int
    """T: padded flat tokens."""
    singles: int
    """N1: rows of the single view; also the sampling rows (at most one per sequence)."""
    blocks: int
    """N2: blocks of the block view."""
    block_tokens: int
    """Q: query tokens per block."""
    width: int
    """W: page-table width of every row (a multiple of ``chunk_pages``)."""
    chunk_pages: int
    """Pages read per iteration of the attention's context loop."""

    @staticmethod
    def of(tokens: int, *, max_num_seqs: int, block_tokens: int, max_pages: int, chunk_pages: int) -> StepShape:
        """The shape of the ``tokens`` bucket.

        Blocks: a span's tokens round up to whole blocks, so the view holds twice the blocks that
        ``tokens`` fill (the scheduler caps a step's prefill chunks at ``tokens // block_tokens``
        so the largest bucket always fits); a one-token step has none.
        """
        blocks = 0 if tokens == 1 else max(1, 2 * (tokens // block_tokens))
        return StepShape(
            tokens=tokens,
            singles=min(tokens, max_num_seqs),
            blocks=blocks,
            block_tokens=block_tokens,
            width=-(-max_pages // chunk_pages) * chunk_pages,
            chunk_pages=chunk_pages,
        )

    def fits(self, num_tokens: int, num_singles: int, num_blocks: int) -> bool:
        """Whether a step of that many tokens, one-token spans and blocks fits this shape."""
        return num_tokens <= self.tokens and num_singles <= self.singles and num_blocks <= self.blocks

    def array_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Shapes of the packed arrays, in ``HostStep.arrays`` order."""
        t, n1, n2, q, w = self.tokens, self.singles, self.blocks, self.block_tokens, self.width
        return (
            (t,),  # tokens
            (1, t),  # positions
            (1,),  # q_lens
            (1, t),  # write_pages
            (n1, 1), (n1, 1), (n1,), (n1, w),  # single view: idx, positions, kv_lens, pages
            (n2, q), (n2, q), (n2,), (n2, w),  # block view
            (n1,),  # sample_idx
            (t,),  # following (scored prompt positions' next token, -1 elsewhere)
            (t,),  # feed (the previous step's sampling row whose token this token is, -1 elsewhere)
            (t,),  # pool_rows (the pooling row a token's hidden state is summed into, -1 elsewhere)
            (1, t),  # adapters (the LoRA slot of each token's sequence, -1: the base model)
            (1, t),  # rope offsets (M-RoPE: added to a token's position for its rotary one)
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Span:
    """One sequence's tokens in a step: ``token_ids`` at positions ``start..``, its pages, whether
    its last token samples, and (scored prompt rows) each position's following token."""

    token_ids: Sequence[int]
    start: int
    pages: Sequence[int]
    samples: bool
    following: Sequence[int] | None = None
    feed: int = -1
    """The span's last token is still in flight: the previous step's sampling row that samples it
    (the device takes it from there; ``token_ids`` holds a placeholder)."""
    pool: tuple[int, int] | None = None
    """An embedding request's span: the tokens (first, stop offsets in the span) whose final hidden
    states are summed into its pooling row (the span's index in the step)."""
    adapter: int = -1
    """The LoRA slot its tokens go through (-1: the base model)."""
    rope_offset: int = 0
    """Added to its tokens' positions for their rotary positions (M-RoPE after an image)."""
    sample_count: int = 1
    """Sampling rows of a span that samples: its last token's, or (a speculating decode) one per
    position of its draft as well, its last ``sample_count`` tokens'."""

    def blocks(self, block_tokens: int) -> int:
        """Blocks of ``block_tokens`` this span takes in the block view (0: it is a single-view row)."""
        n = len(self.token_ids)
        return 0 if n == 1 else -(-n // block_tokens)


def count(spans: Sequence[Span], block_tokens: int) -> tuple[int, int, int]:
    """(tokens, one-token spans, blocks) of a step: what its shape must hold."""
    tokens = sum(len(s.token_ids) for s in spans)
    singles = sum(1 for s in spans if len(s.token_ids) == 1)
    rows = sum(s.sample_count for s in spans if s.samples)  # the single view's N1 is the sampling rows too
    if any(s.pool is not None for s in spans):  # and the pooling rows: a pooled span's is its index
        rows = max(rows, len(spans))
    blocks = sum(s.blocks(block_tokens) for s in spans)
    return tokens, max(singles, rows), blocks


@dataclasses.dataclass
class HostStep:
    """The numpy arrays of one step (``StepShape.array_shapes`` order) and each span's sampling row."""

    arrays: list[np.ndarray]
    sample_rows: list[int | None]
    """Per span: its sampling row, or None when it does not sample."""
    scored: bool
    """Some span scores prompt positions (``following`` is used)."""
    pooled: bool = False
    """Some span pools (``pool_rows`` is used): the step's pooled rows are read back."""

    def pack(self) -> np.ndarray:
        """Every array in one int32 vector (one transfer)."""
        return np.concatenate([a.ravel() for a in self.arrays])


def layout(spans: Sequence[Span], shape: StepShape, page_size: int) -> HostStep:
    """Lay ``spans`` out in ``shape`` (which must fit them: ``StepShape.fits``).

    One-token spans (every decode row) are written in bulk, a few numpy calls for all of them: done
    span by span they cost ~7 us each, most of a 64-row step's planning on the host."""
    t, q, w = shape.tokens, shape.block_tokens, shape.width
    tokens = np.zeros(t, np.int32)
    positions = np.zeros(t, np.int32)
    write_pages = np.zeros(t, np.int32)
    s_idx = np.full((shape.singles, 1), t, np.int32)
    s_pos = np.zeros((shape.singles, 1), np.int32)
    s_kv = np.zeros(shape.singles, np.int32)
    s_pages = np.zeros((shape.singles, w), np.int32)
    b_idx = np.full((shape.blocks, q), t, np.int32)
    b_pos = np.zeros((shape.blocks, q), np.int32)
    b_kv = np.zeros(shape.blocks, np.int32)
    b_pages = np.zeros((shape.blocks, w), np.int32)
    sample_idx = np.zeros(shape.singles, np.int32)
    following = np.full(t, -1, np.int32)
    feed = np.full(t, -1, np.int32)
    pool_rows = np.full(t, -1, np.int32)
    adapters = np.full(t, -1, np.int32)
    rope = np.zeros(t, np.int32)
    lengths = [len(span.token_ids) for span in spans]
    ends = list(itertools.accumulate(lengths))  # flat index after each span
    singles = [i for i, n in enumerate(lengths) if n == 1]
    if singles:
        _lay_singles([spans[i] for i in singles], [ends[i] - 1 for i in singles], page_size, tokens, positions,
                     write_pages, s_idx, s_pos, s_kv, s_pages)  # fmt: skip
    n_block = 0
    scored = pooled = False
    for i, (span, n, end) in enumerate(zip(spans, lengths, ends, strict=True)):
        at = end - n
        if n > 1:
            pages = np.asarray(span.pages, np.int32)
            pos = np.arange(span.start, span.start + n, dtype=np.int32)
            tokens[at:end] = span.token_ids
            positions[at:end] = pos
            write_pages[at:end] = pages[pos // page_size]
            for k in range(0, n, q):
                m = min(q, n - k)
                b_idx[n_block, :m] = np.arange(at + k, at + k + m)
                b_pos[n_block, :m] = pos[k : k + m]
                b_kv[n_block] = span.start + n
                b_pages[n_block, : len(pages)] = pages
                n_block += 1
        if span.feed >= 0:
            feed[end - 1] = span.feed
        if span.adapter >= 0:
            adapters[at:end] = span.adapter
        if span.rope_offset:
            rope[at:end] = span.rope_offset
        if span.following is not None:
            following[at : at + len(span.following)] = span.following
            scored = True
        if span.pool is not None:
            # Row i < N1: a step holds at most one span per running sequence (max_num_seqs) and
            # at least one token per span.
            pool_rows[at + span.pool[0] : at + span.pool[1]] = i
            pooled = True
    sampling = [
        end - span.sample_count + j
        for span, end in zip(spans, ends, strict=True)
        if span.samples
        for j in range(span.sample_count)
    ]
    sample_idx[: len(sampling)] = sampling
    firsts = itertools.accumulate((s.sample_count for s in spans if s.samples), initial=0)
    sample_rows = [next(firsts) if span.samples else None for span in spans]
    arrays = [
        tokens, positions[None], np.array([ends[-1] if ends else 0], np.int32), write_pages[None],
        s_idx, s_pos, s_kv, s_pages, b_idx, b_pos, b_kv, b_pages, sample_idx, following, feed, pool_rows,
        adapters[None], rope[None],
    ]  # fmt: skip
    return HostStep(arrays, sample_rows, scored, pooled)


def _lay_singles(
    spans: list[Span],
    at: list[int],
    page_size: int,
    tokens: np.ndarray,
    positions: np.ndarray,
    write_pages: np.ndarray,
    s_idx: np.ndarray,
    s_pos: np.ndarray,
    s_kv: np.ndarray,
    s_pages: np.ndarray,
) -> None:
    """The one-token spans (flat indices ``at``): their tokens, and rows ``0..k-1`` of the single view."""
    k = len(spans)
    starts = np.fromiter((span.start for span in spans), np.int32, k)
    flat = np.asarray(at, np.int32)
    tokens[flat] = [span.token_ids[0] for span in spans]
    positions[flat] = starts
    write_pages[flat] = [span.pages[span.start // page_size] for span in spans]
    s_idx[:k, 0], s_pos[:k, 0], s_kv[:k] = flat, starts, starts + 1
    # Page tables of different lengths: scattered at once, by (row, column) of each page.
    lengths = np.fromiter((len(span.pages) for span in spans), np.int64, k)
    pages = np.fromiter(itertools.chain.from_iterable(span.pages for span in spans), np.int32, int(lengths.sum()))
    rows = np.repeat(np.arange(k), lengths)
    s_pages[rows, np.arange(len(pages)) - np.repeat(np.cumsum(lengths) - lengths, lengths)] = pages
