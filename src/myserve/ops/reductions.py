"""Sums and maxima that XLA:CPU runs as one fused op.

XLA:CPU rewrites every reduction over more than 32 elements into a ``reduce-window`` of 32 (an op
of its own, which fuses with nothing) followed by a reduce (its ``TreeReductionRewriter``, for
precision). A decode token's layer is dozens of tiny ops whose cost is their count, not their
bytes, and that rewrite adds two per reduction: an RMSNorm's sum of squares becomes a multiply, a
reduce-window and a reduce, where one fused reduction would do. Folding the axis in halves first
(``x[:n/2] + x[n/2:]``, elementwise, until 32 or fewer are left) gives a reduction the rewrite
leaves alone, and XLA fuses the folds, the reduce and their producers into one op: a pairwise sum,
as accurate as the rewrite's. On an accelerator the reduction emitters already do one pass, so the
plain reduction is kept there.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

REWRITE_WIDTH = 32
"""The longest reduction XLA:CPU's tree rewrite leaves as it is."""

FOLD_MAX_ELEMENTS = 2048
"""Only arrays this small are folded. XLA:CPU (JAX 0.12) hands larger reductions to YNNPACK whole
(one op, which a fold would split), or stops fusing the folds' slices into the reduce; an RMSNorm
or a decode row's softmax over up to 512 positions (a one-row decode step) is below it."""


def _fold(x: jax.Array, axis: int, combine: Callable[[jax.Array, jax.Array], jax.Array]) -> jax.Array:
    """``x`` with ``axis`` halved by ``combine`` until it is at most ``REWRITE_WIDTH`` long (or odd);
    ``x`` itself when it has more than ``FOLD_MAX_ELEMENTS`` elements."""
    axis = axis % x.ndim
    n = x.shape[axis]
    if x.size > FOLD_MAX_ELEMENTS:
        return x
    while n > REWRITE_WIDTH and n % 2 == 0:
        half = n // 2
        x = combine(lax.slice_in_dim(x, 0, half, axis=axis), lax.slice_in_dim(x, half, n, axis=axis))
        n = half
    return x


def _on_cpu() -> bool:
    return jax.default_backend() == "cpu"


def fused_sum(x: jax.Array, axis: int, keepdims: bool = False) -> jax.Array:
    """``x.sum(axis)``, as one fused op on XLA:CPU (a pairwise fold; rounding may differ in the last bit)."""
    if _on_cpu():
        x = _fold(x, axis, jnp.add)
    return x.sum(axis=axis, keepdims=keepdims)


def fused_max(x: jax.Array, axis: int, keepdims: bool = False) -> jax.Array:
    """``x.max(axis)``, as one fused op on XLA:CPU (exact: a maximum does not round)."""
    if _on_cpu():
        x = _fold(x, axis, jnp.maximum)
    return x.max(axis=axis, keepdims=keepdims)


def fused_mean(x: jax.Array, axis: int, keepdims: bool = False) -> jax.Array:
    """``x.mean(axis)`` through ``fused_sum``."""
    return fused_sum(x, axis, keepdims) / x.shape[axis]
