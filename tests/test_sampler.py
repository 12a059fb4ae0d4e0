"""Sampler numerics against numpy references on tiny vocabularies (runtime/sampler.py)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from myserve.runtime.sampler import (
    SampleOutput,
    SamplingArrays,
    argmax,
    greedy_params,
    keep_threshold,
    process_logits,
    sample,
)

# Most tests share one shape (N rows of V tokens, NB bias and NS banned slots, K top logprobs) so
# that `sample` compiles only a few times: compilation dominates this file's run time. V > 256 so
# that the default 256 candidates are a real prefilter and the blocked Gumbel-max has two blocks.
N, V, NB, NS, K = 1024, 300, 2, 3, 3


@functools.cache
def _jitted(num_top_logprobs: int, candidates: int) -> Any:
    return jax.jit(functools.partial(sample, num_top_logprobs=num_top_logprobs, candidates=candidates))


def run(
    logits: np.ndarray,
    params: SamplingArrays,
    counts: np.ndarray | None = None,
    prompt: np.ndarray | None = None,
    *,
    candidates: int = 256,
) -> SampleOutput:
    counts = np.zeros(logits.shape, np.int32) if counts is None else counts
    prompt = np.zeros(logits.shape, bool) if prompt is None else prompt
    return _jitted(K, candidates)(jnp.asarray(logits), params, jnp.asarray(counts), jnp.asarray(prompt))


def make(batch: int = N, **fields: Any) -> SamplingArrays:
    """Greedy defaults with the given fields overridden (scalars broadcast to every row)."""
    base = greedy_params(batch, NB, NS)
    over = {
        name: jnp.broadcast_to(jnp.asarray(value, getattr(base, name).dtype), getattr(base, name).shape)
        for name, value in fields.items()
    }
    return dataclasses.replace(base, **over)


def np_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def np_keep(row: np.ndarray, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Reference: tokens kept by top-k, then top-p (smallest prefix with mass >= p), then min-p."""
    keep = np.ones(row.shape, bool)
    desc = np.sort(row)[::-1]
    if 0 < top_k < row.size:
        keep &= row >= desc[top_k - 1]
    probs = np_softmax(np.where(keep, row, -np.inf).astype(np.float64))
    if top_p < 1:
        p_desc = np.sort(probs)[::-1]
        n = int(np.searchsorted(np.cumsum(p_desc), top_p) + 1)  # first prefix whose mass >= top_p
        keep &= probs >= p_desc[n - 1]
    if min_p > 0:
        keep &= probs >= min_p * probs.max()
    return set(np.flatnonzero(keep).tolist())


def random_logits(rng: np.random.Generator, b: int, v: int = V, scale: float | np.ndarray = 2.0) -> np.ndarray:
    return (rng.standard_normal((b, v)) * scale).astype(np.float32)


def repeat(row: np.ndarray) -> np.ndarray:
    return np.repeat(row[None], N, axis=0)


