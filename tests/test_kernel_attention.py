"""The TPU kernel's path of the serving step, run on CPU with the kernel's contract in its place.

The Pallas kernel itself runs only on a TPU (and JAX's interpreters cannot run it here), so these
tests check everything around it: the kernel-layout cache and its writes, the per-sequence
metadata derived from a ragged step, the layer offsets into the merged page axis, page copies, and
whole served requests, with ``tests/kernel_contract.py`` standing in for the kernel. That
stand-in is first checked against JAX's own reference of the kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_contract import contract_attention
from ragged_steps import MIXED, mixed_step

from myserve.ops import tpu_attention
from myserve.ops.attention import ragged_attention
from myserve.ops.paged_cache import KernelKVCache, KVCache, write_kv, write_kv_kernel
from myserve.ops.ragged_batch import kernel_meta
from myserve.ops.tpu_attention import kernel_attention as run_kernel
from myserve.testing import collect, hf_greedy
from myserve.wire.params import SamplingParams


@pytest.mark.parametrize("options", [{}, {"sliding_window": 5, "soft_cap": 2.0}])
def test_the_stand_in_equals_jax_reference_of_the_kernel(options: dict) -> None:
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

    rng = np.random.RandomState(0)
    h, kvh, d, ps, n_pages = 6, 2, 16, 4, 40
    q_lens, kv_lens = [1, 7, 1, 12, 3], [9, 7, 30, 20, 5]
    t = 32
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    pages = rng.permutation(n_pages)[: 5 * 8].reshape(5, 8).astype(np.int32)
    args = (
        jnp.asarray(rng.randn(t, h, d), jnp.float32),
        jnp.asarray(rng.randn(n_pages, ps, 2 * kvh, d), jnp.float32),
        jnp.asarray(np.array(kv_lens + [0, 0], np.int32)),  # two padding sequences past num_seqs
        jnp.asarray(np.concatenate([pages, np.zeros((2, 8), np.int32)])),
        jnp.asarray(np.concatenate([cu, [cu[-1], cu[-1]]]).astype(np.int32)),
        jnp.asarray([5], jnp.int32),
    )
    want = np.asarray(ref_ragged_paged_attention(*args, sm_scale=d**-0.5, **options))
    got = np.asarray(jax.jit(lambda *a: contract_attention(*a, sm_scale=d**-0.5, **options))(*args))
    n = int(cu[-1])
    np.testing.assert_allclose(got[:n], want, atol=2e-5)
    assert not got[n:].any()


def _both_layouts(rng: np.random.RandomState, layers: int, kvh: int, n_pages: int, ps: int, d: int):
    """The same random K/V in the reference layout and in the kernel's."""
    k = rng.randn(layers, kvh, n_pages + 1, ps, d).astype(np.float32)  # the reference's spare page last
    v = rng.randn(layers, kvh, n_pages + 1, ps, d).astype(np.float32)
    # kernel: [layers, pages, page_size, 2 * kv_heads, D], combined head 2h = K of head h, 2h + 1 its V
    kv = (
        np.stack([k[:, :, :n_pages], v[:, :, :n_pages]], axis=2)
        .transpose(0, 3, 4, 1, 2, 5)
        .reshape(layers, n_pages, ps, 2 * kvh, d)
    )
    return KVCache(jnp.asarray(k), jnp.asarray(v)), KernelKVCache(jnp.asarray(kv))


