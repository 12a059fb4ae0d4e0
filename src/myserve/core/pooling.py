"""An embedding request's vector, from the pooled sums its steps read back.

Each step returns, per chunk of an embedding request, the sum of the final hidden states of the
chunk's pooled tokens (``Sequence.pool_range``: every token for mean pooling, the prompt's last
for last-token pooling, the first for CLS). Once the chunk that ends the prompt is read, the
engine core makes the vector here: the mean divides the chain of chunk sums by the prompt's
length, then Matryoshka truncation and L2 normalization apply. Host numpy, no JAX.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from myserve.core.sequence import Sequence
from myserve.wire.pooling import Pooler


def finished_embeddings(
    pooled: Iterable[tuple[Sequence, int, int, np.ndarray | None]], pooler: Pooler | None
) -> Iterator[tuple[Sequence, bytes]]:
    """A read step's embedding chunks (``StepResults.pooled``) recorded; each sequence whose
    prompt they completed, with its vector. Chunks of a sequence aborted meanwhile are dropped."""
    for seq, start, n, vector in pooled:
        if seq.finish_reason is None and record_pooled(seq, start, n, vector):
            assert pooler is not None, "an embedding request was validated against the pooler"
            yield seq, embedding(seq, pooler)


def record_pooled(seq: Sequence, start: int, n: int, pooled: np.ndarray | None) -> bool:
    """Keep a chunk's pooled sum (None: none of its tokens pools); True when the chunk ended the
    prompt (the vector can be made)."""
    if pooled is not None:
        seq.pool_parts[start] = (n, np.asarray(pooled, np.float32))
    return start + n == len(seq.prompt_ids)


def embedding(seq: Sequence, pooler: Pooler) -> bytes:
    """The finished vector of ``seq`` (every chunk read), as little-endian float32 bytes."""
    length = len(seq.prompt_ids)
    if seq.pool_type == "mean":
        # Walk the chunks from the prompt's start: after a preemption the recomputed chunks
        # replace the old ones at the same starts, and any chain of them sums the same tokens.
        total, at = np.zeros_like(next(iter(seq.pool_parts.values()))[1]), 0
        while at < length:
            n, part = seq.pool_parts[at]
            total += part
            at += n
        vector = total / length
    elif seq.pool_type == "cls":
        vector = seq.pool_parts[0][1]
    else:  # last: the chunk that ended the prompt (the only one that pools)
        vector = seq.pool_parts[max(seq.pool_parts)][1]
    params = seq.params.pooling
    assert params is not None
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    normalize = pooler.normalize if params.normalize is None else params.normalize
    if normalize:
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    return np.asarray(vector, "<f4").tobytes()
