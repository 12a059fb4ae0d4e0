"""GGUF quantized tensors repacked as narrow integer codes plus float scales, never widened to float32.

A GGUF tensor of type Q8_0, Q4_0, Q4_1, Q4_K or Q6_K is a row-major run of fixed-size blocks, each
holding the integer codes of 32 (or 256) consecutive elements of a row with a half-precision scale.
Dequantizing it to float32 takes 4-7x the memory of the file; a device that multiplies 4- or 8-bit
weights directly only needs the codes and the scales side by side, so ``read_blocks`` separates them:

    w = codes * scale + offset    (scale, offset repeated over ``group`` elements of the last axis)

which is the same float32 arithmetic as ``gguf.quants.dequantize`` (bit for bit for finite scales, up
to the sign of zero: each term is exact or computed in the same order). 4-bit codes are unpacked to
one byte each (the device packs them as it likes); within a block of 32, ggml keeps element i in the
low nibble of byte i and element i+16 in its high nibble (Q4_0, Q4_1). Q4_K instead puts 64
elements in 32 bytes (low nibbles: the first sub-block of 32, high: the second), and Q6_K splits its
6-bit codes into 4 low bits (``ql``) and 2 high bits (``qh``) spread over 128 elements; both orders
follow ggml's ``dequantize_row_q*_K``.

Each block type is read through a numpy structured dtype over the raw bytes (a view, no copy), and
every step is a whole-tensor numpy operation: no Python loop over blocks.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# ggml type ids (gguf.GGMLQuantizationType), spelled out so that importing this module does not
# import the gguf package (0.1 s).
Q4_0, Q4_1, Q8_0, Q4_K, Q6_K = 2, 3, 8, 12, 14

# One block of each type, as ggml's block_q* structs lay it out (little-endian, unaligned).
_BLOCK_DTYPES: dict[int, np.dtype] = {
    Q8_0: np.dtype([("d", "<f2"), ("qs", "i1", 32)]),
    Q4_0: np.dtype([("d", "<f2"), ("qs", "u1", 16)]),
    Q4_1: np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)]),
    Q4_K: np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qs", "u1", 128)]),
    Q6_K: np.dtype([("ql", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16), ("d", "<f2")]),
}
_BLOCK_SIZES = {Q8_0: 32, Q4_0: 32, Q4_1: 32, Q4_K: 256, Q6_K: 256}


@dataclasses.dataclass(frozen=True)
class Blocks:
    """A GGUF tensor's quantized blocks repacked as integer codes with float scales: w = codes * scale + offset,
    scale and offset repeated over `group` consecutive elements of the last axis."""

    codes: np.ndarray
    """bits == 8: int8 (signed); bits == 4: uint8 holding 0..15, one code per byte. Shape: the
    tensor's numpy shape ``[..., cols]``."""
    scale: np.ndarray
    """``[..., cols // group]``; float16 where the file's value is exactly a float16 (Q8_0, Q4_0,
    Q4_1), else float32 (products of two file values: Q4_K, Q6_K)."""
    offset: np.ndarray | None
    """Same shape and dtype as ``scale`` (except a Q4_0 tensor with a scale past 8188, whose -8 * scale
    overflows float16: then float32), or None when w = codes * scale (Q8_0, Q6_K)."""
    group: int
    """Elements of the last axis per scale: 32, or 16 for Q6_K."""
    bits: int
    """8 or 4."""