def test_process_logits_matches_numpy_formula() -> None:
    rng = np.random.default_rng(0)
    b = 4
    logits = random_logits(rng, b)
    counts = rng.integers(0, 3, (b, V)).astype(np.int32) * (rng.random((b, V)) < 0.2)
    prompt = rng.random((b, V)) < 0.2
    bias_ids = np.array([[3, 7], [0, -1], [99, 5], [-1, -1]], np.int32)
    bias_values = rng.standard_normal((b, NB)).astype(np.float32) * 5
    banned = np.array([[1, -1, -1], [2, 3, -1], [-1, -1, -1], [99, 50, 7]], np.int32)
    params = make(
        b,
        temperature=1.0,
        repetition_penalty=[1.0, 1.3, 0.8, 2.0],
        frequency_penalty=[0.5, 0.0, -0.3, 1.0],
        presence_penalty=[0.0, 0.7, 0.2, -1.0],
        bias_ids=bias_ids,
        bias_values=bias_values,
        banned_ids=banned,
    )
    got = np.asarray(jax.jit(process_logits)(jnp.asarray(logits), params, jnp.asarray(counts), jnp.asarray(prompt)))

    want = logits.astype(np.float64)
    for r in range(b):
        for i, val in zip(bias_ids[r], bias_values[r], strict=True):
            if i >= 0:
                want[r, i] += val
        want[r, banned[r][banned[r] >= 0]] = -np.inf
    rp = np.asarray(params.repetition_penalty, np.float64)[:, None]
    want = np.where(prompt | (counts > 0), np.where(want > 0, want / rp, want * rp), want)
    want -= np.asarray(params.frequency_penalty)[:, None] * counts
    want -= np.asarray(params.presence_penalty)[:, None] * (counts > 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.isneginf(got).sum() == 6
    # The same rows read from penalty tables by slot (the engine's form) give the same logits.
    slots = np.array([2, 0, 3, 1], np.int32)
    tables = [np.zeros((5, V), a.dtype) for a in (counts, prompt)]
    for table, rows in zip(tables, (counts, prompt), strict=True):
        table[slots] = rows
    by_slot = jax.jit(process_logits)(jnp.asarray(logits), params, *map(jnp.asarray, tables), jnp.asarray(slots))
    np.testing.assert_array_equal(np.asarray(by_slot), got)


def test_argmax_is_the_first_largest_index() -> None:
    rng = np.random.default_rng(3)
    ties = rng.integers(0, 4, (64, 1000)).astype(np.float32)  # many equal maxima per row
    x = np.concatenate([ties, rng.standard_normal((8, 1000)).astype(np.float32)])
    x[-1, :] = -np.inf
    x[-1, 777] = 0.0
    for block in (256, 7, 1000, 4096):
        np.testing.assert_array_equal(np.asarray(argmax(jnp.asarray(x), block)), np.argmax(x, axis=-1))


def test_without_logprobs_the_tokens_are_the_same() -> None:
    rng = np.random.default_rng(4)
    logits = random_logits(rng, 16)
    params = make(16, temperature=[0.0, 0.7] * 8, top_p=0.9, seed=np.arange(16))
    counts, prompt = jnp.zeros((16, V), jnp.int32), jnp.zeros((16, V), bool)
    with_lp = run(logits, params)
    fn = functools.partial(sample, num_top_logprobs=K, logprobs=False)
    without = jax.jit(fn)(jnp.asarray(logits), params, counts, prompt)
    np.testing.assert_array_equal(np.asarray(without.tokens), np.asarray(with_lp.tokens))
    assert without.top_ids.shape == (16, 0)


def test_greedy_top_k_1_and_temperature_0_are_argmax() -> None:
    rng = np.random.default_rng(1)
    logits = random_logits(rng, N)
    bias: dict[str, Any] = {"bias_ids": [7, -1], "bias_values": [3.0, 0.0]}
    expected = np.argmax(logits + 3.0 * (np.arange(V) == 7), axis=-1)
    np.testing.assert_array_equal(run(logits, make(**bias)).tokens, expected)
    top1 = run(logits, make(temperature=1.5, top_k=1, position=np.arange(N) % 7, seed=np.arange(N), **bias))
    np.testing.assert_array_equal(top1.tokens, expected)


def test_logit_bias_bans_and_forces() -> None:
    rng = np.random.default_rng(2)
    row = random_logits(rng, 1)[0]
    top = int(np.argmax(row))
    banned = run(repeat(row), make(temperature=1.0, position=np.arange(N), bias_ids=[top, -1], bias_values=[-100, 0]))
    assert top not in set(np.asarray(banned.tokens).tolist())
    forced = run(repeat(row), make(temperature=1.0, position=np.arange(N), bias_ids=[42, -1], bias_values=[100, 0]))
    assert set(np.asarray(forced.tokens).tolist()) == {42}


def test_banned_ids_never_sampled() -> None:
    rng = np.random.default_rng(3)
    row = random_logits(rng, 1)[0]
    order = np.argsort(-row)
    params = make(temperature=np.where(np.arange(N) < 8, 0.0, 2.0), position=np.arange(N), banned_ids=order[:3])
    tokens = np.asarray(run(repeat(row), params).tokens)
    assert not set(tokens.tolist()) & set(order[:3].tolist())
    assert set(tokens[:8].tolist()) == {order[3]}  # greedy rows take the best allowed token
    assert len(set(tokens.tolist())) > 30


def test_keep_threshold_matches_numpy_on_both_paths() -> None:
    rng = np.random.default_rng(4)
    b = 40
    scaled = random_logits(rng, b, scale=rng.uniform(0.3, 3.0, (b, 1)))
    top_k = rng.choice([0, 1, 5, 30, 200], b)
    top_p = rng.choice([1.0, 0.5, 0.9, 0.99], b)
    min_p = rng.choice([0.0, 0.0, 0.05, 0.3], b)
    params = make(b, temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p)
    want = [np_keep(scaled[r], int(top_k[r]), float(top_p[r]), float(min_p[r])) for r in range(b)]
    # With 8 candidates, rows whose top-k/top-p set is larger must take the sorted fallback.
    sizes = np.array([len(np_keep(scaled[r], int(top_k[r]), float(top_p[r]), 0.0)) for r in range(b)])
    filtered = (top_k > 0) | (top_p < 1)
    assert (filtered & (sizes > 8)).sum() >= 10 and (filtered & (sizes < 8)).sum() >= 5
    thr = np.asarray(jax.jit(functools.partial(keep_threshold, candidates=8))(jnp.asarray(scaled), params))
    got = [set(np.flatnonzero(scaled[r] >= thr[r]).tolist()) for r in range(b)]
    assert got == want


def test_top_p_samples_exactly_the_nucleus_on_both_paths() -> None:
    rng = np.random.default_rng(5)
    row = random_logits(rng, 1, scale=3.0)[0]
    nucleus = np_keep(row, 0, 0.8, 0.0)
    assert 3 <= len(nucleus) <= 12
    params = make(temperature=1.0, top_p=0.8, seed=9, position=np.arange(N))
    fast = np.asarray(run(repeat(row), params).tokens)
    fallback = np.asarray(run(repeat(row), params, candidates=2).tokens)
    assert set(fast.tolist()) == nucleus
    np.testing.assert_array_equal(fast, fallback)


def test_min_p_removes_unlikely_tokens() -> None:
    rng = np.random.default_rng(6)
    row = random_logits(rng, 1, scale=2.0)[0]
    kept = np_keep(row, 0, 1.0, 0.2)
    assert 2 <= len(kept) < V // 4
    out = run(repeat(row), make(temperature=1.0, min_p=0.2, position=np.arange(N)))
    assert set(np.asarray(out.tokens).tolist()) == kept


def test_logprobs_are_raw_log_softmax() -> None:
    rng = np.random.default_rng(7)
    logits = random_logits(rng, N)
    counts = (rng.random((N, V)) < 0.3).astype(np.int32)
    params = make(
        temperature=np.linspace(0, 1.5, N),
        top_p=0.9,
        frequency_penalty=1.0,
        position=3,
        bias_ids=[11, -1],
        bias_values=[4.0, 0.0],
    )
    out = run(logits, params, counts)
    ref = np_log_softmax(logits.astype(np.float64))
    tokens = np.asarray(out.tokens)
    np.testing.assert_allclose(out.logprobs, ref[np.arange(N), tokens], rtol=1e-5, atol=1e-5)
    top = np.argsort(-ref, axis=-1)[:, :3]
    np.testing.assert_array_equal(out.top_ids, top)
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(ref, top, -1), rtol=1e-5, atol=1e-5)
    args = (jnp.asarray(logits), params, jnp.asarray(counts), jnp.zeros((N, V), bool))
    assert jax.eval_shape(functools.partial(sample, num_top_logprobs=0), *args).top_ids.shape == (N, 0)


