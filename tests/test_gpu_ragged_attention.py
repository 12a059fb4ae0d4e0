"""Our GPU ragged paged attention kernel (``ops/gpu_ragged_attention.py``), run on CPU by Pallas's
interpreter: each view of a mixed ragged step against the reference with every option it claims
(sliding windows, soft caps), split K over long contexts in bfloat16, whole served requests
against transformers, and that the step lowers to one Triton call per view for CUDA reading the
cache in place. Compiling the Triton code and its speed need a GPU (``python -m
myserve.bench.device --set engine.attention_backend=pallas_ragged``)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_on_mesh
from ragged_steps import MIXED, chunked_logits, cuda_target, device_batch, mixed_step
from served_parity import check_served_on_backend

from myserve.errors import ConfigError
from myserve.ops import gpu_ragged_attention as kernel
from myserve.ops.attention import _view_attention, ragged_attention, resolve_backend
from myserve.ops.paged_cache import KVCache, write_kv
from myserve.runtime.kv_cache import init_kv_cache
from myserve.runtime.model_step import StepLogits
from myserve.runtime.step_layout import Span, StepShape
from myserve.testing import hf_logits


def _step(rng: np.random.RandomState, dtype: jnp.dtype = jnp.float32, d: int = 16):
    """A mixed ragged step (decodes, prefill chunks cut into blocks, a first token) written into
    layer 1 of a two-layer cache with 3 query heads per KV head: (q padded, cache, batch, T)."""
    layers, kvh, h, ps, n_pages = 2, 2, 6, 4, 64
    shape, _, batch = mixed_step(rng, n_pages, ps, [*MIXED, (0, 1)])
    cache = KVCache(*(jnp.asarray(rng.randn(layers, kvh, n_pages + 1, ps, d), dtype) for _ in range(2)))
    k_new, v_new = (jnp.asarray(rng.randn(1, shape.tokens, kvh, d), dtype) for _ in range(2))
    cache = write_kv(cache, 1, k_new, v_new, batch)
    q = jnp.asarray(rng.randn(shape.tokens, h, d), dtype)
    return jnp.concatenate([q, jnp.zeros((1, h, d), dtype)]), cache, batch, shape.tokens


@pytest.mark.parametrize(("window", "soft_cap"), [(None, None), (5, None), (None, 3.0), (9, 2.0)])
def test_each_view_equals_the_reference(window: int | None, soft_cap: float | None) -> None:
    """Decode rows (split K) and prefill blocks (padding queries, rows of several blocks, windows
    that skip blocks): every real query's attention equals the reference's."""
    q, cache, batch, t = _step(np.random.RandomState(1))
    d = q.shape[-1]
    for view in (batch.single, batch.blocks):
        want = _view_attention(
            q, cache, jnp.int32(1), view, chunk_pages=batch.chunk_pages, sm_scale=d**-0.5,
            heads_sharded=False, window=window, soft_cap=soft_cap,
        )  # fmt: skip
        got = kernel.view_attention(
            q, cache, jnp.int32(1), view, num_tokens=t, sm_scale=d**-0.5, window=window, soft_cap=soft_cap
        )
        real = np.asarray(view.idx < t)
        np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=2e-6)
    # Padding rows read nothing and give zeros.
    padding_rows = np.asarray(batch.single.kv_lens == 0)
    assert padding_rows.any()
    got = kernel.view_attention(q, cache, jnp.int32(1), batch.single, num_tokens=t, sm_scale=0.25)
    assert not np.asarray(got)[padding_rows].any()


def test_the_step_on_the_kernel_equals_the_reference_step() -> None:
    """``ragged_attention`` with the batch marked for the kernel, jitted: every token's output equals
    the reference step's (the views' rows put back in token order), padding tokens zeros."""
    q, cache, batch, t = _step(np.random.RandomState(2))
    real = int(batch.q_lens[0])

    @jax.jit
    def both(q, cache, batch):
        return (
            ragged_attention(q, cache, jnp.int32(1), batch, sm_scale=0.25),
            ragged_attention(q, cache, jnp.int32(1), batch.with_ragged_kernel(), sm_scale=0.25),
        )

    want, got = both(q[:t], cache, batch)
    np.testing.assert_allclose(np.asarray(got)[:real], np.asarray(want)[:real], atol=2e-6)
    assert not np.asarray(got)[real:].any()


def test_split_k_over_long_contexts_in_bfloat16() -> None:
    """Two decode rows at 300 and 1,000 tokens of 16-token pages, bfloat16 cache: the rows' blocks
    are split over several programs (empty splits included) and merged, as the reference."""
    rng = np.random.RandomState(3)
    kvh, h, d, ps, width = 2, 8, 64, 16, 64
    spans = [Span([5], 299, list(range(1, 20)), samples=True), Span([6], 999, list(range(20, 83)), samples=True)]
    shape = StepShape.of(8, max_num_seqs=4, block_tokens=8, max_pages=width, chunk_pages=8)
    batch = device_batch(spans, shape, ps)
    cache = KVCache(*(jnp.asarray(rng.randn(1, kvh, 90, ps, d), jnp.bfloat16) for _ in range(2)))
    q = jnp.asarray(rng.randn(shape.tokens + 1, h, d), jnp.bfloat16)
    view = batch.single
    assert kernel.k_splits(view.idx.shape[0] * kvh, width // kernel.pages_per_block(ps, width)) > 1
    want = _view_attention(q, cache, 0, view, chunk_pages=8, sm_scale=d**-0.5, heads_sharded=False)
    got = kernel.view_attention(q, cache, 0, view, num_tokens=shape.tokens, sm_scale=d**-0.5)
    np.testing.assert_allclose(np.asarray(got)[:2], np.asarray(want)[:2], atol=2e-2)


def test_tile_and_split_sizes() -> None:
    """Host arithmetic of the kernel's shapes: powers of two, Triton's 16-row minimum, splits only
    as many as a row has blocks."""
    assert kernel.tiles(1, 4) == (16, 16)  # a decode row of Llama-3.2-1B's group: 4 heads in 16 rows
    assert kernel.tiles(32, 4) == (128, kernel.BLOCK_M)  # a 32-token block
    assert kernel.tiles(3, 6) == (32, 32)
    assert kernel.pages_per_block(16, 256) == 8 and kernel.pages_per_block(16, 12) == 4
    assert kernel.pages_per_block(256, 8) == 1
    assert kernel.k_splits(8, 32) == 32  # one stream, 8 KV heads: 32 programs per pair
    assert kernel.k_splits(8, 3) == 2  # at most the row's blocks (a power of two)
    assert kernel.k_splits(512, 32) == 1  # 64 streams fill the device


def test_the_step_lowers_to_one_triton_call_per_view_for_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exported for CUDA (no GPU needed to lower): a layer's attention is one Triton call per view,
    whose K and V operands are the whole cache merged (a bitcast), not a copy of the layer."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # not the interpreter: Triton
    rng = np.random.RandomState(4)
    layers, kvh, h, d, ps, n_pages = 3, 2, 8, 64, 16, 40
    _, _, batch = mixed_step(rng, n_pages, ps)
    cache = KVCache(*(jax.ShapeDtypeStruct((layers, kvh, n_pages, ps, d), jnp.bfloat16) for _ in range(2)))
    q = jax.ShapeDtypeStruct((32, h, d), jnp.bfloat16)
    step = jax.jit(
        lambda q, c, b, layer: ragged_attention(q, c, layer, b.with_ragged_kernel(), sm_scale=0.125, window=40)
    )
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    with cuda_target():
        exported = jax.export.export(step, platforms=["cuda"], disabled_checks=[triton])
        text = exported(q, cache, batch, jax.ShapeDtypeStruct((), jnp.int32)).mlir_module()
    calls = [line for line in text.splitlines() if "custom_call @__gpu$xla.gpu.triton" in line]
    assert len(calls) == 2  # the decode rows and the prefill blocks
    merged = f"tensor<{layers * kvh * n_pages}x{ps}x{d}xbf16>"
    assert all(call.count(merged) == 2 for call in calls)  # K and V, whole
    whole = f"tensor<{layers}x{kvh}x{n_pages}x{ps}x{d}xbf16>"
    touching = [line.split("=", 1)[1].split()[0] for line in text.splitlines() if f"({whole}" in line]
    assert touching and set(touching) == {"stablehlo.reshape"}, touching


def test_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    fits = dict(num_heads=32, num_kv_heads=8, head_dim=64, page_size=16)
    with pytest.raises(ConfigError, match="'pallas_ragged' needs a GPU"):
        resolve_backend("pallas_ragged", **fits)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve_backend("pallas_ragged", **fits) == "pallas_gpu_ragged"
    # Windows and soft caps: this kernel (auto's choice on a GPU) has them, the decode kernel not.
    gemma = dict(fits, sliding_window=True, soft_cap=True)
    assert resolve_backend("pallas_ragged", **gemma) == "pallas_gpu_ragged"
    assert resolve_backend("pallas_decode", **fits) == "pallas_gpu"
    assert resolve_backend("auto", **gemma) == "pallas_gpu_ragged"
    assert resolve_backend("auto", **fits) == "pallas_gpu_ragged"
    with pytest.raises(ConfigError, match="'pallas_decode' cannot serve this model: the kernel has no sliding"):
        resolve_backend("pallas_decode", **gemma)
    with pytest.raises(ConfigError, match="'pallas_ragged' cannot serve this model: page_size 8"):
        resolve_backend("pallas_ragged", **dict(fits, page_size=8))
    assert kernel.ragged_fit(32, 8, 80, 16) == "head_dim 80 is not a power of two >= 16"


def test_served_requests_through_the_ragged_kernel_match_transformers(make_service, hf_tiny, monkeypatch) -> None:
    """A whole engine on the kernel (interpreted): chunked prefills beside decodes and a prefix-cache
    hit, each request's greedy tokens equal to transformers alone."""
    check_served_on_backend(make_service, hf_tiny, "pallas_gpu_ragged", monkeypatch)


def test_gemma2_logits_through_the_ragged_kernel_match_transformers(tiny_checkpoints) -> None:
    """Gemma 2's sliding layers and soft-capped scores on the kernel, in the served step: the logits
    of a 45-token sequence (past the 16-token window) fed as a prefill chunk, two decode tokens and
    another chunk equal transformers'. (Logits, not greedy tokens: the tiny Gemma 2 repeats one
    token whatever its attention gives.)"""
    model, mesh, mapping = load_on_mesh(tiny_checkpoints["gemma2"])
    model = dataclasses.replace(model, attention_backend="pallas_gpu_ragged")
    assert model.spec.sliding_window and model.spec.attn_softcap
    ids = [int(t) for t in np.random.RandomState(7).randint(0, 256, size=45)]
    cache = init_kv_cache(model.spec, 4, 16, jnp.float32, mesh, mapping)
    forward = StepLogits.of(model, mesh, mapping, 16)
    ours, _ = chunked_logits(forward, cache, ids, [3, 0, 2, 1], [20, 1, 1, 23])
    np.testing.assert_allclose(ours, hf_logits(tiny_checkpoints["gemma2"], ids), atol=1e-4, rtol=0)
