"""A tied embedding table's copy for one-row logits on a CPU: the layout XLA:CPU reads fastest there.

A tied head multiplies by the embedding table, held (vocab, embed) for the lookup. XLA:CPU gives a
product with one row of activations to a matrix-vector kernel, and over (embed, vocab) rows that
kernel runs 1.7x faster than over (vocab, embed) ones at embed 64 (the host-bound yardstick's
49,152 x 64 head: 0.23 against 0.40 ms on the reference machine) and 1.1x at embed 576 (SmolLM2's:
4.35 against 4.78 ms): one stream's decode token is mostly that product on the yardstick. Products
of several rows go to YNNPACK, which packs the table itself, and at embed 576 runs 2-2.5x *slower*
from (embed, vocab) with 8 or 32 rows: so only one-row products read the copy
(``LlamaModel.logits``), and several rows keep the table (``docs/performance.md``, "The LM head's
layout on a CPU").

What it costs: a second table in memory. The copy is made on a CPU, for a float32 model (a
bfloat16 row is computed as two rows by ``dense_dot``, the matrix-matrix kernel) whose tied table
is at most ``MAX_COPY_BYTES``; never on an accelerator, whose memory goes to the KV cache and whose
matmul libraries pick their own layouts (not measured there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # no JAX here: the memory estimate (runtime/footprint.py) counts the copy without it
    from haliax import Axis, NamedArray
    from jax.sharding import Mesh
    from numpy.typing import DTypeLike

MAX_COPY_BYTES = 512 * 2**20
"""The largest tied table copied (bytes): SmolLM2's is 113 MB in float32; a 128k-token vocabulary
of width 2048 (1 GB) keeps one table, where the copy's memory outweighs a one-row head's gain."""


def row_head_bytes(cpu: bool, dtype: DTypeLike, vocab: int, embed: int) -> int:
    """Bytes of the one-row copy of a tied ``vocab`` x ``embed`` table in ``dtype`` (0: none is made)."""
    size = vocab * embed * np.dtype(dtype).itemsize
    return size if cpu and np.dtype(dtype) == np.float32 and size <= MAX_COPY_BYTES else 0


def wants_row_head(mesh: Mesh, dtype: DTypeLike, vocab: int, embed: int) -> bool:
    """Whether a model on ``mesh`` in ``dtype`` gets a one-row copy of its tied ``vocab`` x ``embed`` table."""
    cpu = all(d.platform == "cpu" for d in mesh.devices.flat)
    return row_head_bytes(cpu, dtype, vocab, embed) > 0


def one_row(hidden: NamedArray, contracted: Axis) -> bool:
    """Whether ``hidden`` is one row of activations over ``contracted`` (every other axis of size 1)."""
    return all(a.size == 1 for a in hidden.axes if a.name != contracted.name)
