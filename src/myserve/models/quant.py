"""int8 weight and activation quantization (W8A8, ``model.quantization: w8a8``) for the model's matmuls.

Weights are quantized once at load time, symmetric per output channel: ``w = q * scale`` with
``q`` int8 and ``scale`` = max |w| over the contracted axes / 127. Activations are quantized on the
fly, symmetric per token. The product runs as an int8 x int8 -> int32 dot, then both scales are
applied in float32.

Why activations too: XLA:CPU has fast int8 GEMMs (VNNI) but no fused int8-weight/float-activation
dot; dequantizing the weight first would materialize it in float32 every step (slower than plain
float32). Measured for a [32, 576] x [576, 3072] matmul on the 2-core reference machine: float32
1.1 ms, W8A8 0.33 ms. Below 8 rows XLA takes a slow int8 path, so quantized engines pad decode
batches to at least 8 rows (``runtime/buckets.py``).
"""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax.numpy as jnp
import numpy as np
from haliax import Axis, NamedArray

from myserve.models.dense_dot import dense_dot
from myserve.models.narrow import NarrowWeight

MIN_ROWS = 8
"""Smallest row count worth giving an int8 matmul (fewer rows take a much slower kernel)."""


class QuantizedWeight(eqx.Module):
    """An int8 weight with float32 scales per output channel."""

    q: NamedArray
    """int8, the float weight's axes."""
    scale: NamedArray
    """float32 over the output (non-contracted) axes."""

    def matmul(self, x: NamedArray, axis: Axis | tuple[Axis, ...]) -> NamedArray:
        """``x`` contracted with this weight over ``axis``: float32, like the float32 dot it replaces."""
        xf = x.astype(jnp.float32)
        sx = hax.maximum(hax.max(hax.abs(xf), axis=axis), 1e-12) / 127.0
        xq = hax.round(xf / sx).astype(jnp.int8)
        acc = hax.dot(xq, self.q, axis=axis, preferred_element_type=jnp.int32)
        return acc.astype(jnp.float32) * sx * self.scale


def quantize(w: np.ndarray, contracted: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Host-side per-channel int8 quantization: (q int8 like ``w``, scale float32 without ``contracted``)."""
    w = w.astype(np.float32)
    scale = np.max(np.abs(w), axis=contracted, keepdims=True) / 127.0
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return q, np.squeeze(scale, axis=contracted)


def linear(x: NamedArray, w: NamedArray | QuantizedWeight | NarrowWeight, axis: Axis | tuple[Axis, ...]) -> NamedArray:
    """``x`` contracted with a float, W8A8 or narrow (weight-only) weight over ``axis``."""
    if isinstance(w, QuantizedWeight | NarrowWeight):
        return w.matmul(x, axis)
    return dense_dot(x, w, axis)
