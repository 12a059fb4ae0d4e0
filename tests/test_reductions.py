"""Sums and maxima folded for XLA:CPU (``ops/reductions.py``): the same values as numpy's, and, for
a small array, one fused op instead of XLA:CPU's reduce-window and reduce."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from myserve.ops.reductions import FOLD_MAX_ELEMENTS, fused_max, fused_mean, fused_sum


@pytest.mark.parametrize(
    "shape, axis", [((1, 64), -1), ((3, 576), 1), ((2, 1, 512, 2), 2), ((5, 35), 1), ((4, 4096), 1)]
)
def test_folded_reductions_equal_numpy(shape, axis) -> None:
    x = np.random.RandomState(0).randn(*shape).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(fused_max(jnp.asarray(x), axis)), x.max(axis=axis))
    np.testing.assert_allclose(
        np.asarray(fused_sum(jnp.asarray(x), axis, keepdims=True)),
        x.sum(axis=axis, keepdims=True),
        rtol=1e-5,
        atol=1e-5,
    )
    np.testing.assert_allclose(np.asarray(fused_mean(jnp.asarray(x), axis)), x.mean(axis=axis), rtol=1e-5, atol=1e-6)


def _ops(fn, *args) -> list[str]:
    """The names of the ops (fusions, slices, ...) of ``fn``'s compiled entry computation."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    entry = text[text.index("\nENTRY") :]
    lines = [
        line
        for line in entry.splitlines()[1:]
        if " = " in line and "parameter(" not in line and "constant(" not in line
    ]
    return [re.sub(r"\.\d+$", "", line.split(" = ")[0].split("%")[-1]) for line in lines]


def test_a_one_row_rms_norm_is_one_reduction_without_reduce_window() -> None:
    """XLA:CPU splits a plain 64-wide sum into a reduce-window and a reduce; the folded one is not split."""
    x = jnp.ones((1, 64), jnp.float32)
    plain = _ops(lambda x: jax.lax.rsqrt(jnp.mean(x * x, axis=-1)), x)
    folded = _ops(lambda x: jax.lax.rsqrt(fused_mean(x * x, -1)), x)
    assert any("reduce-window" in op for op in plain)
    assert len(folded) == 1 and "reduce-window" not in folded[0], folded


def test_large_arrays_are_not_folded() -> None:
    """Past ``FOLD_MAX_ELEMENTS`` the reduction is left as written (XLA:CPU runs those whole)."""
    x = jnp.ones((FOLD_MAX_ELEMENTS // 64 + 1, 64), jnp.float32)
    assert not any("slice" in op for op in _ops(lambda x: fused_sum(x, 1), x))
