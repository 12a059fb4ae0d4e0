"""Host-side layout of one model call: token rows and their attention metadata (``PageBatch``).

Plain numpy, built by the runner from the scheduler's rows. Two context layouts (see
``ops/paged_attention.PageBatch``): rows, each with its own page table; or, for decode calls on
the reference backend, groups of ``g`` rows whose pages are concatenated. ``balance`` assigns
decode rows to groups so the groups' page counts are even: a call then reads about its rows' real
context, instead of every row padded to the longest (measured on SmolLM2 at 32 decodes with
contexts of 45-173 tokens: 5.8 -> 2.7 ms of attention per layer).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding

from myserve.ops.paged_attention import PageBatch

DECODE_GROUP = 2
"""Decode rows per group. Larger groups even out page counts better but every query of a group is
scored against all of the group's slots (compute grows with the group): measured per layer at 32
and 64 decodes, groups of 2 beat rows (1), 4 and 8."""


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
    group_pages: np.ndarray  # [B / g, PG] or [0, 0]
    slot_rows: np.ndarray  # [B / g, PG * page_size] or [0, 0]

    def pack(self) -> tuple[np.ndarray, tuple[tuple[int, ...], ...]]:
        """Every array packed into one int32 vector (one transfer), and their shapes (see ``upload``)."""
        arrays = (
            self.tokens,
            self.positions,
            self.q_lens,
            self.kv_lens,
            self.write_pages,
            self.page_table,
            self.group_pages,
            self.slot_rows,
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
    empty = np.zeros((0, 0), np.int32)
    return HostBatch(tokens, positions, q_lens, kv_lens, write_pages, np.zeros((rows, 0), np.int32), empty, empty)


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


def grouped_batch(entries: Sequence[Entry | None], *, group: int, group_width: int, page_size: int) -> HostBatch:
    """Grouped decode layout: ``entries`` (one token each, in group order, None = padding) in
    groups of ``group`` consecutive rows, each group's pages concatenated into ``group_width``."""
    rows = len(entries)
    host = _tokens(entries, rows, 1, page_size)
    n = rows // group
    host.group_pages = np.zeros((n, group_width), np.int32)
    host.slot_rows = np.full((n, group_width * page_size), -1, np.int32)
    for k in range(n):
        used = 0
        for j in range(group):
            e = entries[k * group + j]
            if e is None:
                continue
            m = len(e.pages)
            host.group_pages[k, used : used + m] = e.pages
            ctx = e.start + len(e.token_ids)
            host.slot_rows[k, used * page_size : used * page_size + ctx] = j
            used += m
    return host


def balance(page_counts: Sequence[int], rows: int, group: int) -> tuple[list[int | None], int]:
    """Assign entries to ``rows // group`` groups of ``group`` slots, evening out their page counts.

    Longest first, each into the open group with the fewest pages (LPT). Returns the slot order
    (entry index or None for padding), group-major, and the largest group's page count.
    """
    n = rows // group
    members: list[list[int]] = [[] for _ in range(n)]
    open_groups = [(0, k) for k in range(n)]  # (pages so far, group) of groups with a free slot
    for i in sorted(range(len(page_counts)), key=lambda i: -page_counts[i]):
        total, k = heapq.heappop(open_groups)
        members[k].append(i)
        if len(members[k]) < group:
            heapq.heappush(open_groups, (total + page_counts[i], k))
    order: list[int | None] = []
    for m in members:
        order.extend(m + [None] * (group - len(m)))
    return order, max((sum(page_counts[i] for i in m) for m in members), default=0)
