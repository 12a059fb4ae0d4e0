"""Matmul weights kept narrow on device: int8 or int4 codes with group scales (weight-only).

``model.quantization: int8 | int4`` stores every dense and expert matmul weight, the LM head and
the embedding table as a ``NarrowWeight``; activations stay in the model dtype. A matmul
dequantizes the weight inside the step and contracts it as the float weight would be
(``ops/dequant.py`` holds the layout and the arithmetic), so the code of a layer does not change
with the quantization, and the result equals a dequantize-then-float32 reference of the same
weights to float32 rounding (``tests/test_narrow_weights.py``).

The codes keep the float weight's output axes (and its leading ones, a MoE layer's experts), so
they shard by the same rules; the contracted axes are flattened into groups, whose axis takes the
name of the first contracted axis (the one a rule may shard: ``kv_heads`` of ``o_proj``, ``mlp``
of ``down_proj``, ``expert_mlp`` of an expert's down projection), so a weight split along its
contracted axis keeps each device's groups with the rows it holds.
"""

from __future__ import annotations

import math

import equinox as eqx
import haliax as hax
import jax.numpy as jnp
from haliax import Axis, NamedArray

from myserve.models.dense_dot import dense_dot
from myserve.ops import gpu_grouped_matmul
from myserve.ops.dequant import StackedNarrow, dequantize

GROUP_AXIS = "group"
"""The name of the axis of a group's codes (never sharded)."""


class NarrowWeight(eqx.Module):
    """A weight-only quantized matmul weight (``ops/dequant.py`` describes the layout)."""

    codes: NamedArray  # (*lead, groups, group, *out): int8, or uint8 holding two 4-bit codes
    scale: NamedArray  # (*lead, groups, *out)
    offset: NamedArray | None  # like scale; None: symmetric
    bits: int = eqx.field(static=True)
    in_axes: tuple[Axis, ...] = eqx.field(static=True)
    """The float weight's contracted axes, in the order they are flattened."""
    n_lead: int = eqx.field(static=True, default=0)
    dtype: jnp.dtype = eqx.field(static=True, default=jnp.dtype(jnp.float32))
    """The model dtype: what the weight dequantizes to."""
    kernel: bool = eqx.field(static=True, default=False)
    """Matmuls run the GPU grouped matmul kernel (``ops/gpu_grouped_matmul.py``), the codes read as
    stored and widened in registers (``engine.quantized_matmul: pallas``); False: dequantized by XLA."""

    @property
    def lead_axes(self) -> tuple[Axis, ...]:
        """Axes before the contracted ones (a MoE layer's experts)."""
        return self.scale.axes[: self.n_lead]

    @property
    def out_axes(self) -> tuple[Axis, ...]:
        """The float weight's output axes."""
        return self.scale.axes[self.n_lead + 1 :]

    def dequantize(self, dtype: jnp.dtype | None = None) -> NamedArray:
        """The float weight with its original axes (lead, contracted, output), in ``dtype`` (default:
        the model dtype)."""
        out = self.out_axes
        raw = dequantize(
            self.codes.array,
            self.scale.array,
            None if self.offset is None else self.offset.array,
            self.bits,
            len(out),
            dtype or self.dtype,
        )
        axes = (*self.lead_axes, *self.in_axes, *out)
        return hax.named(raw.reshape(tuple(a.size for a in axes)), axes)

    def matmul(self, x: NamedArray, axis: Axis | tuple[Axis, ...], out_dtype: jnp.dtype | None = None) -> NamedArray:
        """``x`` contracted with this weight over ``axis`` (the dequantized weight in x's dtype, or
        the kernel's product of the codes as stored)."""
        if self.kernel and self.n_lead == 0:
            out = self._kernel_matmul(x, out_dtype)
            if out is not None:
                return out
        return dense_dot(x, self.dequantize(x.dtype), axis, preferred_element_type=out_dtype)

    def _kernel_matmul(self, x: NamedArray, out_dtype: jnp.dtype | None) -> NamedArray | None:
        """The kernel's product, or None where the weight's blocks do not suit it (``dense_fits``)."""
        names = {a.name for a in self.in_axes}
        batch = tuple(a for a in x.axes if a.name not in names)
        k = math.prod(a.size for a in self.in_axes)
        groups, group = self.codes.array.shape[:2]
        n = math.prod(a.size for a in self.out_axes)
        offset = None if self.offset is None else self.offset.array.reshape(1, groups, n)
        stack = StackedNarrow(
            self.codes.array.reshape(1, groups, group, n), self.scale.array.reshape(1, groups, n), offset,
            self.bits, 1, x.dtype,
        )  # fmt: skip
        if not gpu_grouped_matmul.dense_fits(stack):
            return None
        rows = x.rearrange((*batch, *self.in_axes)).array.reshape(-1, k)
        y = gpu_grouped_matmul.dense_matmul(rows, stack).astype(out_dtype or x.dtype)
        return hax.named(
            y.reshape(*(a.size for a in batch), *(a.size for a in self.out_axes)), (*batch, *self.out_axes)
        )

    def take(self, axis: Axis, index: NamedArray) -> NamedArray:
        """Rows ``index`` of output axis ``axis``, dequantized: an embedding lookup of a table stored
        for the LM head (contracted ``embed``, output ``vocab``). Only the rows looked up widen."""
        codes = self.codes.take(axis.name, index)
        scale = self.scale.take(axis.name, index)
        offset = None if self.offset is None else self.offset.take(axis.name, index)
        picked = NarrowWeight(codes, scale, offset, self.bits, self.in_axes, self.n_lead, self.dtype, self.kernel)
        return picked.dequantize()

    @property
    def nbytes(self) -> int:
        """Device bytes of codes, scales and offsets (all shards)."""
        parts = (self.codes, self.scale, self.offset)
        return sum(p.array.size * p.array.dtype.itemsize for p in parts if p is not None)
