"""The served step equals a full forward: chunked prefill into scrambled pages, then decode steps;
and the ragged attention op against naive attention."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from ragged_steps import chunked_logits, device_batch, mixed_step, shape_for

from myserve.ops.attention import ragged_attention
from myserve.ops.paged_cache import KVCache, write_kv
from myserve.runtime.kv_cache import init_kv_cache
from myserve.runtime.model_step import StepLogits
from myserve.runtime.step_layout import Span
from myserve.testing import hf_logits

NUM_PAGES = 64


def run_paged(model, mesh, mapping, ids, *, prompt_len, chunk, page_size, pages) -> np.ndarray:
    """Logits [T, vocab] for ``ids``: prompt in chunks of ``chunk``, then one token per decode step."""
    cache = init_kv_cache(model.spec, NUM_PAGES, page_size, jnp.float32, mesh, mapping)
    chunks = [min(chunk, prompt_len - at) for at in range(0, prompt_len, chunk)] + [1] * (len(ids) - prompt_len)
    logits, _ = chunked_logits(StepLogits.of(model, mesh, mapping, page_size), cache, ids, pages, chunks)
    return logits


@pytest.fixture(scope="module")
def sequence(tiny_checkpoints):
    ids = [int(t) for t in np.random.RandomState(3).randint(0, 256, size=40 + 16)]
    return ids, hf_logits(tiny_checkpoints["llama3"], ids)


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_chunked_prefill_then_decode_matches_full_forward(tiny_llama, sequence, chunk, page_size) -> None:
    model, mesh, mapping = tiny_llama
    ids, ref = sequence
    rng = np.random.RandomState(chunk * 100 + page_size)
    needed = -(-len(ids) // page_size)
    pages = [int(p) for p in rng.permutation(NUM_PAGES)[:needed]]  # scrambled, non-contiguous
    assert pages != sorted(pages)
    ours = run_paged(model, mesh, mapping, ids, prompt_len=40, chunk=chunk, page_size=page_size, pages=pages)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_batched_rows_of_different_lengths(tiny_llama, tiny_checkpoints) -> None:
    """One step prefilling 3 sequences (lengths 5, 17, 33), then steps decoding all three."""
    model, mesh, mapping = tiny_llama
    page_size, rng = 4, np.random.RandomState(11)
    lens, steps = [5, 17, 33], 4
    seqs = [[int(t) for t in rng.randint(0, 256, size=n + steps)] for n in lens]
    perm = [int(p) for p in rng.permutation(NUM_PAGES)]
    tables = [perm[0:10], perm[10:20], perm[20:30]]
    cache = init_kv_cache(model.spec, NUM_PAGES, page_size, jnp.float32, mesh, mapping)
    forward = StepLogits.of(model, mesh, mapping, page_size)
    spans = [Span(seqs[i][:n], 0, tables[i], samples=True) for i, n in enumerate(lens)]
    logits, cache = forward(cache, spans, shape_for(64, max_pages=10))
    ends = np.cumsum(lens)
    got = [[logits[end - n : end]] for n, end in zip(lens, ends, strict=True)]
    for s in range(steps):
        spans = [Span([seqs[i][n + s]], n + s, tables[i], samples=True) for i, n in enumerate(lens)]
        logits, cache = forward(cache, spans, shape_for(4, max_pages=10))
        for i in range(3):
            got[i].append(logits[i : i + 1])
    for i in range(3):
        ref = hf_logits(tiny_checkpoints["llama3"], seqs[i])
        np.testing.assert_allclose(np.concatenate(got[i]), ref, atol=1e-4, rtol=0)


def test_reference_attention_matches_naive_numpy() -> None:
    """The op alone (its own cache write, then the attention) against a direct softmax(QK^T)V over
    each sequence's tokens, GQA group 2."""
    rng = np.random.RandomState(0)
    b, t, h, kvh, d, ps, n_pages = 2, 3, 4, 2, 8, 4, 10
    k_all = rng.randn(b, 9, kvh, d).astype(np.float32)
    v_all = rng.randn(b, 9, kvh, d).astype(np.float32)
    q = rng.randn(b, t, h, d).astype(np.float32)
    kv_lens = np.array([9, 7])  # sequence 1 has only 2 query tokens (positions 5, 6)
    q_lens = np.array([3, 2])
    tables = [[7, 2, 5], [0, 9, 3]]
    # Pages 0-9 and the spare page (KVCache.spare_page) past them.
    cache = KVCache(*(jnp.zeros((1, kvh, n_pages + 1, ps, d), jnp.float32) for _ in range(2)))
    # Write all 9 (or 7) tokens of each sequence through the op's own write path, in one step.
    shape = shape_for(16, max_pages=3, block_tokens=4, chunk_pages=1)
    writes = [Span([0] * int(n), 0, tables[i], samples=False) for i, n in enumerate(kv_lens)]
    flat_k, flat_v = (np.zeros((1, shape.tokens, kvh, d), np.float32) for _ in range(2))
    flat_k[0, :16] = np.concatenate([k_all[0], k_all[1, :7]])
    flat_v[0, :16] = np.concatenate([v_all[0], v_all[1, :7]])
    cache = write_kv(cache, 0, jnp.asarray(flat_k), jnp.asarray(flat_v), device_batch(writes, shape, ps))
    positions = np.stack([np.arange(6, 9), np.array([5, 6, 0])]).astype(np.int32)
    reads = [Span([0] * int(n), int(positions[i, 0]), tables[i], samples=True) for i, n in enumerate(q_lens)]
    shape = shape_for(8, max_pages=3, block_tokens=2, chunk_pages=1)
    flat_q = np.zeros((shape.tokens, h, d), np.float32)
    flat_q[:5] = np.concatenate([q[0], q[1, :2]])
    out = np.asarray(ragged_attention(jnp.asarray(flat_q), cache, 0, device_batch(reads, shape, ps), sm_scale=d**-0.5))
    at = 0
    for i in range(b):
        for j in range(q_lens[i]):
            p = positions[i, j]
            for head in range(h):
                kh = head // (h // kvh)
                s = k_all[i, : p + 1, kh] @ q[i, j, head] * d**-0.5
                w = np.exp(s - s.max())
                w /= w.sum()
                np.testing.assert_allclose(out[at + j, head], w @ v_all[i, : p + 1, kh], atol=1e-5)
        at += q_lens[i]


