"""``auto``'s dtype on a CPU (runtime/cpu_dtype.py) and the one-row bfloat16 dot (models/dense_dot.py)."""

from __future__ import annotations

import json
from pathlib import Path

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from myserve.models.dense_dot import dense_dot
from myserve.runtime import cpu_dtype
from myserve.runtime.cpu_dtype import cpu_auto_dtype, cpu_flags, native_bf16
from myserve.runtime.deployment import resolve_dtype

SAPPHIRE = frozenset({"avx512f", "avx512_bf16", "amx_bf16", "fma"})
AVX2 = frozenset({"avx2", "fma", "f16c"})


def test_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Xeon\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\n")
    assert cpu_flags(info) == {"fpu", "avx2", "avx512_bf16"}
    assert native_bf16(cpu_flags(info))
    assert cpu_flags(tmp_path / "absent") == frozenset()


@pytest.mark.parametrize(
    ("declared", "flags", "expected"),
    [
        (None, SAPPHIRE, "bfloat16"),  # a GGUF's blocks: no declared dtype
        ("bfloat16", SAPPHIRE, "bfloat16"),
        ("float16", SAPPHIRE, "bfloat16"),
        ("float32", SAPPHIRE, "float32"),  # the author's float32 is kept
        (None, AVX2, "float32"),  # emulated bfloat16 is slower than float32
        ("bfloat16", AVX2, "float32"),
        ("bfloat16", frozenset(), "float32"),  # no /proc/cpuinfo (macOS)
    ],
)
def test_auto_on_cpu(declared: str | None, flags: frozenset[str], expected: str) -> None:
    assert cpu_auto_dtype(declared, flags) == expected


def test_resolve_dtype_reads_the_checkpoint_and_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: SAPPHIRE)
    assert resolve_dtype("auto", tmp_path) == jnp.bfloat16
    assert resolve_dtype("auto", None) == jnp.bfloat16
    assert resolve_dtype("float32", tmp_path) == jnp.float32  # an explicit dtype decides alone
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32"}))
    assert resolve_dtype("auto", tmp_path) == jnp.float32
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: AVX2)
    assert resolve_dtype("auto", None) == jnp.float32


E, OUT, HEADS = hax.Axis("embed", 64), hax.Axis("out", 96), hax.Axis("heads", 2)


def _arrays(rows: int, dtype: jnp.dtype) -> tuple[hax.NamedArray, hax.NamedArray]:
    rng = np.random.default_rng(0)
    x = hax.named(jnp.asarray(rng.standard_normal((rows, E.size)), dtype), (hax.Axis("token", rows), E))
    w = hax.named(jnp.asarray(rng.standard_normal((E.size, OUT.size, HEADS.size)), dtype), (E, OUT, HEADS))
    return x, w


@pytest.mark.parametrize("preferred", [None, jnp.float32])
def test_one_bf16_row_is_row_zero_of_a_wider_product(preferred: jnp.dtype | None) -> None:
    """The padded one-row product has hax.dot's axes and dtype, and the values the row gets beside
    others (the kernel a batch takes)."""
    x, w = _arrays(1, jnp.bfloat16)
    got = jax.jit(lambda a, b: dense_dot(a, b, E, preferred_element_type=preferred))(x, w)
    plain = hax.dot(x, w, axis=E, preferred_element_type=preferred)
    assert got.axes == plain.axes and got.dtype == plain.dtype
    many, _ = _arrays(8, jnp.bfloat16)
    wide = hax.named(jnp.concatenate([x.array, many.array[1:]]), (x.axes[0].resize(8), E))
    batched = hax.dot(wide, w, axis=E, preferred_element_type=preferred)
    np.testing.assert_array_equal(np.asarray(got.array[0], np.float32), np.asarray(batched.array[0], np.float32))


def test_other_products_are_hax_dot() -> None:
    """float32 rows, several bfloat16 rows, and a row contracted from the weight's side are untouched."""
    for rows, dtype in ((1, jnp.float32), (3, jnp.bfloat16)):
        x, w = _arrays(rows, dtype)
        got = jax.jit(lambda a, b: dense_dot(a, b, E))(x, w)
        np.testing.assert_array_equal(
            np.asarray(got.array, np.float32), np.asarray(hax.dot(x, w, axis=E).array, np.float32)
        )
    x, w = _arrays(1, jnp.bfloat16)
    text = jax.jit(lambda a, b: dense_dot(a, b, E)).lower(x, w).as_text()
    assert "pad" in text  # the one bfloat16 row is widened ...
    x, w = _arrays(1, jnp.float32)
    assert "pad" not in jax.jit(lambda a, b: dense_dot(a, b, E)).lower(x, w).as_text()  # ... a float32 one is not