def read_blocks(data: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> Blocks | None:
    """Repack one GGUF tensor's blocks as codes and scales, or None for a type not kept narrow.

    Args:
        data: the tensor's raw bytes as uint8, shape ``(*shape[:-1], row_bytes)``
            (``GGUFTensorInfo.data``).
        ggml_type: the ggml type id (``GGUFTensorInfo.ggml_type``).
        shape: the numpy shape (``GGUFTensorInfo.shape``).

    Returns:
        ``Blocks`` for Q8_0, Q4_0, Q4_1, Q4_K and Q6_K; None for F32, F16, BF16 and other quant types.

    Raises:
        ValueError: ``data`` does not hold whole blocks of ``shape``.
    """
    if ggml_type not in _BLOCK_DTYPES:
        return None
    block_dtype, block_size = _BLOCK_DTYPES[ggml_type], _BLOCK_SIZES[ggml_type]
    cols = shape[-1]
    row_bytes = cols // block_size * block_dtype.itemsize
    if cols % block_size or data.dtype != np.uint8 or data.shape != (*shape[:-1], row_bytes):
        raise ValueError(
            f"ggml type {ggml_type}: {data.dtype} bytes {data.shape} do not hold blocks of {block_size} for {shape}"
        )
    blocks = np.ascontiguousarray(data).reshape(-1).view(block_dtype)
    codes, scale, offset, group, bits = _READERS[ggml_type](blocks)
    lead = tuple(shape[:-1])
    return Blocks(
        codes=codes.reshape(shape),
        scale=scale.reshape(*lead, cols // group),
        offset=None if offset is None else offset.reshape(*lead, cols // group),
        group=group,
        bits=bits,
    )


_Parts = tuple[np.ndarray, np.ndarray, np.ndarray | None, int, int]  # codes, scale, offset, group, bits


def _nibbles(qs: np.ndarray, span: int) -> np.ndarray:
    """[n, k * span] bytes -> [n, 2 * k * span] codes: per run of ``span`` bytes, the low nibbles
    then the high nibbles."""
    n = qs.shape[0]
    qs = qs.reshape(n, -1, span)
    out = np.empty((n, qs.shape[1], 2, span), np.uint8)
    np.bitwise_and(qs, 0x0F, out=out[:, :, 0])
    np.right_shift(qs, 4, out=out[:, :, 1])
    return out.reshape(n, -1)


def _q8_0(blocks: np.ndarray) -> _Parts:
    return np.ascontiguousarray(blocks["qs"]), blocks["d"].copy(), None, 32, 8


def _q4_0(blocks: np.ndarray) -> _Parts:
    d = blocks["d"]
    wide = d.astype(np.float32) * -8
    with np.errstate(over="ignore"):
        narrow = wide.astype(np.float16)  # exact unless |d| > 8188, where float16 overflows
    offset: np.ndarray = narrow if np.array_equal(narrow, wide, equal_nan=True) else wide
    return _nibbles(blocks["qs"], 16), d.copy(), offset, 32, 4


def _q4_1(blocks: np.ndarray) -> _Parts:
    return _nibbles(blocks["qs"], 16), blocks["d"].copy(), blocks["m"].copy(), 32, 4


def _q4_k(blocks: np.ndarray) -> _Parts:
    # 8 sub-blocks' 6-bit scales and mins in 12 bytes, as ggml's get_scale_min_k4 unpacks them:
    # bytes 0-3 hold scales 0-3 (low 6 bits), 4-7 mins 0-3, 8-11 the low 4 bits of scales/mins 4-7,
    # whose high 2 bits are the top bits of bytes 0-3 / 4-7.
    packed = blocks["scales"].reshape(-1, 3, 4)
    lo, mid, hi = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=1)
    mn = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], axis=1)
    scale = blocks["d"].astype(np.float32)[:, None] * sc.astype(np.float32)
    offset = -(blocks["dmin"].astype(np.float32)[:, None] * mn.astype(np.float32))
    return _nibbles(blocks["qs"], 32), scale, offset, 32, 4


def _q6_k(blocks: np.ndarray) -> _Parts:
    # Per half of 128 elements: 64 bytes of ql (low nibbles: elements 0-63, high: 64-127) and
    # 32 bytes of qh (bits 2s..2s+1 of byte j: element 32s + j).
    n = blocks.shape[0]
    low = _nibbles(blocks["ql"], 64)
    qh = blocks["qh"].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    codes = low | ((qh & 0x03) << 4).reshape(n, -1)
    codes = codes.view(np.int8)
    codes -= np.int8(32)
    scale = blocks["d"].astype(np.float32)[:, None] * blocks["scales"].astype(np.float32)
    return codes, scale, None, 16, 8


_READERS = {Q8_0: _q8_0, Q4_0: _q4_0, Q4_1: _q4_1, Q4_K: _q4_k, Q6_K: _q6_k}