def test_ragged_attention_equals_per_token_attention() -> None:
    """A ragged step (decode tokens, a prefill chunk after cached context, a chunk not a multiple of
    the block size, padding) attends exactly like each token alone over its own causal context;
    the context loop runs several iterations (2-page chunks, contexts up to 10 pages)."""
    import jax
    from ragged_steps import MIXED, mixed_step

    rng = np.random.RandomState(1)
    kvh, h, d, ps, n_pages = 2, 6, 8, 4, 64
    seqs = MIXED
    shape, spans, batch = mixed_step(rng, n_pages, ps)
    cache_shape = (1, kvh, n_pages + 1, ps, d)  # and the spare page
    cache = KVCache(
        jnp.asarray(rng.randn(*cache_shape), jnp.float32), jnp.asarray(rng.randn(*cache_shape), jnp.float32)
    )
    q = rng.randn(shape.tokens, h, d).astype(np.float32)
    got = np.asarray(
        jax.jit(lambda q, c, b: ragged_attention(q, c, 0, b, sm_scale=d**-0.5))(jnp.asarray(q), cache, batch)
    )
    k_all, v_all = np.asarray(cache.k[0]), np.asarray(cache.v[0])  # [kvh, pages, ps, d]
    at = 0
    for (before, n), span in zip(seqs, spans, strict=True):
        slots = [(page, off) for page in span.pages for off in range(ps)]
        for j in range(n):
            ctx = slots[: before + j + 1]  # causal: positions 0 .. its own
            for head in range(h):
                kh = head // (h // kvh)
                keys = np.stack([k_all[kh, pg, off] for pg, off in ctx])
                vals = np.stack([v_all[kh, pg, off] for pg, off in ctx])
                sc = keys @ q[at + j, head] * d**-0.5
                w = np.exp(sc - sc.max())
                np.testing.assert_allclose(got[at + j, head], (w / w.sum()) @ vals, atol=1e-5)
        at += n
    assert not got[at:].any()  # padding tokens: zeros


def test_one_token_rows_read_up_to_four_chunks_per_loop_iteration() -> None:
    """The single view's loop reads the most chunks (up to four) that divide its page table; the
    test above runs it over a width that takes three, blocks over one."""
    from myserve.ops.attention import _single_chunk

    assert [_single_chunk(w, 8) for w in (8, 16, 24, 32, 40, 128)] == [8, 16, 24, 32, 8, 32]
    assert _single_chunk(12, 2) == 6 and _single_chunk(10, 2) == 2


