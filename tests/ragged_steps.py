"""Ragged steps for the tests: a mixed step for the attention tests (decode tokens beside prefill
chunks), and the served step's logits of a sequence fed in chunks, for the parity tests."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from myserve.runtime.model_step import StepLogits
from myserve.runtime.step_arrays import unpack_step
from myserve.runtime.step_layout import Span, StepShape, layout

MIXED = [(2, 1), (16, 1), (0, 7), (24, 13), (38, 1), (5, 3)]
"""(context before this step, tokens this step) per sequence: decode tokens, a prefill chunk after
cached context, chunks cut into several 4-token blocks and one not a multiple of the block size."""


def device_batch(spans: Sequence[Span], shape: StepShape, page_size: int) -> Any:
    """The device's unpacked ``RaggedBatch`` of ``spans`` laid out in ``shape``."""
    _, batch, *_ = unpack_step(jnp.asarray(layout(spans, shape, page_size).pack()), shape)
    return batch


def mixed_step(
    rng: np.random.RandomState, n_pages: int, ps: int, seqs: list[tuple[int, int]] = MIXED, first_page: int = 0
) -> tuple[StepShape, list[Span], Any]:
    """``seqs`` on scrambled pages (from ``first_page`` on) as one 32-token step (2-page context
    chunks, so the context loop runs several times): its shape, the spans and the device's unpacked
    ``RaggedBatch``."""
    perm = [first_page + int(p) for p in rng.permutation(n_pages - first_page)]
    spans, used = [], 0
    for before, n in seqs:
        pages = perm[used : used + -(-(before + n) // ps)]
        used += len(pages)
        spans.append(Span([0] * n, before, pages, samples=True))
    shape = StepShape.of(32, max_num_seqs=8, block_tokens=4, max_pages=12, chunk_pages=2)
    return shape, spans, device_batch(spans, shape, ps)


def shape_for(tokens: int, *, max_pages: int, block_tokens: int = 8, chunk_pages: int = 2) -> StepShape:
    """The step shape of a ``tokens``-token bucket (8-token blocks and 2-page context chunks by
    default: small, so a short sequence runs several blocks and several context-loop iterations)."""
    return StepShape.of(
        tokens, max_num_seqs=8, block_tokens=min(block_tokens, tokens), max_pages=max_pages, chunk_pages=chunk_pages
    )


def chunked_logits(
    forward: StepLogits, cache: Any, ids: Sequence[int], pages: Sequence[int], chunks: Sequence[int]
) -> tuple[np.ndarray, Any]:
    """The served step's logits [len(ids), V] of one sequence on ``pages``, fed one step per chunk
    (``chunks``: tokens per step, summing to ``len(ids)``; a chunk's step is padded to its bucket),
    and the cache."""
    out, done = [], 0
    for n in chunks:
        spans = [Span(list(ids[done : done + n]), done, list(pages), samples=True)]
        logits, cache = forward(cache, spans, shape_for(_bucket(n), max_pages=len(pages)))
        out.append(logits)
        done += n
    assert done == len(ids)
    return np.concatenate(out), cache


def _bucket(n: int) -> int:
    """The power of two at or above ``n``: steps are padded to a few token buckets, as served."""
    return 1 << max(0, (n - 1).bit_length())


def cuda_target() -> contextlib.AbstractContextManager[object]:
    """Where Pallas's Triton lowering reads its GPU: since jax 0.11 it asks the device it lowers for
    (a compute capability) and, with no GPU here, needs an abstract one: an H100's. Before, it
    lowered without asking."""
    if not hasattr(jax.sharding, "AbstractDevice"):
        return contextlib.nullcontext()
    h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h100))
