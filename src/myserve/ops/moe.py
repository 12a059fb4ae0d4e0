"""Mixture-of-Experts routing and the grouped expert MLP of a ragged step.

Each of a step's ``T`` flat tokens is routed to ``k`` experts (``route``); the ``T * k``
(token, expert) assignments are sorted by expert, so each expert's tokens are one contiguous group,
and every expert's MLP runs as one grouped matmul over its group (``expert_mlp``). Shapes are fixed
by ``T`` alone: routing changes the group sizes, never a shape, so nothing recompiles as it
changes, and there is no per-expert Python loop. No token is ever dropped: there is no capacity
factor, a group may hold every assignment of the step (serving must be exact).

Two implementations of the grouped matmul, the same numbers (``tests/test_moe_ops.py``):

- ``ragged_dot``: ``jax.lax.ragged_dot`` over the sorted rows, for TPU, where XLA runs it as a
  grouped matmul. XLA:CPU instead expands it into a dense matmul over *every* expert (measured:
  8 rows on 64 experts of 1024x512, 71 ms against 2 ms for the blocks below), so it is not used there.
- ``blocks`` (CPU and GPU): each expert's group is padded to a multiple of a block of ``B`` rows,
  and each block multiplies its rows by its one expert's weights, gathered per block. A step reads
  the weights of the experts it uses, about once each (plus one partial block per used expert), so
  a decode step costs its *active* parameters, not the total. ``B`` grows with the step's
  assignments per expert (1 for a decode step, where each block is one token's matrix-vector
  product), which bounds the blocks at ``T * k / B + min(E, T * k)``.

With experts sharded over the mesh's ``expert`` axis each device passes its own slice of the
weights and ``first_expert``: assignments to other devices' experts go to a last, dropped group,
and the caller sums the devices' partial outputs (``models/moe.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp

GroupedImpl = Literal["ragged_dot", "blocks"]

MAX_BLOCK_ROWS = 256
"""Upper bound on the rows of one block (a prefill step with many tokens per expert)."""


def route(router_logits: jax.Array, k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """Softmax routing as transformers does it: the float32 softmax of ``router_logits`` [T, E],
    its top ``k`` (ties to the lower expert id), renormalised to sum to 1 when ``normalize``.
    Returns (weights [T, k] float32, expert ids [T, k] int32)."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def grouped_impl() -> GroupedImpl:
    """The grouped matmul for this platform: ``ragged_dot`` on TPU, ``blocks`` elsewhere."""
    return "ragged_dot" if jax.default_backend() == "tpu" else "blocks"


def block_rows(assignments: int, experts: int) -> int:
    """Rows per block for ``assignments`` routed rows over ``experts`` experts: the next power of
    two of the mean rows per expert, in [1, MAX_BLOCK_ROWS] (static: a function of shapes)."""
    mean = -(-assignments // max(experts, 1))
    return min(MAX_BLOCK_ROWS, 1 << max(mean - 1, 0).bit_length())


def expert_mlp(
    x: jax.Array,
    ids: jax.Array,
    weights: jax.Array,
    gate_up: jax.Array,
    down: jax.Array,
    act: Callable[[jax.Array], jax.Array],
    *,
    first_expert: int | jax.Array = 0,
    impl: GroupedImpl = "blocks",
) -> jax.Array:
    """The routed experts' weighted sum for each token: ``sum_j weights[t, j] * MLP_{ids[t, j]}(x[t])``
    over the assignments whose expert is among ``gate_up``'s.

    ``x`` [T, H]; ``ids``, ``weights`` [T, k] from ``route``; ``gate_up`` [E, H, 2, I] (gate, up)
    and ``down`` [E, I, H]: experts ``first_expert .. first_expert + E - 1``; ``act`` the gate's
    activation. Returns float32 [T, H].
    """
    t, k = ids.shape
    e = gate_up.shape[0]
    local = ids.reshape(-1) - first_expert
    # Assignments to other devices' experts form group ``e``, sorted after every local group.
    group = jnp.where((local >= 0) & (local < e), local, e)
    order = jnp.argsort(group, stable=True)
    sorted_group = group[order]
    token = (order // k).astype(jnp.int32)
    row_weight = jnp.where(sorted_group < e, weights.reshape(-1)[order], 0.0)
    sizes = jnp.bincount(group, length=e + 1)[:e].astype(jnp.int32)
    if impl == "ragged_dot":
        y = _ragged(x[token], gate_up, down, sizes, act)
        rows = token
    else:
        y, rows, row_weight = _blocks(x, token, sorted_group, row_weight, sizes, gate_up, down, act)
    y = y * row_weight[:, None]
    # Rows pointing at T (padding, other devices' assignments) land in a dropped extra row.
    return jnp.zeros((t + 1, x.shape[1]), jnp.float32).at[rows].add(y)[:t]


def _ragged(
    xs: jax.Array, gate_up: jax.Array, down: jax.Array, sizes: jax.Array, act: Callable[[jax.Array], jax.Array]
) -> jax.Array:
    """Both matmuls as ``lax.ragged_dot`` over rows sorted by expert (rows past the groups give 0)."""
    e, h, _, i = gate_up.shape
    gu = jax.lax.ragged_dot(xs, gate_up.reshape(e, h, 2 * i), sizes, preferred_element_type=jnp.float32)
    gu = gu.reshape(-1, 2, i)
    hidden = (act(gu[:, 0]) * gu[:, 1]).astype(down.dtype)
    return jax.lax.ragged_dot(hidden, down, sizes, preferred_element_type=jnp.float32)


def _blocks(
    x: jax.Array,
    token: jax.Array,
    sorted_group: jax.Array,
    row_weight: jax.Array,
    sizes: jax.Array,
    gate_up: jax.Array,
    down: jax.Array,
    act: Callable[[jax.Array], jax.Array],
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Both matmuls over blocks of ``B`` rows of one expert each: returns the rows' outputs
    [nb * B, H] float32, the token of each row (``T`` for padding) and each row's weight."""
    t, hdim = x.shape
    e = gate_up.shape[0]
    n = token.shape[0]
    b = block_rows(n, e)
    num_blocks = -(-(n + min(e, n) * (b - 1)) // b)
    padded = -(-sizes // b) * b
    padded_end = jnp.cumsum(padded)
    padded_start = padded_end - padded
    start = jnp.cumsum(sizes) - sizes
    g = jnp.minimum(sorted_group, e - 1)
    # Sorted assignment j of a local group goes to row padded_start[g] + (j - start[g]).
    row = jnp.where(sorted_group < e, padded_start[g] + jnp.arange(n) - start[g], num_blocks * b)
    row_token = jnp.full((num_blocks * b,), t, jnp.int32).at[row].set(token, mode="drop")
    weight = jnp.zeros((num_blocks * b,), jnp.float32).at[row].set(row_weight, mode="drop")
    block_expert = jnp.minimum(jnp.searchsorted(padded_end, jnp.arange(num_blocks) * b, side="right"), e - 1)
    xs = jnp.concatenate([x, jnp.zeros((1, hdim), x.dtype)])[row_token].reshape(num_blocks, b, hdim)
    gu = jnp.einsum("nbh,nhgi->nbgi", xs, gate_up[block_expert], preferred_element_type=jnp.float32)
    hidden = (act(gu[:, :, 0]) * gu[:, :, 1]).astype(down.dtype)
    y = jnp.einsum("nbi,nih->nbh", hidden, down[block_expert], preferred_element_type=jnp.float32)
    return y.reshape(num_blocks * b, hdim), row_token, weight
