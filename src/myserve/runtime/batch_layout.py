"""Host-side layout of padded rows and their attention metadata (``PageBatch``, numpy): the
layout of ``python -m myserve.generate`` and the parity tests. The serving engine lays its steps
out ragged (``runtime/step_layout.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding

from myserve.ops.paged_attention import PageBatch


@dataclasses.dataclass(frozen=True)
class Entry:
    """One row's content: its new tokens starting at position ``start``, and its sequence's pages."""

    token_ids: Sequence[int]
    start: int
    pages: Sequence[int]


@dataclasses.dataclass
class HostBatch:
    """Numpy arrays of one call; ``device()`` turns them into the jitted step's inputs."""

    tokens: np.ndarray  # [B, T]
    positions: np.ndarray  # [B, T]
    q_lens: np.ndarray  # [B]
    kv_lens: np.ndarray  # [B]
    write_pages: np.ndarray  # [B, T]
    page_table: np.ndarray  # [B, P] or [B, 0]

    def pack(self) -> tuple[np.ndarray, tuple[tuple[int, ...], ...]]:
        """Every array packed into one int32 vector (one transfer), and their shapes (see ``upload``)."""
        arrays = (
            self.tokens,
            self.positions,
            self.q_lens,
            self.kv_lens,
            self.write_pages,
            self.page_table,
        )
        return np.concatenate([a.ravel() for a in arrays]), tuple(a.shape for a in arrays)

    def device(self) -> tuple[jax.Array, PageBatch]:
        """(tokens, PageBatch) as device arrays."""
        return upload(*self.pack())


@functools.partial(jax.jit, static_argnums=(1, 2))
def upload(
    flat: jax.Array, shapes: tuple[tuple[int, ...], ...], sharding: NamedSharding | None = None
) -> tuple[jax.Array, PageBatch]:
    """(tokens, PageBatch) cut back out of ``HostBatch.pack``'s vector, on the device.

    ``jnp.asarray`` per array goes through JAX's Python dispatch and a transfer of its own (~0.2 ms
    each on a GPU; 23 per decode step measured on an H100, most of a 1B model's single-request step).
    ``sharding`` (the executor's replicated sharding) commits the results to the mesh like the
    arrays steps compute on the device, so a step's executables are the same whether its metadata
    came from the host or partly from an earlier step (multi-step decode): jit keys on that.
    """
    parts, at = [], 0
    for shape in shapes:
        size = math.prod(shape)
        part = flat[at : at + size].reshape(shape)
        parts.append(part if sharding is None else jax.lax.with_sharding_constraint(part, sharding))
        at += size
    return parts[0], PageBatch(*parts[1:])


def _tokens(entries: Sequence[Entry | None], rows: int, tokens_per_row: int, page_size: int) -> HostBatch:
    tokens = np.zeros((rows, tokens_per_row), np.int32)
    positions = np.zeros((rows, tokens_per_row), np.int32)
    q_lens = np.zeros(rows, np.int32)
    kv_lens = np.zeros(rows, np.int32)
    write_pages = np.zeros((rows, tokens_per_row), np.int32)
    for i, e in enumerate(entries):
        if e is None:
            continue
        n = len(e.token_ids)
        tokens[i, :n] = e.token_ids
        positions[i] = e.start + np.arange(tokens_per_row)
        q_lens[i] = n
        kv_lens[i] = e.start + n
        write_pages[i, :n] = np.asarray(e.pages)[positions[i, :n] // page_size]
    return HostBatch(tokens, positions, q_lens, kv_lens, write_pages, np.zeros((rows, 0), np.int32))


def row_batch(
    entries: Sequence[Entry | None], *, rows: int, tokens_per_row: int, width: int, page_size: int
) -> HostBatch:
    """Rows layout: ``rows`` rows (None or missing = padding), page tables ``width`` wide."""
    host = _tokens(entries, rows, tokens_per_row, page_size)
    host.page_table = np.zeros((rows, width), np.int32)
    for i, e in enumerate(entries):
        if e is not None:
            host.page_table[i, : len(e.pages)] = e.pages
    return host
