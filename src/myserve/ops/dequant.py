"""Weight-only quantized tensors as raw arrays, and their dequantization inside a step.

A quantized weight of logical shape ``[*lead, K, *out]`` (``K`` the contracted axis, flattened;
``lead`` e.g. a MoE layer's experts) is stored in groups of ``G`` consecutive elements along ``K``:

- ``codes`` ``[*lead, K / G, G / pack, *out]``: int8 codes (``pack`` 1), or two 4-bit codes per
  uint8 (``pack`` 2): the low nibbles are the group's first ``G / 2`` elements, the high nibbles
  its last ``G / 2`` (ggml's order within a block of 32, so GGUF's 4-bit blocks are kept byte for
  byte). ``jnp.int4`` is not used: XLA:CPU stores it one element per byte (measured: a 1024 x 1024
  int4 array occupies 1 MiB), so it would not halve anything.
- ``scale`` ``[*lead, K / G, *out]`` and optional ``offset`` (same shape), float16 or float32:
  ``w = code * scale + offset``. int8 from float checkpoints has one group per output channel
  (``G = K``) and no offset; int4 has ``G = 128`` with an offset (the group's minimum); GGUF blocks
  keep their own ``G`` (32, or 16 for Q6_K) and scales.

``dequantize`` is elementwise on the codes, for XLA to fuse into the matmul that consumes it;
XLA:CPU has no such fusion and writes the widened weight once per step, and on an H200 XLA widened
the codes in kernels of their own too (docs/performance.md, "Quantized weights"). On a GPU,
``ops/gpu_grouped_matmul.py`` reads this layout as stored and widens it in registers instead.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


def unpack_codes(codes: jax.Array, bits: int, group_axis: int) -> jax.Array:
    """Codes as one integer per element: int8 as they are; uint8 nibbles split along ``group_axis``
    (low nibbles first), 0..15. The split is a broadcast shift, not a concatenation: elementwise,
    so it vectorizes and fuses (a concatenate made XLA:CPU's loop ~2x slower)."""
    if bits == 8:
        return codes
    shifts = jnp.array([0, 4], jnp.uint8).reshape((2,) + (1,) * (codes.ndim - group_axis))
    nibbles = jnp.bitwise_and(jnp.right_shift(jnp.expand_dims(codes, group_axis), shifts), 0xF)
    shape = codes.shape
    return nibbles.reshape(*shape[:group_axis], 2 * shape[group_axis], *shape[group_axis + 1 :])


def dequantize(
    codes: jax.Array,
    scale: jax.Array,
    offset: jax.Array | None,
    bits: int,
    n_out: int,
    dtype: jnp.dtype,
) -> jax.Array:
    """The weight ``[*lead, K, *out]`` in ``dtype`` from its codes, scales and offsets (``n_out``: the
    number of output axes). The arithmetic is float32, as the reference it must equal."""
    group_axis = codes.ndim - n_out - 1
    values = unpack_codes(codes, bits, group_axis).astype(jnp.float32)
    w = values * jnp.expand_dims(scale.astype(jnp.float32), group_axis)
    if offset is not None:
        w = w + jnp.expand_dims(offset.astype(jnp.float32), group_axis)
    shape = w.shape
    k = shape[group_axis - 1] * shape[group_axis]
    return w.reshape(*shape[: group_axis - 1], k, *shape[group_axis + 1 :]).astype(dtype)


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["codes", "scale", "offset"], meta_fields=["bits", "n_out", "dtype"]
)
@dataclasses.dataclass(frozen=True)
class StackedNarrow:
    """A stack of narrow weights along a first axis (a MoE layer's experts) as raw arrays: what the
    grouped expert matmul (``ops/moe.py``) takes in place of a float ``[E, K, *out]`` stack, so each
    expert it runs is dequantized alone, when it runs."""

    codes: jax.Array  # [E, K / G, G / pack, *out]
    scale: jax.Array  # [E, K / G, *out]
    offset: jax.Array | None
    bits: int
    n_out: int
    dtype: jnp.dtype

    @property
    def num(self) -> int:
        """How many weights are stacked."""
        return int(self.codes.shape[0])

    def __getitem__(self, i: int | jax.Array) -> jax.Array:
        """Weight ``i`` dequantized: ``[K, *out]``."""
        offset = None if self.offset is None else self.offset[i]
        return dequantize(self.codes[i], self.scale[i], offset, self.bits, self.n_out, self.dtype)

    def full(self) -> jax.Array:
        """Every weight dequantized: ``[E, K, *out]``."""
        return dequantize(self.codes, self.scale, self.offset, self.bits, self.n_out, self.dtype)
