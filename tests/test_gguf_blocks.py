"""GGUF blocks repacked as codes and scales recombine to exactly what gguf.quants.dequantize gives."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from myserve.bundled import bundled_gguf_path
from myserve.models.gguf_blocks import Blocks, read_blocks
from myserve.models.gguf_file import read_gguf

Q = gguf.GGMLQuantizationType
# type -> (byte offsets of its float16 fields within a block, group, bits, scale dtype, has offset)
LAYOUTS = {
    Q.Q8_0: ((0,), 32, 8, np.float16, False),
    Q.Q4_0: ((0,), 32, 4, np.float16, True),
    Q.Q4_1: ((0, 2), 32, 4, np.float16, True),
    Q.Q4_K: ((0, 2), 32, 4, np.float32, True),
    Q.Q6_K: ((208,), 16, 8, np.float32, False),
}


def recombine(b: Blocks) -> np.ndarray:
    """codes * scale + offset in float32, the scales repeated over their groups."""
    w = b.codes.astype(np.float32) * np.repeat(b.scale.astype(np.float32), b.group, axis=-1)
    if b.offset is not None:
        w += np.repeat(b.offset.astype(np.float32), b.group, axis=-1)
    return w


def random_tensor(qtype: Q, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random raw blocks for ``shape`` with the float16 fields overwritten by finite random values."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // block, size), dtype=np.uint8)
    for at in LAYOUTS[qtype][0]:
        f16 = (rng.standard_normal(raw.shape[:-1]) * 0.01).astype(np.float16)
        raw[..., at : at + 2] = f16[..., None].view(np.uint8)
    return raw.reshape(*shape[:-1], -1)


def check(b: Blocks | None, data: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> None:
    _, group, bits, scale_dtype, has_offset = LAYOUTS[qtype]
    assert b is not None
    assert (b.group, b.bits) == (group, bits)
    assert b.codes.shape == shape
    assert b.scale.shape == b.codes.shape[:-1] + (shape[-1] // group,)
    assert b.scale.dtype == scale_dtype
    if has_offset:
        assert b.offset is not None and b.offset.shape == b.scale.shape and b.offset.dtype == scale_dtype
    else:
        assert b.offset is None
    if bits == 8:
        assert b.codes.dtype == np.int8
    else:
        assert b.codes.dtype == np.uint8 and b.codes.max() <= 15
    expected = gguf.quants.dequantize(data, qtype).reshape(shape)
    # The same float32 arithmetic as gguf's, so equal bit for bit (well within rtol 1e-6).
    np.testing.assert_array_equal(recombine(b), expected, err_msg=qtype.name)


@pytest.mark.parametrize("qtype", list(LAYOUTS), ids=lambda q: q.name)
@pytest.mark.parametrize("shape", [(1, 256), (5, 512), (3, 4, 768)], ids=str)
def test_random_blocks_recombine_to_gguf_dequantize(qtype: Q, shape: tuple[int, ...]) -> None:
    data = random_tensor(qtype, shape)
    check(read_blocks(data, int(qtype), shape), data, qtype, shape)


def test_q6_k_codes_cover_the_signed_6_bit_range() -> None:
    shape = (64, 256)
    b = read_blocks(random_tensor(Q.Q6_K, shape), int(Q.Q6_K), shape)
    assert b is not None and (int(b.codes.min()), int(b.codes.max())) == (-32, 31)


def test_quantized_float_weights_recombine() -> None:
    """Blocks quantized by gguf from real-valued weights (not random bytes) recombine too."""
    x = np.random.default_rng(1).standard_normal((2, 6, 128)).astype(np.float32)
    for qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        data = gguf.quants.quantize(x, qtype)
        check(read_blocks(data, int(qtype), x.shape), data, qtype, x.shape)


def test_q4_0_nibble_order() -> None:
    """Byte i holds element i (low nibble) and element i + 16 (high nibble) of its block of 32."""
    codes = np.arange(32, dtype=np.uint8) % 16
    codes[16:] = 15 - codes[16:]  # 0..15 then 15..0: a swapped or interleaved order differs
    block = np.concatenate([np.float16(0.5).reshape(1).view(np.uint8), codes[:16] | (codes[16:] << 4)])
    b = read_blocks(block.reshape(1, 18), int(Q.Q4_0), (1, 32))
    assert b is not None
    np.testing.assert_array_equal(b.codes[0], codes)
    np.testing.assert_array_equal(recombine(b)[0], 0.5 * (codes.astype(np.float32) - 8))
    np.testing.assert_array_equal(recombine(b), gguf.quants.dequantize(block.reshape(1, 18), Q.Q4_0))


def test_q4_0_offset_widens_where_float16_would_overflow() -> None:
    shape = (1, 64)
    data = random_tensor(Q.Q4_0, shape)
    data[0, :2] = np.array([10000.0], np.float16).view(np.uint8)  # -8 * 10000 is past float16's 65504
    b = read_blocks(data, int(Q.Q4_0), shape)
    assert b is not None and b.offset is not None and b.offset.dtype == np.float32
    np.testing.assert_array_equal(recombine(b), gguf.quants.dequantize(data, Q.Q4_0).reshape(shape))


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q5_K, Q.Q5_0, Q.Q2_K], ids=lambda q: q.name)
def test_other_types_are_not_kept_narrow(qtype: Q) -> None:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = np.zeros((2, 256 // block * size), np.uint8)
    assert read_blocks(data, int(qtype), (2, 256)) is None


def test_bytes_that_do_not_match_the_shape_are_rejected() -> None:
    with pytest.raises(ValueError, match="do not hold blocks"):
        read_blocks(np.zeros((2, 34), np.uint8), int(Q.Q8_0), (2, 64))
    with pytest.raises(ValueError, match="do not hold blocks"):
        read_blocks(np.zeros((2, 34), np.uint8), int(Q.Q8_0), (2, 48))


def test_bundled_model_tensors_recombine() -> None:
    """Every quantized tensor of the bundled SmolLM2 file (Q4_1 and Q8_0) recombines to gguf's values."""
    tensors = read_gguf(bundled_gguf_path()).tensors.values()
    seen = set()
    for t in tensors:
        b = read_blocks(t.data, t.ggml_type, t.shape)
        if t.ggml_type in LAYOUTS:
            check(b, t.data, Q(t.ggml_type), t.shape)
            seen.add(Q(t.ggml_type))
        else:
            assert b is None, t.name
    assert seen == {Q.Q4_1, Q.Q8_0}
