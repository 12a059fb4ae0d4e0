"""The paged path equals a full forward: chunked prefill into scrambled pages, then decode steps."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from myserve.ops.paged_attention import KVCache, reference_paged_attention, write_kv
from myserve.runtime.batch_layout import Entry, balance, grouped_batch, row_batch
from myserve.runtime.kv_cache import init_kv_cache
from myserve.runtime.steps import forward_all_logits, page_batch
from myserve.testing import hf_logits

NUM_PAGES = 64


def run_paged(model, mesh, mapping, ids, *, prompt_len, chunk, page_size, pages) -> np.ndarray:
    """Logits [T, vocab] for ``ids``: prompt in chunks of ``chunk``, then one token per decode step."""
    cache = init_kv_cache(model.spec, NUM_PAGES, page_size, jnp.float32, mesh, mapping)
    width = len(pages)
    out, computed = [], 0
    while computed < len(ids):
        t = chunk if computed < prompt_len else 1
        step = ids[computed : min(computed + t, prompt_len if computed < prompt_len else len(ids))]
        row = np.zeros((1, t), np.int32)
        row[0, : len(step)] = step
        batch = page_batch([computed], [len(step)], [pages], tokens_per_row=t, pages_per_row=width, page_size=page_size)
        logits, cache = forward_all_logits(model, jnp.asarray(row), batch, cache)
        out.append(np.asarray(logits[0, : len(step)]))
        computed += len(step)
    return np.concatenate(out)


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
    """One padded prefill of 3 sequences (lengths 5, 17, 33), then batched decode steps."""
    model, mesh, mapping = tiny_llama
    page_size, rng = 4, np.random.RandomState(11)
    lens, steps = [5, 17, 33], 4
    seqs = [[int(t) for t in rng.randint(0, 256, size=n + steps)] for n in lens]
    perm = [int(p) for p in rng.permutation(NUM_PAGES)]
    tables = [perm[0:10], perm[10:20], perm[20:30]]
    cache = init_kv_cache(model.spec, NUM_PAGES, page_size, jnp.float32, mesh, mapping)
    t = max(lens)
    rows = np.zeros((3, t), np.int32)
    for i, n in enumerate(lens):
        rows[i, :n] = seqs[i][:n]
    batch = page_batch([0, 0, 0], lens, tables, tokens_per_row=t, pages_per_row=10, page_size=page_size)
    logits, cache = forward_all_logits(model, jnp.asarray(rows), batch, cache)
    got = [[np.asarray(logits[i, :n])] for i, n in enumerate(lens)]
    for s in range(steps):
        starts = [n + s for n in lens]
        row = np.asarray([[seqs[i][starts[i]]] for i in range(3)], np.int32)
        batch = page_batch(starts, [1, 1, 1], tables, tokens_per_row=1, pages_per_row=10, page_size=page_size)
        logits, cache = forward_all_logits(model, jnp.asarray(row), batch, cache)
        for i in range(3):
            got[i].append(np.asarray(logits[i]))
    for i in range(3):
        ref = hf_logits(tiny_checkpoints["llama3"], seqs[i])
        np.testing.assert_allclose(np.concatenate(got[i]), ref, atol=1e-4, rtol=0)


def test_reference_attention_matches_naive_numpy() -> None:
    """The op alone against a direct softmax(QK^T)V over each sequence's tokens, GQA group 2."""
    rng = np.random.RandomState(0)
    b, t, h, kvh, d, ps, n_pages = 2, 3, 4, 2, 8, 4, 10
    k_all = rng.randn(b, 9, kvh, d).astype(np.float32)
    v_all = rng.randn(b, 9, kvh, d).astype(np.float32)
    q = rng.randn(b, t, h, d).astype(np.float32)
    kv_lens = np.array([9, 7])  # row 1 has only 2 real query tokens (positions 5, 6)
    q_lens = np.array([3, 2])
    tables = np.array([[7, 2, 5], [0, 9, 3]], np.int32)
    cache = KVCache(jnp.zeros((1, kvh, n_pages, ps, d), jnp.float32), jnp.zeros((1, kvh, n_pages, ps, d), jnp.float32))
    # Write all 9 (or 7) tokens of each row through the op's own write path, in one step.
    wb = page_batch([0, 0], list(kv_lens), [list(r) for r in tables], tokens_per_row=9, pages_per_row=3, page_size=ps)
    cache = write_kv(cache, 0, jnp.asarray(k_all), jnp.asarray(v_all), wb)
    positions = np.stack([np.arange(6, 9), np.array([5, 6, 0])]).astype(np.int32)
    qb = page_batch([6, 5], list(q_lens), [list(r) for r in tables], tokens_per_row=3, pages_per_row=3, page_size=ps)
    out = np.asarray(reference_paged_attention(jnp.asarray(q), cache, 0, qb, sm_scale=d**-0.5))
    for i in range(b):
        for j in range(q_lens[i]):
            p = positions[i, j]
            for head in range(h):
                kh = head // (h // kvh)
                s = k_all[i, : p + 1, kh] @ q[i, j, head] * d**-0.5
                w = np.exp(s - s.max())
                w /= w.sum()
                np.testing.assert_allclose(out[i, j, head], w @ v_all[i, : p + 1, kh], atol=1e-5)


def test_grouped_decode_layout_equals_rows_layout() -> None:
    """Decode rows read through balanced groups (pages concatenated) give the rows-layout result."""
    rng = np.random.RandomState(1)
    kvh, h, d, ps, n_pages, rows, group = 2, 6, 8, 4, 64, 8, 2
    lens = [3, 17, 1, 9, 30, 12, 5]  # 7 real rows, one padding row; very uneven contexts
    perm = [int(p) for p in rng.permutation(n_pages)]
    tables, used = [], 0
    for n in lens:
        tables.append(perm[used : used + -(-n // ps)])
        used += len(tables[-1])
    shape = (1, kvh, n_pages, ps, d)
    cache = KVCache(jnp.asarray(rng.randn(*shape), jnp.float32), jnp.asarray(rng.randn(*shape), jnp.float32))
    q = rng.randn(rows, 1, h, d).astype(np.float32)
    entries = [Entry([0], n - 1, t) for n, t in zip(lens, tables, strict=True)]
    _, by_rows = row_batch([*entries, None], rows=rows, tokens_per_row=1, width=8, page_size=ps).device()
    want = np.asarray(reference_paged_attention(jnp.asarray(q), cache, 0, by_rows, sm_scale=d**-0.5))
    order, most = balance([len(t) for t in tables], rows, group)
    assert most <= 8  # 28 pages over 4 groups: balanced, not the longest row times the group size
    slots = [None if i is None else entries[i] for i in order]
    _, grouped = grouped_batch(slots, group=group, group_width=8, page_size=ps).device()
    assert grouped.grouped and not by_rows.grouped
    q_grouped = np.stack([q[i] if i is not None else q[7] for i in order])
    got = np.asarray(reference_paged_attention(jnp.asarray(q_grouped), cache, 0, grouped, sm_scale=d**-0.5))
    for slot, i in enumerate(order):
        if i is not None:
            np.testing.assert_allclose(got[slot], want[i], atol=1e-5)


def test_backend_switch_checks_that_the_kernel_fits() -> None:
    from myserve.errors import ConfigError
    from myserve.ops.paged_attention import pallas_fit, resolve_backend

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
