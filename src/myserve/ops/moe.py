"""Mixture-of-Experts routing and the grouped expert MLP of a ragged step.

Each of a step's ``T`` flat tokens is routed to ``k`` experts (``route``); the ``T * k``
(token, expert) assignments are sorted by expert, so each expert's tokens are one contiguous group,
and every expert's MLP runs as one grouped matmul over its group (``expert_mlp``). Shapes are fixed
by ``T`` alone: routing changes the group sizes, never a shape, so nothing recompiles as it
changes, and there is no per-expert Python loop. No token is ever dropped: there is no capacity
factor, a group may hold every assignment of the step (serving must be exact).

Three implementations of the grouped matmul, the same numbers (``tests/test_moe_ops.py``), chosen by
``engine.moe_backend`` (``resolve_moe_backend``):

- ``ragged_dot``: ``jax.lax.ragged_dot`` over the sorted rows, for TPU, where XLA runs it as a
  grouped matmul. XLA:CPU instead expands it into a dense matmul over *every* expert (measured:
  8 rows on 64 experts of 1024x512, 71 ms against 2 ms for the loop below), so it is not used there.
- ``loop`` (CPU and GPU): a loop of static length over *tiles*: each tile is ``B`` consecutive
  rows of one expert's group (``B`` the next power of two of the mean rows per expert: 1 for a
  one-token step), with that expert's weights. Each expert's group takes ``ceil(rows / B)`` tiles,
  so a step has at most ``(n + (B - 1) * min(E, n)) / B`` of them (``n`` routed rows): the loop's
  length is that bound, fixed by the shapes, and tiles past the step's real ones compute nothing
  that is kept. No conditional and no data-dependent trip count: on a GPU either is a host round
  trip (``docs/design/runtime.md``). A decode step (``B = 1``) has one tile per routed row, so it
  reads the weights of the experts it uses, its *active* parameters, not the total. XLA:CPU
  copies a dynamically indexed weight before its dot reads it, so a prefill step whose experts
  take several tiles copies an expert's weights once per tile (about twice the used experts'
  bytes at the mean group size).
- ``pallas`` (GPU, by choice): the grouped matmul kernel of ``ops/gpu_grouped_matmul.py`` over the
  same tiles (at least 16 rows each), one call per matmul, narrow experts read as stored
  (``_expert_kernel``).

With experts sharded over the mesh's ``expert`` axis each device passes its own slice of the
weights and ``first_expert``: assignments to other devices' experts go to a last, dropped group,
and the caller sums the devices' partial outputs (``models/moe.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp

from myserve.errors import ConfigError
from myserve.ops import gpu_grouped_matmul
from myserve.ops.dequant import StackedNarrow

GroupedImpl = Literal["ragged_dot", "loop", "pallas"]

MAX_BLOCK_ROWS = 256
"""Upper bound on the rows of one block of the loop (a prefill step with many tokens per expert)."""


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
    """The grouped matmul for this platform: ``ragged_dot`` on TPU; on GPU our Pallas kernel
    (``ops/gpu_grouped_matmul.py``: on an H200 the ``moe-1b`` shape decoded 150 against 72 tokens/s
    at one stream and 5,925 against 339 at 64 streams beside ``loop``, ``../shared/gpu/2026-11-28-h200/``);
    ``loop`` on CPU."""
    platform = jax.default_backend()
    if platform == "tpu":
        return "ragged_dot"
    return "pallas" if platform in ("gpu", "cuda", "rocm") else "loop"


def resolve_moe_backend(choice: str) -> GroupedImpl:
    """``engine.moe_backend`` on this platform: ``auto`` is ``grouped_impl()``; ``loop`` and
    ``ragged_dot`` run anywhere; ``pallas`` (the GPU grouped matmul kernel, ``auto``'s choice there)
    needs a GPU."""
    if choice == "auto":
        return grouped_impl()
    if choice == "pallas" and jax.default_backend() not in ("gpu", "cuda", "rocm"):
        raise ConfigError("engine.moe_backend 'pallas' needs a GPU; use 'auto', 'loop' or 'ragged_dot'")
    assert choice in ("loop", "ragged_dot", "pallas"), choice
    return choice  # type: ignore[return-value]


def block_rows(assignments: int, experts: int) -> int:
    """Rows per block of the loop for ``assignments`` routed rows over ``experts`` experts: the next
    power of two of the mean rows per expert, in [1, MAX_BLOCK_ROWS] (static: a function of shapes)."""
    mean = -(-assignments // max(experts, 1))
    return min(MAX_BLOCK_ROWS, 1 << max(mean - 1, 0).bit_length())


def expert_mlp(
    x: jax.Array,
    ids: jax.Array,
    weights: jax.Array,
    gate_up: jax.Array | StackedNarrow,
    down: jax.Array | StackedNarrow,
    act: Callable[[jax.Array], jax.Array],
    *,
    first_expert: int | jax.Array = 0,
    impl: GroupedImpl = "loop",
) -> jax.Array:
    """The routed experts' weighted sum for each token: ``sum_j weights[t, j] * MLP_{ids[t, j]}(x[t])``
    over the assignments whose expert is among ``gate_up``'s.

    ``x`` [T, H]; ``ids``, ``weights`` [T, k] from ``route``; ``gate_up`` [E, H, 2, I] (gate, up)
    and ``down`` [E, I, H]: experts ``first_expert .. first_expert + E - 1``, float or narrow
    (``StackedNarrow``: each expert dequantized when it runs); ``act`` the gate's activation.
    Returns float32 [T, H].
    """
    t, k = ids.shape
    e = _num_experts(gate_up)
    gate_up = gate_up if isinstance(gate_up, StackedNarrow) else jnp.asarray(gate_up)
    down = down if isinstance(down, StackedNarrow) else jnp.asarray(down)
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
    elif impl == "pallas":
        y, rows = _expert_kernel(x, token, sizes, gate_up, down, act), token
    else:
        y, rows = _expert_loop(x, token, sizes, gate_up, down, act), token
    y = y * row_weight[:, None]
    # Rows pointing at T (padding, other devices' assignments) land in a dropped extra row.
    return jnp.zeros((t + 1, x.shape[1]), jnp.float32).at[rows].add(y)[:t]


def _num_experts(w: jax.Array | StackedNarrow) -> int:
    return w.num if isinstance(w, StackedNarrow) else int(w.shape[0])


def _sorted_rows(x: jax.Array, token: jax.Array, spare: int) -> jax.Array:
    """The rows of ``x`` [T, H] in the sorted order ``token``, then ``spare`` zero rows, so that a
    tile starting near the end stays in bounds."""
    t, hdim = x.shape
    return jnp.concatenate([x, jnp.zeros((1, hdim), x.dtype)])[jnp.concatenate([token, jnp.full(spare, t, jnp.int32)])]


def num_tiles(assignments: int, experts: int, block: int) -> int:
    """Most tiles of ``block`` rows that ``assignments`` rows grouped over ``experts`` can need: each
    non-empty group rounds up once (static: a function of shapes)."""
    return (assignments + (block - 1) * min(experts, assignments)) // block


def _expert_loop(
    x: jax.Array,
    token: jax.Array,
    sizes: jax.Array,
    gate_up: jax.Array | StackedNarrow,
    down: jax.Array | StackedNarrow,
    act: Callable[[jax.Array], jax.Array],
) -> jax.Array:
    """Both matmuls tile by tile (a loop of static length): tile ``j`` is ``B`` rows of one expert's
    group with that expert's weights. Returns the sorted rows' outputs [n, H] float32 (rows past
    the local groups: zeros)."""
    hdim = x.shape[1]
    e = _num_experts(gate_up)
    n = token.shape[0]
    b = block_rows(n, e)
    xs = _sorted_rows(x, token, b)
    # Each tile's expert, first row and valid rows, for every tile at once before the loop. Found
    # inside it (a searchsorted per tile: a nested loop of log2(E) steps), they were ~70 % of the
    # loop's kernels, and a GPU launches this loop's kernels one by one: the moe-1b shape at 64
    # streams ran 5.5x slower than the previous loop (tests/test_step_budget.py).
    group, first, valid = gpu_grouped_matmul.tiles_of(sizes, num_tiles(n, e, b), b, n)

    def tile(j: int | jax.Array, y: jax.Array) -> jax.Array:
        i, at = group[j], first[j]  # a tile past the step's last one writes the spare rows
        gu = jnp.einsum(
            "bh,hgi->bgi", jax.lax.dynamic_slice_in_dim(xs, at, b), gate_up[i], preferred_element_type=jnp.float32
        )
        dn_w = down[i]
        out = jnp.dot((act(gu[:, 0]) * gu[:, 1]).astype(dn_w.dtype), dn_w, preferred_element_type=jnp.float32)
        # Rows past this expert's group belong to the next one: keep what is there.
        kept = jnp.where((jnp.arange(b) < valid[j])[:, None], out, jax.lax.dynamic_slice_in_dim(y, at, b))
        return jax.lax.dynamic_update_slice_in_dim(y, kept, at, 0)

    return jax.lax.fori_loop(0, num_tiles(n, e, b), tile, jnp.zeros((n + b, hdim), jnp.float32))[:n]


def _expert_kernel(
    x: jax.Array,
    token: jax.Array,
    sizes: jax.Array,
    gate_up: jax.Array | StackedNarrow,
    down: jax.Array | StackedNarrow,
    act: Callable[[jax.Array], jax.Array],
) -> jax.Array:
    """Both matmuls as the GPU grouped matmul kernel (``ops/gpu_grouped_matmul.py``) over the rows
    sorted by expert, tiles of at least 16 rows (a Triton dot's smallest): a decode step's tiles
    are its routed experts, each read once. Narrow experts stay narrow. Returns [n, H] float32
    (rows of other devices' experts: zeros)."""
    e = _num_experts(gate_up)
    n = token.shape[0]
    b = max(gpu_grouped_matmul.MIN_ROWS, block_rows(n, e))
    xs = _sorted_rows(x, token, b)
    tiles = gpu_grouped_matmul.tiles_of(sizes, num_tiles(n, e, b), b, n)
    call = functools.partial(gpu_grouped_matmul.grouped_matmul, block_rows=b)
    gu = call(xs, _merge_gate_up(gate_up), *tiles)  # [n + b, 2 I]: gates, then ups
    i = gu.shape[1] // 2
    dn = down if isinstance(down, StackedNarrow) else jnp.asarray(down)
    hidden = (act(gu[:, :i]) * gu[:, i:]).astype(dn.dtype)
    return call(hidden, dn, *tiles)[:n]


def _merge_gate_up(w: jax.Array | StackedNarrow) -> jax.Array | StackedNarrow:
    """``[E, H, 2, I]`` experts as ``[E, H, 2 I]`` (gate columns, then up): bitcasts, narrow or not."""
    if not isinstance(w, StackedNarrow):
        e, h, _, i = w.shape
        return w.reshape(e, h, 2 * i)
    codes, scale = w.codes.reshape(*w.codes.shape[:3], -1), w.scale.reshape(*w.scale.shape[:2], -1)
    offset = None if w.offset is None else w.offset.reshape(*w.offset.shape[:2], -1)
    return StackedNarrow(codes, scale, offset, w.bits, 1, w.dtype)


def _ragged(
    xs: jax.Array,
    gate_up: jax.Array | StackedNarrow,
    down: jax.Array | StackedNarrow,
    sizes: jax.Array,
    act: Callable[[jax.Array], jax.Array],
) -> jax.Array:
    """Both matmuls as ``lax.ragged_dot`` over rows sorted by expert (rows past the groups give 0).
    Narrow experts are dequantized whole first: the stack widens inside the step (``pallas``, on a
    GPU, reads them narrow instead)."""
    gate_up = gate_up.full() if isinstance(gate_up, StackedNarrow) else gate_up
    down = down.full() if isinstance(down, StackedNarrow) else down
    e, h, _, i = gate_up.shape
    gu = jax.lax.ragged_dot(xs, gate_up.reshape(e, h, 2 * i), sizes, preferred_element_type=jnp.float32)
    gu = gu.reshape(-1, 2, i)
    hidden = (act(gu[:, 0]) * gu[:, 1]).astype(down.dtype)
    return jax.lax.ragged_dot(hidden, down, sizes, preferred_element_type=jnp.float32)