def test_frequencies_match_softmax() -> None:
    # 20 live tokens spread over both blocks of the blocked Gumbel-max (tokens 0-255 and 256-299).
    rng = np.random.default_rng(8)
    temperature, calls = 0.8, 16
    live = np.sort(rng.choice(V, 20, replace=False))
    live[-3:] = [270, 285, 299]
    row = np.full(V, -60.0, np.float32)
    row[live] = rng.standard_normal(20) * 0.6
    observed = np.zeros(V, np.int64)
    for seed in range(calls):
        out = run(repeat(row), make(temperature=temperature, seed=seed, position=np.arange(N)))
        observed += np.bincount(np.asarray(out.tokens), minlength=V)
    assert set(np.flatnonzero(observed).tolist()) <= set(live.tolist())
    expected = calls * N * np_softmax(row[live].astype(np.float64) / temperature)
    assert expected.min() > 5
    chi2 = float(((observed[live] - expected) ** 2 / expected).sum())
    assert chi2 < 19 + 5 * np.sqrt(2 * 19), chi2


def test_rows_are_batch_invariant() -> None:
    rng = np.random.default_rng(9)
    b = 8
    logits = random_logits(rng, b, scale=2.5)
    logits[7] *= 0.05  # flat row: its nucleus needs the sorted fallback with 4 candidates
    counts = (rng.random((b, V)) < 0.1).astype(np.int32)
    prompt = rng.random((b, V)) < 0.1
    params = make(
        b,
        temperature=[0.0, 1.0, 0.7, 1.0, 1.3, 1.0, 0.0, 1.0],
        top_k=[0, 0, 5, 0, 40, 0, 3, 0],
        top_p=[1.0, 0.9, 1.0, 0.95, 0.8, 1.0, 0.5, 0.99],
        min_p=[0.0, 0.0, 0.0, 0.1, 0.0, 0.05, 0.0, 0.0],  # row 5: min-p only
        repetition_penalty=[1, 1, 1.2, 1, 1, 1, 1, 1],
        frequency_penalty=[0, 0.5, 0, 0, 0, 0, 0, 0],
        seed=np.arange(b) * 7 + 1,
        choice=[0, 1, 0, 2, 0, 0, 0, 1],
        bias_ids=np.where(np.arange(b)[:, None] == 3, [4, 9], -1),
        bias_values=np.full((b, NB), 2.0),
    )
    for position in range(3):
        p = dataclasses.replace(params, position=params.position + position)
        batch = run(logits, p, counts, prompt, candidates=4)
        for r in range(b):
            one = jax.tree.map(lambda x, r=r: x[r : r + 1], p)
            alone = run(logits[r : r + 1], one, counts[r : r + 1], prompt[r : r + 1], candidates=4)
            assert int(alone.tokens[0]) == int(batch.tokens[r]), (position, r)
            np.testing.assert_array_equal(alone.logprobs[0], batch.logprobs[r])


