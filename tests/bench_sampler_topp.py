"""Scratch benchmark of the sampler paths (not a test): ``python tests/bench_sampler_topp.py``.

Times the jitted ``sample`` at B=64, V=49152 on the host CPU: greedy, temperature only, the
candidate top-k/top-p path, the per-row sort fallback, and a naive full-vocab sort of the batch.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from myserve.runtime.sampler import (  # noqa: E402
    CANDIDATES,
    SamplingArrays,
    _thresholds,
    greedy_params,
    process_logits,
    sample,
)

B, V, RUNS = 64, 49152, 7


def median_ms(fn, *args) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(RUNS):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3)


def with_(params: SamplingArrays, **fields: float) -> SamplingArrays:
    """``params`` with each named field set to one value on every row."""
    full = {name: jnp.full((B,), value, getattr(params, name).dtype) for name, value in fields.items()}
    return dataclasses.replace(params, **full)


@jax.jit
def naive_full_sort(logits, params, counts, mask):
    """Reference implementation: sort every row of the batch, then top-k/top-p masks, then sample."""
    x = process_logits(logits, params, counts, mask) / params.temperature[:, None]
    vals = -jnp.sort(-x, axis=-1)
    k = jnp.where(params.top_k > 0, params.top_k, V)
    t_k = jnp.take_along_axis(vals, (k - 1)[:, None], axis=-1)
    probs = jax.nn.softmax(jnp.where(vals >= t_k, vals, -jnp.inf), axis=-1)
    keep = jnp.cumsum(probs, axis=-1) - probs < params.top_p[:, None]
    t_p = jnp.take_along_axis(vals, (keep.sum(-1) - 1)[:, None], axis=-1)
    keys = jax.vmap(jax.random.key)(params.seed)
    return jax.vmap(jax.random.categorical)(keys, jnp.where(x >= jnp.maximum(t_k, t_p), x, -jnp.inf))


def main() -> None:
    rng = np.random.default_rng(0)
    # Peaked like a confident language model: ~10 tokens per row carry ~97% of the mass, so every
    # row's top_p=0.9 nucleus lies inside the candidates. ``flat`` makes every row fall back.
    logits = jnp.asarray(rng.standard_normal((B, V), np.float32) * 2 + 16 * (rng.random((B, V)) < 2e-4))
    counts = jnp.zeros((B, V), jnp.int32)
    mask = jnp.zeros((B, V), bool)
    greedy = greedy_params(B)
    # The engine's three heads (runtime/model_step.py): each a static combination of flags.
    k = 20
    argmax = jax.jit(functools.partial(sample, num_top_logprobs=0, all_greedy=True, logprobs=False, processed=False))
    sampled = jax.jit(functools.partial(sample, num_top_logprobs=k, filtered=False))
    run = jax.jit(functools.partial(sample, num_top_logprobs=k))  # the filter head
    run_small = jax.jit(functools.partial(sample, num_top_logprobs=k, candidates=8))
    topp = with_(greedy, temperature=1.0, top_p=0.9)
    flat = jnp.asarray(rng.standard_normal((B, V), np.float32) * 0.1)
    cases = {
        "argmax head: greedy": (argmax, logits, greedy),
        "sample head: greedy rows": (sampled, logits, greedy),
        "sample head: temperature 1": (sampled, logits, with_(greedy, temperature=1.0)),
        "filter head: top_k=50": (run, logits, with_(greedy, temperature=1.0, top_k=50)),
        "filter head: top_p=0.9": (run, logits, topp),
        "filter head: top_p=0.9, 1 row falls back": (run, jnp.where(jnp.arange(B)[:, None] == 0, flat, logits), topp),
        "filter head: all rows fall back": (run_small, flat, topp),
        "naive full sort, top_p=0.9": (naive_full_sort, logits, topp),
    }
    _, fits = _thresholds(jax.lax.top_k(logits, CANDIDATES)[0], logits.max(-1), jax.nn.logsumexp(logits, -1), topp, V)
    print(f"B={B} V={V}; rows whose nucleus fits in {CANDIDATES} candidates: {int(fits.sum())}/{B}")
    for name, (fn, x, params) in cases.items():
        print(f"{name:32s} {median_ms(fn, x, params, counts, mask):8.1f} ms", flush=True)

    # Batch invariance at full size: rows of a mixed batch (greedy, top_p, top_k, temperature only,
    # fallback rows) sampled again one at a time.
    mixed = dataclasses.replace(
        topp,
        temperature=jnp.asarray(rng.choice([0.0, 0.7, 1.0], B), jnp.float32),
        top_p=jnp.asarray(rng.choice([1.0, 0.9, 0.99], B), jnp.float32),
        top_k=jnp.asarray(rng.choice([0, 0, 40], B), jnp.int32),
        seed=jnp.arange(B, dtype=jnp.uint32),
    )
    x = jnp.where(jnp.arange(B)[:, None] % 5 == 0, flat, logits)
    batch = run(x, mixed, counts, mask).tokens
    for r in range(0, B, 4):
        one = jax.tree.map(lambda a, r=r: a[r : r + 1], mixed)
        assert int(run(x[r : r + 1], one, counts[:1], mask[:1]).tokens[0]) == int(batch[r]), r
    print("batch invariance at full size: ok")


if __name__ == "__main__":
    main()
