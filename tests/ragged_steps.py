"""A mixed ragged step for the attention tests: decode tokens beside prefill chunks."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from myserve.runtime.step_layout import Span, StepShape, layout, unpack

MIXED = [(2, 1), (16, 1), (0, 7), (24, 13), (38, 1), (5, 3)]
"""(context before this step, tokens this step) per sequence: decode tokens, a prefill chunk after
cached context, chunks cut into several 4-token blocks and one not a multiple of the block size."""


def mixed_step(
    rng: np.random.RandomState, n_pages: int, ps: int, seqs: list[tuple[int, int]] = MIXED
) -> tuple[StepShape, list[Span], Any]:
    """``seqs`` on scrambled pages as one 32-token step (2-page context chunks, so the context loop
    runs several times): its shape, the spans and the device's unpacked ``RaggedBatch``."""
    perm = [int(p) for p in rng.permutation(n_pages)]
    spans, used = [], 0
    for before, n in seqs:
        pages = perm[used : used + -(-(before + n) // ps)]
        used += len(pages)
        spans.append(Span([0] * n, before, pages, samples=True))
    shape = StepShape.of(32, max_num_seqs=8, block_tokens=4, max_pages=12, chunk_pages=2)
    _, batch, _, _, _ = unpack(jnp.asarray(layout(spans, shape, ps).pack()), shape)
    return shape, spans, batch
