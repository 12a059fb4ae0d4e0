"""A float weight's product, with a one-row bfloat16 product on CPU computed as two rows.

XLA:CPU lowers a dot whose activations have one row to Eigen's matrix-vector product, and that
kernel has no fast bfloat16 path: on the reference machine (AVX512-BF16) a one-row
[576] x [576, 49152] head took 45.7 ms in bfloat16 against 5.9 ms as two rows and 5.0 ms in float32
(a [576] x [576, 1536] projection 0.30 against 0.11). With a row of zeros beside it the same row takes
the matrix-matrix kernel, whose result for a row does not depend on how many rows it shares the
product with (checked bit for bit against a 32-row product): so a one-stream decode is as fast as
float32 and its tokens are those the row gets in any batch. Every other dot is ``hax.dot`` as is.
"""

from __future__ import annotations

import haliax as hax
import jax
import jax.numpy as jnp
from haliax import Axis, NamedArray
from jax.typing import DTypeLike

PADDED_ROWS = 2
"""Rows a one-row bfloat16 product on CPU is computed as (two take the matrix-matrix kernel)."""


def dense_dot(
    x: NamedArray, w: NamedArray, axis: Axis | tuple[Axis, ...], preferred_element_type: DTypeLike | None = None
) -> NamedArray:
    """``hax.dot(x, w, axis=axis)``: activations ``x`` contracted with a float weight ``w``."""

    def dot(a: NamedArray, b: NamedArray) -> NamedArray:
        return hax.dot(a, b, axis=axis, preferred_element_type=preferred_element_type)

    row = _single_row_axis(x, axis)
    if row is None:
        return dot(x, w)
    wide = hax.named(jnp.pad(x.array, [(0, PADDED_ROWS - 1) if a == row else (0, 0) for a in x.axes]), _resized(x, row))
    return dot(wide, w)[row.name, 0:1].rearrange(jax.eval_shape(dot, x, w).axes)


def _single_row_axis(x: NamedArray, axis: Axis | tuple[Axis, ...]) -> Axis | None:
    """The axis to widen when ``x`` is one bfloat16 row on a CPU backend, else None."""
    if x.dtype != jnp.bfloat16 or jax.default_backend() != "cpu":
        return None
    contracted = {a.name for a in ((axis,) if isinstance(axis, Axis) else axis)}
    rows = [a for a in x.axes if a.name not in contracted]
    if not rows or any(a.size != 1 for a in rows):
        return None
    return rows[0]


def _resized(x: NamedArray, row: Axis) -> tuple[Axis, ...]:
    return tuple(a.resize(PADDED_ROWS) if a == row else a for a in x.axes)