WINDOWED = [(30, 1), (38, 1), (24, 13), (20, 7)]
"""(context before, tokens this step): decode rows late in their sequences, and prefill chunks cut
into 4-token blocks, so that with a 6-token window each view's first chunks are behind every row."""


def _dense(q, k, v, pos: int, window: int | None, soft_cap: float | None, scale: float):
    """softmax over the keys ``k`` [context, D] a query at ``pos`` sees, of capped scaled scores, @ v."""
    lo = 0 if window is None else max(0, pos - window + 1)
    s = k[lo : pos + 1] @ q * scale
    if soft_cap is not None:
        s = soft_cap * np.tanh(s / soft_cap)
    w = np.exp(s - s.max())
    return (w / w.sum()) @ v[lo : pos + 1]


@pytest.mark.parametrize(("window", "soft_cap"), [(6, None), (None, 2.0), (6, 2.0), (64, None)])
def test_ragged_attention_with_window_and_soft_cap(window, soft_cap) -> None:
    """Each token attends like a dense softmax over the positions ``p - window < k <= p`` of its
    sequence, of scores ``cap * tanh(s / cap)``. The context loop reads 8-token chunks; values in
    every page behind the window of all rows of a view are NaN, so reading one would show: the loop
    starts past them (single rows from chunk 3, blocks from chunk 1). Page 0, where padding rows
    point, stays clean."""
    import jax

    rng = np.random.RandomState(2)
    kvh, h, d, ps, n_pages, span = 2, 6, 8, 4, 64, 8
    shape, spans, batch = mixed_step(rng, n_pages, ps, WINDOWED, first_page=1)
    k_np = rng.randn(1, kvh, n_pages + 1, ps, d).astype(np.float32)  # and the spare page
    v_np = rng.randn(1, kvh, n_pages + 1, ps, d).astype(np.float32)
    clean = v_np.copy()
    if window is not None:
        for view in ([s for s in spans if len(s.token_ids) == 1], [s for s in spans if len(s.token_ids) > 1]):
            first_chunk = max(0, min(s.start for s in view) - window + 1) // span
            for s in view:
                for j, page in enumerate(s.pages):
                    if j * ps // span < first_chunk:
                        v_np[0, :, page] = np.nan
        assert np.isnan(v_np).any() == (window < 20)
    cache = KVCache(jnp.asarray(k_np), jnp.asarray(v_np))
    q = rng.randn(shape.tokens, h, d).astype(np.float32)
    attend = jax.jit(lambda q, c, b: ragged_attention(q, c, 0, b, sm_scale=0.3, window=window, soft_cap=soft_cap))
    got = np.asarray(attend(jnp.asarray(q), cache, batch))
    assert np.isfinite(got).all()
    at = 0
    for span_ in spans:
        slots = [(page, off) for page in span_.pages for off in range(ps)]
        for j in range(len(span_.token_ids)):
            pos = span_.start + j
            for head in range(h):
                kh = head // (h // kvh)
                keys = np.stack([k_np[0, kh, pg, off] for pg, off in slots])
                vals = np.stack([clean[0, kh, pg, off] for pg, off in slots])
                want = _dense(q[at + j, head], keys, vals, pos, window, soft_cap, 0.3)
                np.testing.assert_allclose(got[at + j, head], want, atol=1e-5)
        at += len(span_.token_ids)


