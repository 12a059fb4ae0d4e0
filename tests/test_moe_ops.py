"""The grouped expert MLP (``ops/moe.py``): every implementation (the GPU kernel interpreted) against
a per-token reference, under any routing (skewed, every token on one expert), and split across expert shards."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from myserve.ops.moe import block_rows, expert_mlp, route


def reference(x, ids, weights, gate_up, down) -> np.ndarray:
    """Each token's weighted sum of its experts' SiLU-gated MLPs, one token at a time (numpy, float64)."""
    out = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            gate, up = x[t] @ gate_up[e, :, 0], x[t] @ gate_up[e, :, 1]
            out[t] += weights[t, j] * ((gate / (1 + np.exp(-gate)) * up) @ down[e])
    return out


def problem(t: int, e: int, k: int, seed: int, skew: bool = False):
    rng = np.random.RandomState(seed)
    h, i = 16, 8
    x = rng.randn(t, h).astype(np.float32)
    gate_up = (rng.randn(e, h, 2, i) * 0.3).astype(np.float32)
    down = (rng.randn(e, i, h) * 0.3).astype(np.float32)
    logits = rng.randn(t, e).astype(np.float32)
    if skew:  # every token's top choice is expert e - 1
        logits[:, e - 1] += 10.0
    weights, ids = route(jnp.asarray(logits), k, normalize=True)
    return x, np.asarray(ids), np.asarray(weights), gate_up, down


@pytest.mark.parametrize("impl", ["loop", "ragged_dot", "pallas"])
@pytest.mark.parametrize(
    ("t", "e", "k", "skew"), [(1, 8, 2, False), (5, 4, 2, True), (37, 8, 3, False), (64, 6, 6, True)]
)
def test_grouped_mlp_matches_per_token_reference(impl: str, t: int, e: int, k: int, skew: bool) -> None:
    x, ids, weights, gate_up, down = problem(t, e, k, seed=t + e, skew=skew)
    got = jax.jit(expert_mlp, static_argnames=("act", "impl"))(
        x, ids, weights, gate_up, down, act=jax.nn.silu, impl=impl
    )
    np.testing.assert_allclose(np.asarray(got), reference(x, ids, weights, gate_up, down), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["loop", "ragged_dot", "pallas"])
def test_expert_shards_sum_to_the_whole(impl: str) -> None:
    """Each shard computes only its experts' assignments; the shards' sum is the whole answer."""
    x, ids, weights, gate_up, down = problem(23, 8, 2, seed=3, skew=True)
    whole = reference(x, ids, weights, gate_up, down)
    parts = [
        expert_mlp(x, ids, weights, gate_up[s : s + 2], down[s : s + 2], jax.nn.silu, first_expert=s, impl=impl)
        for s in range(0, 8, 2)
    ]
    np.testing.assert_allclose(np.asarray(sum(parts)), whole, atol=2e-5, rtol=1e-5)


def test_routing_renormalises_only_when_asked() -> None:
    logits = jnp.asarray([[0.0, 1.0, 2.0, 3.0]])
    w, ids = route(logits, 2, normalize=False)
    probs = np.exp([0.0, 1.0, 2.0, 3.0]) / np.exp([0.0, 1.0, 2.0, 3.0]).sum()
    assert ids.tolist() == [[3, 2]]
    np.testing.assert_allclose(np.asarray(w), [[probs[3], probs[2]]], rtol=1e-6)
    w, _ = route(logits, 2, normalize=True)
    np.testing.assert_allclose(np.asarray(w).sum(), 1.0, rtol=1e-6)


def test_block_rows_grow_with_assignments_per_expert() -> None:
    assert block_rows(8, 64) == 1  # a one-token step: each block one row, a matrix-vector product
    assert block_rows(256, 64) == 4
    assert block_rows(4096, 64) == 64
    assert block_rows(10**6, 8) == 256


def test_the_three_dispatch_schemes_agree_on_a_fake_mesh() -> None:
    """``bench.moe_collectives`` (replicated + psum, all-gather + reduce-scatter, all-to-all) on 4 fake
    devices: it checks that the three give the same output before timing them."""
    import subprocess
    import sys

    args = ["--tokens", "8,24", "--ep", "4", "--experts", "8", "--k", "2", "--hidden", "16", "--width", "8"]
    proc = subprocess.run(
        [sys.executable, "-m", "myserve.bench.moe_collectives", *args, "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("\n") == 4  # the header lines and one row per token count
