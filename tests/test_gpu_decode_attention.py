"""The GPU decode kernel's path of the serving step, run on CPU by Pallas's interpreter.

JAX's Pallas GPU paged attention kernel runs here in interpret mode (the same kernel body, each
program emulated), so these tests check the kernel's results inside our step: the merged-cache
page offsets, grouped query heads, rows without context, and whole served requests. That the
step lowers to one Triton call per layer for CUDA, reading the whole cache without a copy, is
checked by exporting it for CUDA (lowering needs no GPU; compiling the Triton code does, and no GPU
was available to check that or the kernel's speed).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
from ragged_steps import MIXED, cuda_target, mixed_step
from served_parity import check_served_on_backend

from myserve.errors import ConfigError
from myserve.ops import gpu_attention
from myserve.ops.attention import ragged_attention, resolve_backend
from myserve.ops.gpu_attention import decode_attention, gpu_fit, split_sizes
from myserve.ops.paged_cache import KVCache, write_kv


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    """JAX's GPU kernel in the step, run by the Pallas interpreter."""
    monkeypatch.setattr(gpu_attention, "_gpu_kernel", lambda: functools.partial(paged_attention, interpret=True))


def test_the_decode_kernel_equals_the_reference_on_a_mixed_ragged_step(interpreted) -> None:
    """The decode rows through the kernel (layer 1 of a merged two-layer cache, 3 query heads per
    KV head padded to the kernel's 16), the blocks through the reference: every token's attention
    equals the all-reference step's."""
    rng = np.random.RandomState(1)
    layers, kvh, h, d, ps, n_pages = 2, 2, 6, 16, 4, 64
    shape, spans, batch = mixed_step(rng, n_pages, ps, [*MIXED, (0, 1)])  # and a first token without context
    real = sum(len(span.token_ids) for span in spans)
    cache = KVCache(*(jnp.asarray(rng.randn(layers, kvh, n_pages + 1, ps, d), jnp.float32) for _ in range(2)))
    k_new, v_new = (jnp.asarray(rng.randn(1, shape.tokens, kvh, d), jnp.float32) for _ in range(2))
    cache = write_kv(cache, 1, k_new, v_new, batch)
    q = jnp.asarray(rng.randn(shape.tokens, h, d), jnp.float32)

    @jax.jit
    def both(q, cache, batch):
        return (
            ragged_attention(q, cache, jnp.int32(1), batch, sm_scale=d**-0.5),
            ragged_attention(q, cache, jnp.int32(1), batch.with_decode_kernel(), sm_scale=d**-0.5),
        )

    want, got = both(q, cache, batch)
    np.testing.assert_allclose(np.asarray(got)[:real], np.asarray(want)[:real], atol=2e-5)
    assert not np.asarray(got)[real:].any()  # padding tokens stay zeros


def test_a_row_without_context_gives_zeros(interpreted) -> None:
    cache = KVCache(*(jnp.ones((1, 1, 8, 4, 16), jnp.float32) for _ in range(2)))
    out = decode_attention(
        jnp.ones((2, 2, 16)), cache, 0, jnp.asarray([0, 5]), jnp.zeros((2, 8), jnp.int32), sm_scale=0.25
    )
    assert not np.asarray(out[0]).any() and np.allclose(out[1], 1.0)


@pytest.mark.parametrize("width", [1, 2, 8, 12, 24, 64, 96, 512, 520])
def test_split_sizes_divide_as_the_kernel_asserts(width: int) -> None:
    k_splits, per_block = split_sizes(width)
    assert width % k_splits == 0 and (width // k_splits) % per_block == 0
    assert k_splits <= 16 and per_block <= 8
    if width % 128 == 0:
        assert (k_splits, per_block) == (16, 8)


def test_the_step_lowers_to_one_triton_call_reading_the_whole_cache_for_cuda() -> None:
    """Exported for CUDA (no GPU needed to lower): a layer's attention is one Triton custom call
    whose K and V operands are the whole cache merged (a bitcast), not a copy of the layer."""
    layers, kvh, h, d, ps, n_pages, rows, width = 3, 2, 8, 64, 16, 32, 5, 8
    cache = KVCache(*(jax.ShapeDtypeStruct((layers, kvh, n_pages, ps, d), jnp.bfloat16) for _ in range(2)))
    args = (
        jax.ShapeDtypeStruct((rows, h, d), jnp.bfloat16),
        cache,
        jax.ShapeDtypeStruct((), jnp.int32),
        jax.ShapeDtypeStruct((rows,), jnp.int32),
        jax.ShapeDtypeStruct((rows, width), jnp.int32),
    )
    step = jax.jit(lambda q, c, layer, lens, pages: decode_attention(q, c, layer, lens, pages, sm_scale=0.125))
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    with cuda_target():
        text = jax.export.export(step, platforms=["cuda"], disabled_checks=[triton])(*args).mlir_module()
    calls = [line for line in text.splitlines() if "custom_call @__gpu$xla.gpu.triton" in line]
    assert len(calls) == 1
    merged = f"tensor<1x{layers * kvh * n_pages}x{ps}x{d}xbf16>"
    assert calls[0].count(merged) == 2  # K and V, whole
    # No layer is cut out of the cache: nothing slices it, and it reaches the call only reshaped.
    whole = f"tensor<{layers}x{kvh}x{n_pages}x{ps}x{d}xbf16>"
    touching = [line.split("=", 1)[1].split()[0] for line in text.splitlines() if f"({whole}" in line]
    assert touching and set(touching) == {"stablehlo.reshape"}, touching


def test_backend_choice_on_a_gpu(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    fits = dict(num_heads=32, num_kv_heads=8, head_dim=64, page_size=16)
    # auto and pallas on a GPU: the ragged kernel (the measured winner); this one by name.
    assert resolve_backend("auto", **fits) == "pallas_gpu_ragged"
    assert resolve_backend("pallas", **fits) == "pallas_gpu_ragged"
    assert resolve_backend("pallas_decode", **fits) == "pallas_gpu"
    assert resolve_backend("reference", **fits) == "reference"
    odd = dict(fits, head_dim=80)
    assert gpu_fit(**odd) == "head_dim 80 is not a power of two >= 16"
    assert resolve_backend("auto", **odd) == "reference"
    assert "head_dim 80" in caplog.text
    with pytest.raises(ConfigError, match="page_size 8 is not a power of two >= 16"):
        resolve_backend("pallas", **dict(fits, page_size=8))


def test_served_requests_through_the_gpu_kernel_path_match_transformers(
    make_service, hf_tiny, interpreted, monkeypatch
) -> None:
    """A whole engine whose decode rows take the kernel: chunked prefills beside decodes and a
    prefix-cache hit, each request's greedy tokens equal to transformers alone."""
    check_served_on_backend(make_service, hf_tiny, "pallas_gpu", monkeypatch)