def test_seed_choice_and_position_change_the_sample() -> None:
    rng = np.random.default_rng(10)
    row = random_logits(rng, 1, scale=0.5)[0]
    group = np.arange(N) // 10  # rows 10g..10g+9: positions 0..9 of sequence g
    positions = np.arange(N) % 10
    by_seed = np.asarray(run(repeat(row), make(temperature=1.0, seed=group, position=positions)).tokens)
    by_choice = np.asarray(run(repeat(row), make(temperature=1.0, choice=group, position=positions)).tokens)
    for tokens in (by_seed, by_choice):
        sequences = {tuple(tokens[g * 10 : (g + 1) * 10].tolist()) for g in range(N // 10)}
        assert len(sequences) == N // 10
    assert len(set(by_seed[:10].tolist())) > 5  # the positions of one sequence differ too


def test_a_plain_greedy_batch_takes_the_raw_argmax_and_every_edit_still_applies() -> None:
    """The engine's variants are static: a greedy batch without logprobs or logit edits runs the
    ``argmax`` head (no processing); any other batch the ``sample`` head, where each kind of edit on
    a single greedy row must reach that row (and leave the others' argmax alone)."""
    b, words = 8, -(-V // 32)
    rng = np.random.default_rng(9)
    logits = random_logits(rng, b)
    top = np.argmax(logits, axis=-1)
    second = int(np.argsort(-logits[0])[1])

    @functools.partial(jax.jit, static_argnums=(4,))
    def step(params: SamplingArrays, counts: Any, prompt: Any, mask: Any, mode: str) -> SampleOutput:
        x = jnp.asarray(logits)
        argmax_only = mode == "argmax"
        flags = dict(all_greedy=argmax_only, logprobs=not argmax_only, processed=not argmax_only, filtered=False)
        return sample(x, params, counts, prompt, num_top_logprobs=K, bitmask=mask, **flags)

    def row0(shape: tuple[int, ...], fill: Any, value: Any, dtype: Any) -> np.ndarray:
        a = np.full(shape, fill, dtype)
        a[0, 0] = value
        return a

    counts, prompt = np.zeros((b, V), np.int32), np.zeros((b, V), bool)
    full_mask = np.full((b, words), -1, np.int32)
    plain = step(make(b), counts, prompt, full_mask, "argmax")
    np.testing.assert_array_equal(np.asarray(plain.tokens), top)
    with_lp = step(make(b), counts, prompt, full_mask, "sample")
    np.testing.assert_array_equal(np.asarray(with_lp.tokens), top)
    want_lp = np_log_softmax(logits.astype(np.float64))[np.arange(b), top]
    np.testing.assert_allclose(np.asarray(with_lp.logprobs), want_lp, rtol=1e-5, atol=1e-5)

    seen_top = prompt.copy()
    seen_top[0, top[0]] = True
    counted_top = counts.copy()
    counted_top[0, top[0]] = 1
    bits = full_mask.view(np.uint32).copy()
    bits[0, top[0] // 32] &= ~np.uint32(1 << (top[0] % 32))
    banned_mask = bits.view(np.int32)
    grammar = dataclasses.replace(make(b), constrained=jnp.asarray(np.arange(b) == 0))
    per_row = lambda value, neutral: np.where(np.arange(b) == 0, value, neutral)  # noqa: E731
    edits: dict[str, tuple[SamplingArrays, np.ndarray, np.ndarray, np.ndarray]] = {
        "logit_bias": (
            make(b, bias_ids=row0((b, NB), -1, top[0], np.int32), bias_values=row0((b, NB), 0.0, -100.0, np.float32)),
            counts,
            prompt,
            full_mask,
        ),
        "banned": (make(b, banned_ids=row0((b, NS), -1, top[0], np.int32)), counts, prompt, full_mask),
        "repetition": (make(b, repetition_penalty=per_row(1e6, 1.0)), counts, seen_top, full_mask),
        "frequency": (make(b, frequency_penalty=per_row(100.0, 0.0)), counted_top, prompt, full_mask),
        "presence": (make(b, presence_penalty=per_row(100.0, 0.0)), counted_top, prompt, full_mask),
        "grammar": (grammar, counts, prompt, banned_mask),
    }
    want = top.copy()
    want[0] = second
    for name, (params, c, p, m) in edits.items():
        got = np.asarray(step(params, c, p, m, "sample").tokens)
        np.testing.assert_array_equal(got, want, err_msg=name)
