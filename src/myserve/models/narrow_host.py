"""Building narrow weights on the host: quantizing float weights, and repacking GGUF blocks.

Both end in ``HostNarrow``: codes, scales and offsets in the device layout of ``ops/dequant.py``
(``[*lead, K / G, G / pack, *out]``), ready to place. Float weights (any checkpoint) are quantized
here: int8 symmetric, int4 asymmetric, per group of 128 along ``K`` (int4: scale = range / 15,
offset = the group's minimum; the group shrinks to the largest even divisor
of a device's share of ``K`` when 128 does not divide it, e.g. 96 for SmolLM2's 576).
GGUF blocks are not re-quantized: their codes and scales (``models/gguf_blocks.py``) go through
the same layout change as the float weight they stand for (``combine``), so a Q4_1 weight is on
device with the very codes and scales of the file.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from myserve.models.gguf_blocks import Blocks

QUANT_GROUP = 128
"""Elements per scale of weights quantized from float (GPTQ/AWQ checkpoints' usual group; int8 too:
one scale per output channel measured 1.1 % worse perplexity on SmolLM2, groups of 128 0.6 % better)."""


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """What a weight's narrow form looks like, known before reading it (for abstract loading)."""

    bits: int
    group: int
    offset: bool
    scale_dtype: np.dtype


def layout_of(parts: Sequence[BlockLayout], bits: int) -> BlockLayout:
    """The layout of a weight fusing ``parts`` (one per HF tensor) when ``bits`` are asked for:
    blocks of 8 bits (Q8_0, Q6_K) stay 8 bits whatever is asked; parts of one layout at that width
    are kept as the file holds them (float16 scales stay float16); otherwise the finest group,
    float32 scales, and offsets when any part has them or 4-bit codes widen (``c - 8``, offset
    ``8 * scale``)."""
    width = 8 if bits == 8 or any(p.bits == 8 for p in parts) else 4
    if all(p == parts[0] for p in parts) and parts[0].bits == width:
        return parts[0]
    offset = any(p.offset or p.bits != width for p in parts)
    return BlockLayout(width, min(p.group for p in parts), offset, np.dtype(np.float32))


def blocks_layout(b: Blocks) -> BlockLayout:
    """The layout of blocks read from a file."""
    return BlockLayout(b.bits, b.group, b.offset is not None, b.scale.dtype)


@dataclasses.dataclass(frozen=True)
class HostNarrow:
    """A narrow weight on the host, in the device layout (``ops/dequant.py``)."""

    codes: np.ndarray
    scale: np.ndarray
    offset: np.ndarray | None
    bits: int
    group: int


def group_size(k: int, shards: int, wanted: int) -> int:
    """The group for a contracted axis of ``k`` elements split over ``shards`` devices: ``wanted``
    if it divides each device's share, else the largest even divisor of the share below it."""
    share = k // shards
    return next((g for g in range(min(wanted, share), 1, -1) if share % g == 0 and g % 2 == 0), share)


def pack(codes: np.ndarray, bits: int, group_axis: int) -> np.ndarray:
    """Codes ``[..., G, ...]`` as stored: int8 as they are; 4-bit codes (0..15) two per byte, the
    group's first half in the low nibbles and its second half in the high ones."""
    if bits == 8:
        return codes.astype(np.int8)
    low, high = np.split(codes.astype(np.uint8), 2, axis=group_axis)
    return low | (high << 4)


def _grouped(w: np.ndarray, n_lead: int, group: int) -> np.ndarray:
    """``[*lead, K, *out]`` -> ``[*lead, K / G, G, *out]``."""
    shape = w.shape
    return w.reshape(*shape[:n_lead], shape[n_lead] // group, group, *shape[n_lead + 1 :])


def quantize(w: np.ndarray, n_lead: int, bits: int, group: int) -> HostNarrow:
    """Quantize a float weight ``[*lead, K, *out]`` in groups along ``K``: int8 symmetric (``group``
    = K: per output channel), int4 asymmetric with offsets."""
    g = _grouped(w.astype(np.float32), n_lead, group)
    axis = n_lead + 1
    if bits == 8:
        scale = np.max(np.abs(g), axis=axis, keepdims=True) / 127.0
        scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
        codes = np.clip(np.rint(g / scale), -127, 127)
        return HostNarrow(pack(codes, 8, axis), np.squeeze(scale, axis), None, 8, group)
    low, high = np.min(g, axis=axis, keepdims=True), np.max(g, axis=axis, keepdims=True)
    scale = ((high - low) / 15.0).astype(np.float32)
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    codes = np.clip(np.rint((g - low) / scale), 0, 15)
    return HostNarrow(pack(codes, 4, axis), np.squeeze(scale, axis), np.squeeze(low, axis), 4, group)


def _unified(parts: Sequence[Blocks], want: BlockLayout) -> list[Blocks]:
    """The parts of one fused weight in the layout ``want`` (``layout_of``): 4-bit codes widened to
    int8 when it is 8-bit (exact), groups split, scales in its dtype, zero offsets where missing."""
    if all(blocks_layout(p) == want for p in parts):
        return list(parts)
    out = []
    for p in parts:
        codes, scale = p.codes, p.scale.astype(np.float32)
        offset = None if p.offset is None else p.offset.astype(np.float32)
        if want.bits == 8 and p.bits == 4:
            codes = (codes.astype(np.int16) - 8).astype(np.int8)
            offset = (0.0 if offset is None else offset) + 8.0 * scale
        if want.offset and offset is None:
            offset = np.zeros_like(scale)
        if p.group != want.group:
            scale = np.repeat(scale, p.group // want.group, axis=-1)
            offset = None if offset is None else np.repeat(offset, p.group // want.group, axis=-1)
        out.append(Blocks(codes, scale, offset, want.group, want.bits))
    return out


def from_blocks(
    parts: Sequence[Blocks],
    combine: Callable[..., np.ndarray] | None,
    n_lead: int,
    k: int,
    out_shape: tuple[int, ...],
    want: BlockLayout,
) -> HostNarrow:
    """Our layout of a weight read from GGUF blocks (one part per HF tensor it fuses): the codes go
    through ``combine`` like the float tensors would, and so do the scales and offsets, repeated to
    full width first and then read back once per group. ``want``: the layout (``layout_of``)."""
    parts = _unified(parts, want)
    group, width = want.group, want.bits

    def layout(arrays: list[np.ndarray]) -> np.ndarray:
        w = combine(*arrays) if combine is not None else arrays[0]
        lead = w.shape[:n_lead]
        return w.reshape(*lead, k, *out_shape)

    def per_group(arrays: list[np.ndarray | None]) -> np.ndarray:
        full = layout([np.repeat(a, group, axis=-1) for a in arrays if a is not None])
        return np.take(full, np.arange(0, k, group), axis=n_lead)

    codes = _grouped(layout([p.codes for p in parts]), n_lead, group)
    scale = per_group([p.scale for p in parts]).astype(want.scale_dtype)
    offsets = [p.offset for p in parts]
    offset = None if offsets[0] is None else per_group(offsets).astype(want.scale_dtype)
    return HostNarrow(pack(codes, width, n_lead + 1), scale, offset, width, group)


def ideal_bytes(numel: int, bits: int, group: int, scale_bytes: int, with_offset: bool) -> int:
    """Bytes a weight of ``numel`` elements needs at ``bits`` per code plus its scales (and offsets)."""
    groups = math.ceil(numel / group)
    return numel * bits // 8 + groups * scale_bytes * (2 if with_offset else 1)