@pytest.mark.parametrize(("window", "soft_cap"), [(None, None), (6, 2.0)])
def test_kernel_path_equals_the_reference_on_a_mixed_ragged_step(monkeypatch, window, soft_cap) -> None:
    """Decode tokens, prefill chunks after cached context, a chunk cut into several blocks, padding:
    the metadata, the write and the layer-1 offset give the reference's attention for every token
    (with a sliding window and a soft cap, passed to the kernel as its own options)."""
    monkeypatch.setattr(tpu_attention, "_tpu_kernel", lambda: contract_attention)
    rng = np.random.RandomState(1)
    layers, kvh, h, d, ps, n_pages = 2, 2, 6, 8, 4, 64
    shape, _, batch = mixed_step(rng, n_pages, ps)
    ref_cache, kernel_cache = _both_layouts(rng, layers, kvh, n_pages, ps, d)
    # This step's K/V written through each layout's own write into layer 1.
    k_new = jnp.asarray(rng.randn(1, shape.tokens, kvh, d), jnp.float32)
    v_new = jnp.asarray(rng.randn(1, shape.tokens, kvh, d), jnp.float32)
    ref_cache = write_kv(ref_cache, 1, k_new, v_new, batch)
    kernel_cache = write_kv_kernel(kernel_cache, 1, k_new, v_new, batch)
    q = jnp.asarray(rng.randn(shape.tokens, h, d), jnp.float32)

    @jax.jit
    def both(q, ref_cache, kernel_cache, batch):
        meta = kernel_meta(batch, shape.tokens)
        return (
            ragged_attention(q, ref_cache, 1, batch, sm_scale=d**-0.5, window=window, soft_cap=soft_cap),
            run_kernel(q, kernel_cache, jnp.int32(1), meta, sm_scale=d**-0.5, window=window, soft_cap=soft_cap),
            meta,
        )

    want, got, meta = both(q, ref_cache, kernel_cache, batch)
    real = sum(n for _, n in MIXED)
    np.testing.assert_allclose(np.asarray(got)[:real], np.asarray(want)[:real], atol=1e-5)
    # One kernel sequence per single row and per block: 3 decode rows, blocks of 4 of 7, 13 and 3 tokens.
    assert int(meta.num_seqs[0]) == 3 + 2 + 4 + 1
    assert int(meta.cu_q_lens[int(meta.num_seqs[0])]) == real


def test_served_requests_through_the_kernel_path_match_transformers(make_service, hf_tiny, monkeypatch) -> None:
    """A whole engine on the kernel's layout: chunked prefills beside decodes, prefix-cache hits and
    copy-on-write pages (n=3), each request's greedy tokens equal to transformers alone."""
    monkeypatch.setattr(tpu_attention, "_tpu_kernel", lambda: contract_attention)
    monkeypatch.setattr("myserve.runtime.deployment.resolve_backend", lambda *a, **k: "pallas")
    svc = make_service("engine.attention_backend=pallas", "engine.num_pages=128")
    executor = svc.replicas[0].runner.device
    assert isinstance(executor.kv_cache, KernelKVCache)
    rng = np.random.RandomState(5)
    prompts = [[int(t) for t in rng.randint(3, 256, size=n)] for n in (3, 150, 17, 64, 5, 90)]
    prompts.append(prompts[1][:100] + [7, 8, 9])  # shares 12 full pages with prompt 1
    params = SamplingParams(max_tokens=16, temperature=0.0)
    streams = [svc.submit(p, params) for p in prompts]
    got = [collect(s)[0] for s in streams]
    assert got == [hf_greedy(hf_tiny, p, 16, (2,)) for p in prompts]
    # n=3: the prompt's pages are shared and its last page copied for choices 1 and 2.
    prompt = [int(t) for t in rng.randint(3, 256, size=37)]
    by_choice: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for out in svc.submit(prompt, SamplingParams(max_tokens=12, temperature=0.0, n=3)):
        if not out.final:
            by_choice[out.choice].extend(out.token_ids)
    assert by_choice[0] == by_choice[1] == by_choice[2] == hf_greedy(hf_tiny, prompt, 12, (2,))
    assert svc.stats().pages_used == 0


def test_served_gemma2_through_the_kernel_path_matches_transformers(tiny_checkpoints, monkeypatch) -> None:
    """Gemma 2's sliding layers and soft-capped scores reach the kernel as its options: served greedy
    tokens equal transformers' (chunked prefill, preemption, prefix caching; prompts past the window)."""
    from served_parity import check_served_greedy

    monkeypatch.setattr(tpu_attention, "_tpu_kernel", lambda: contract_attention)
    monkeypatch.setattr("myserve.runtime.deployment.resolve_backend", lambda *a, **k: "pallas")
    check_served_greedy(tiny_checkpoints["gemma2"], "engine.attention_backend=pallas")
