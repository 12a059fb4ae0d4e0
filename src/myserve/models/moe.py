"""The Mixture-of-Experts MLP of Mixtral, Qwen2-MoE and Qwen3-MoE, and how it runs on the mesh.

A MoE layer's MLP is a router (one ``[embed, experts]`` projection, softmax top-k) and ``E``
SwiGLU experts, plus for Qwen2-MoE a shared expert every token uses, scaled by a sigmoid gate.
The routed experts run as one grouped matmul over the step's assignments sorted by expert
(``ops/moe.py``), inside the one ragged step.

Expert parallelism: ``experts`` shards over the mesh's ``expert`` axis and each expert's hidden
width (``expert_mlp``) over ``model`` (``models/sharding.py``). The step's tokens are the same on
every device of a replica (the activations are replicated, as after any tensor-parallel layer),
so no dispatch collective is needed: under ``shard_map`` each device runs its own experts on the
assignments routed to them, and one all-reduce (``psum`` over ``expert`` and ``model``) of the
``[T, embed]`` partial sums combines them — the same all-reduce a tensor-parallel MLP ends with.
An all-to-all dispatch moves only the routed rows instead, and wins when the tokens themselves are
split across the expert axis (data- or sequence-parallel attention); ``python -m
myserve.bench.moe_collectives`` measures the three on the fake-device mesh (docs/performance.md).
Nothing has a capacity: every assignment is computed, whatever the routing (exact serving).
"""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P

from myserve.models.axes import BATCH, POS
from myserve.models.narrow import NarrowWeight
from myserve.models.sharding import axis_mapping
from myserve.models.spec import ModelSpec
from myserve.ops.dequant import StackedNarrow
from myserve.ops.moe import GroupedImpl, expert_mlp, route

Experts = jax.Array | StackedNarrow
"""A layer's stacked expert weights as the grouped matmul takes them: float, or narrow."""


class MoeBlock(eqx.Module):
    """One layer's experts: the router, the routed experts' weights, and the optional shared expert."""

    router: NamedArray  # (embed, routes)
    gate_up: NamedArray | NarrowWeight  # (experts, embed, gate_up, expert_mlp)
    down: NamedArray | NarrowWeight  # (experts, expert_mlp, embed)
    shared_gate_up: NamedArray | NarrowWeight | None = None  # (embed, gate_up, shared_mlp)
    shared_down: NamedArray | NarrowWeight | None = None  # (shared_mlp, embed)
    shared_gate: NamedArray | None = None  # (embed,)
    impl: GroupedImpl = eqx.field(static=True, default="loop")
    """The grouped matmul (``ops/moe.py``): ``engine.moe_backend`` resolved (``resolve_moe_backend``)."""


def moe_mlp(spec: ModelSpec, block: MoeBlock, h: NamedArray, mesh: Mesh | AbstractMesh | None) -> NamedArray:
    """The MoE MLP of normed hidden states ``h`` (batch, position, embed), in h's dtype. ``mesh``:
    the replica's mesh the weights live on (None: unsharded, e.g. outside a step)."""
    hr = h.rearrange((BATCH, POS, "embed"))
    b, t, dim = hr.array.shape
    x = hr.array.reshape(b * t, dim)
    # transformers projects to router logits in the model dtype, then softmaxes in float32.
    logits = jnp.dot(x, block.router.rearrange(("embed", "routes")).array)
    weights, ids = route(logits, spec.experts_per_token, spec.norm_topk_prob)
    gate_up = _experts(block.gate_up, ("experts", "embed", "gate_up", "expert_mlp"), x.dtype)
    down = _experts(block.down, ("experts", "expert_mlp", "embed"), x.dtype)
    y = _routed_experts(spec, x, ids, weights, gate_up, down, mesh, block.impl).astype(x.dtype)
    if block.shared_gate_up is not None and block.shared_down is not None and block.shared_gate is not None:
        gu = jnp.einsum("th,hgi->tgi", x, _dense(block.shared_gate_up, ("embed", "gate_up", "shared_mlp")))
        shared = jnp.dot(jax.nn.silu(gu[:, 0]) * gu[:, 1], _dense(block.shared_down, ("shared_mlp", "embed")))
        y = y + jax.nn.sigmoid(jnp.dot(x, block.shared_gate.array))[:, None] * shared
    return hax.named(y.reshape(b, t, dim), hr.axes)


def _experts(w: NamedArray | NarrowWeight, axes: tuple[str, ...], dtype: jnp.dtype) -> Experts:
    """A stack of experts' weights as raw arrays in the order ``axes``; narrow ones stay narrow
    (their codes are laid out experts, groups, group, then the output axes, as loaded)."""
    if isinstance(w, NarrowWeight):
        offset = None if w.offset is None else w.offset.array
        return StackedNarrow(w.codes.array, w.scale.array, offset, w.bits, len(w.out_axes), dtype)
    return w.rearrange(axes).array


def _dense(w: NamedArray | NarrowWeight, axes: tuple[str, ...]) -> jax.Array:
    """A shared expert's weight as a raw array in the order ``axes`` (narrow: dequantized)."""
    return (w.dequantize() if isinstance(w, NarrowWeight) else w).rearrange(axes).array


def _specs(w: Experts, spec: P, groups: str | None) -> Experts | P:
    """``shard_map``'s in_spec of a stack of experts whose float form shards as ``spec``
    (experts, contracted, *out): narrow codes and scales shard their groups like the contracted axis."""
    if not isinstance(w, StackedNarrow):
        return spec
    scale = P(spec[0], groups, *spec[2:])
    codes = P(spec[0], groups, None, *spec[2:])
    return StackedNarrow(codes, scale, None if w.offset is None else scale, w.bits, w.n_out, w.dtype)  # type: ignore[arg-type]


def _routed_experts(
    spec: ModelSpec,
    x: jax.Array,
    ids: jax.Array,
    weights: jax.Array,
    gate_up: Experts,
    down: Experts,
    mesh: Mesh | AbstractMesh | None,
    impl: GroupedImpl,
) -> jax.Array:
    """The routed experts' float32 output [T, embed], per device under ``shard_map`` when the
    experts (``expert`` axis) or their hidden width (``model`` axis) are sharded."""
    mapping = {} if mesh is None else axis_mapping(spec, mesh)
    # Each rule names one mesh axis (models/sharding.py); an axis of size 1 splits nothing.
    experts_axis, width_axis = (
        a if isinstance(a, str) and mesh is not None and mesh.shape.get(a, 1) > 1 else None
        for a in (mapping.get("experts"), mapping.get("expert_mlp"))
    )
    if mesh is None or (experts_axis is None and width_axis is None):
        return expert_mlp(x, ids, weights, gate_up, down, jax.nn.silu, impl=impl)
    local_experts = spec.num_experts // (mesh.shape[experts_axis] if experts_axis else 1)
    summed = tuple(a for a in (experts_axis, width_axis) if a is not None)

    def per_device(x: jax.Array, ids: jax.Array, weights: jax.Array, gate_up: Experts, down: Experts) -> jax.Array:
        first = jax.lax.axis_index(experts_axis) * local_experts if experts_axis else 0
        part = expert_mlp(x, ids, weights, gate_up, down, jax.nn.silu, first_expert=first, impl=impl)
        return jax.lax.psum(part, summed)

    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(
            P(),
            P(),
            P(),
            _specs(gate_up, P(experts_axis, None, None, width_axis), None),
            _specs(down, P(experts_axis, width_axis, None), width_axis),
        ),
        out_specs=P(),
        check_vma=False,
    )(x, ids, weights, gate_up, down)
