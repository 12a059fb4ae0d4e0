"""Rotary position embeddings (HF "rotate half" convention), with Llama 3.1 and linear frequency scaling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from myserve.models.spec import LayerKind, LinearRopeScaling


def inverse_frequencies(head_dim: int, kind: LayerKind) -> np.ndarray:
    """[head_dim // 2] float32 inverse frequencies of a layer of ``kind`` (its theta and scaling).

    Computed on the host in float64 then cast, matching transformers' float32 table.
    """
    dim = head_dim
    inv_freq = 1.0 / (kind.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    rs = kind.rope_scaling
    if rs is None:
        return inv_freq.astype(np.float32)
    if isinstance(rs, LinearRopeScaling):  # positions divided by the factor, i.e. the frequencies
        return (inv_freq.astype(np.float32) / np.float32(rs.factor)).astype(np.float32)
    # Llama 3.1: low frequencies are divided by `factor`, high ones kept, the band between blended.
    low_freq_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_freq_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def apply_rope(
    x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, mrope_section: tuple[int, ...] = ()
) -> jax.Array:
    """Rotate ``x`` [B, T, heads, head_dim] by its token positions [B, T]; with ``mrope_section``
    (M-RoPE), by three position streams [3, B, T] (temporal, height, width), the frequencies read
    them section by section in turn, as transformers' Qwen2.5-VL."""
    if mrope_section:
        stream = np.repeat(np.arange(len(mrope_section)) % 3, mrope_section)  # [D/2]: each frequency's stream
        picked = jnp.moveaxis(positions.astype(jnp.float32)[stream], 0, -1)  # [B, T, D/2]
        angles = picked * jnp.asarray(inv_freq)
    else:
        angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, D/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)
