"""The rotation a quantized KV cache stores its keys in: an orthonormal Hadamard transform of each
head vector, applied to the queries too, so every score ``q . k`` is unchanged.

Why: a quantized key carries an error on each of its elements (int8: a step of its token's largest
value; fp8: a few per cent of the element itself), and a score's error is the sum of
``q_c * k_c * error_c`` over the channels. A trained model's queries and keys put much of their
energy in the same few channels (the "massive values" of the low-frequency rotary pairs), so those
few products carry the score and its error. Rotated, every channel holds a mix of all of them:
``(H q) . (H k) = q . k`` exactly, while the error terms spread over all ``head_dim`` channels and
partly cancel. Measured on SmolLM2-135M, whole text of ``bench/data/perplexity.txt`` in windows of
2,048 (docs/performance.md, "Quantized KV cache"): the KL divergence of the next-token distribution
from the full-precision cache's falls from 0.0022 to 0.0008 (int8) and from 0.0167 to 0.0138
(fp8_e4m3); keys carry nearly all of fp8's loss (values alone: 0.0021), so values are stored as they
are.

The transform is Sylvester's Hadamard matrix over blocks of the largest power of two dividing
``head_dim`` (the whole vector for 64, 128 or 256), scaled by ``1/sqrt(block)``: orthonormal and
symmetric, so it is its own inverse. It runs after the rotary embedding (rope's pairwise rotations
do not commute with it) in ``paged_attention``, before the cache is written and whichever kernel
reads it, so every attention path sees rotated queries and keys alike. A cache in the model's own
dtype is not rotated: its keys are exact, and a rotation would only add rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


@functools.cache
def hadamard_block(head_dim: int) -> np.ndarray:
    """The orthonormal Hadamard block (float32) that ``rotate`` applies to ``head_dim``-wide heads:
    size the largest power of two dividing ``head_dim``."""
    size = head_dim & -head_dim
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < size:
        h = np.block([[h, h], [h, -h]])
    return h / np.float32(np.sqrt(size))


def rotate(x: jax.Array) -> jax.Array:
    """``x`` [..., head_dim] with each head vector rotated (computed in float32, returned in
    ``x``'s dtype). Applied twice it gives ``x`` back (to rounding)."""
    d = x.shape[-1]
    h = jnp.asarray(hadamard_block(d))
    blocks = x.astype(jnp.float32).reshape(*x.shape[:-1], d // h.shape[0], h.shape[0])
    # HIGHEST: a TPU's default float32 matmul would round the queries and keys to bfloat16.
    return jnp.matmul(blocks, h, precision=lax.Precision.HIGHEST).reshape(x.shape).astype(x.dtype)