def test_backend_switch_checks_that_the_kernel_fits() -> None:
    from myserve.errors import ConfigError
    from myserve.ops.attention import resolve_backend
    from myserve.ops.tpu_attention import pallas_fit

    # The kernel's own validator plus its TPU tiling; the reasons name the misfit.
    assert pallas_fit(32, 8, 128, 16) is None  # Llama-3.1-8B
    assert pallas_fit(9, 3, 64, 16) == "head_dim 64 is not a multiple of 128"  # SmolLM2: reference
    assert pallas_fit(32, 8, 128, 4) == "page_size 4 is not a multiple of 8"
    assert "divisible" in (pallas_fit(32, 6, 128, 16) or "")
    shapes = dict(num_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
    assert resolve_backend("auto", **shapes) == "reference"  # this CPU: no TPU, the reference
    assert resolve_backend("reference", **shapes) == "reference"
    with pytest.raises(ConfigError, match="needs a TPU"):
        resolve_backend("pallas", **shapes)


def test_the_gpu_decode_kernel_is_not_used_for_windows_or_soft_caps(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU decode kernel masks by length only: a model with a sliding window or a score cap
    fails with the reason when that kernel is named ("pallas_decode"); ``auto`` and ``pallas`` take
    the ragged GPU kernel, which does both (as the TPU kernel does)."""
    import jax

    from myserve.errors import ConfigError
    from myserve.ops.attention import resolve_backend
    from myserve.ops.gpu_attention import gpu_fit

    shapes = dict(num_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
    assert gpu_fit(**shapes, sliding_window=True) == "the kernel has no sliding-window attention"
    assert gpu_fit(**shapes, soft_cap=True) == "the kernel has no attention soft cap"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve_backend("auto", **shapes, sliding_window=True) == "pallas_gpu_ragged"
    assert resolve_backend("pallas", **shapes, soft_cap=True) == "pallas_gpu_ragged"
    with pytest.raises(ConfigError, match="no sliding-window"):
        resolve_backend("pallas_decode", **shapes, sliding_window=True)
    with pytest.raises(ConfigError, match="no attention soft cap"):
        resolve_backend("pallas_decode", **shapes, soft_cap=True)


def test_a_step_writes_its_tokens_to_their_slots_and_its_padding_to_the_spare_page() -> None:
    """Each real token's K/V lands in its page at ``position % page_size``; the step's padding
    tokens (a 32-token step holding fewer) write only the spare page past the pool, so every other
    slot of the pool keeps what it held."""
    import jax

    rng = np.random.RandomState(3)
    kvh, d, ps, n_pages = 2, 8, 4, 64
    shape, spans, batch = mixed_step(rng, n_pages, ps)
    real = sum(len(span.token_ids) for span in spans)
    assert real < shape.tokens  # the step has padding
    before = rng.randn(1, kvh, n_pages + 1, ps, d).astype(np.float32)
    cache = KVCache(jnp.asarray(before), jnp.asarray(before))
    assert cache.num_pages == n_pages and cache.spare_page == n_pages
    k_new = rng.randn(1, shape.tokens, kvh, d).astype(np.float32)
    after = np.asarray(jax.jit(write_kv, static_argnums=1)(cache, 0, jnp.asarray(k_new), -jnp.asarray(k_new), batch).k)
    want = before.copy()
    flat = 0
    for span in spans:
        for pos in range(span.start, span.start + len(span.token_ids)):
            want[0, :, span.pages[pos // ps], pos % ps] = k_new[0, flat]
            flat += 1
    np.testing.assert_array_equal(after[:, :, :n_pages], want[:, :, :n_pages])
    assert not np.array_equal(after[:, :, n_pages], before[:, :, n_pages])  # the padding went there


def test_a_one_token_step_writes_its_slot_or_only_the_spare_page() -> None:
    """A one-token step (a one-row decode call) writes its token's slot; a row that stopped (its
    write page the spare one, as the decode loop sets it) leaves the whole pool as it was."""
    import dataclasses

    import jax

    rng = np.random.RandomState(4)
    kvh, d, ps, n_pages = 2, 8, 4, 16
    shape = shape_for(1, max_pages=2, block_tokens=1, chunk_pages=1)
    batch = device_batch([Span([0], 5, [3, 7], samples=True)], shape, ps)
    before = rng.randn(1, kvh, n_pages + 1, ps, d).astype(np.float32)
    cache = KVCache(jnp.asarray(before), jnp.asarray(before))
    k_new = rng.randn(1, 1, kvh, d).astype(np.float32)
    write = jax.jit(write_kv, static_argnums=1)
    after = np.asarray(write(cache, 0, jnp.asarray(k_new), jnp.asarray(k_new), batch).k)
    want = before.copy()
    want[0, :, 7, 5 % ps] = k_new[0, 0]
    np.testing.assert_array_equal(after, want)
    stopped = dataclasses.replace(batch, write_pages=jnp.full_like(batch.write_pages, cache.spare_page))
    after = np.asarray(write(cache, 0, jnp.asarray(k_new), jnp.asarray(k_new), stopped).k)
    np.testing.assert_array_equal(after[:, :, :n_pages], before[:, :, :n_pages])
    np.testing.assert_array_equal(after[0, :, n_pages, 5 % ps], k_new[0, 0])
