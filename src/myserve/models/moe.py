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
from myserve.models.sharding import axis_mapping
from myserve.models.spec import ModelSpec
from myserve.ops.moe import expert_mlp, grouped_impl, route


class MoeBlock(eqx.Module):
    """One layer's experts: the router, the routed experts' weights, and the optional shared expert."""

    router: NamedArray  # (embed, routes)
    gate_up: NamedArray  # (experts, embed, gate_up, expert_mlp)
    down: NamedArray  # (experts, expert_mlp, embed)
    shared_gate_up: NamedArray | None = None  # (embed, gate_up, shared_mlp)
    shared_down: NamedArray | None = None  # (shared_mlp, embed)
    shared_gate: NamedArray | None = None  # (embed,)


def moe_mlp(spec: ModelSpec, block: MoeBlock, h: NamedArray, mesh: Mesh | AbstractMesh | None) -> NamedArray:
    """The MoE MLP of normed hidden states ``h`` (batch, position, embed), in h's dtype. ``mesh``:
    the replica's mesh the weights live on (None: unsharded, e.g. outside a step)."""
    hr = h.rearrange((BATCH, POS, "embed"))
    b, t, dim = hr.array.shape
    x = hr.array.reshape(b * t, dim)
    # transformers projects to router logits in the model dtype, then softmaxes in float32.
    logits = jnp.dot(x, block.router.rearrange(("embed", "routes")).array)
    weights, ids = route(logits, spec.experts_per_token, spec.norm_topk_prob)
    gate_up = block.gate_up.rearrange(("experts", "embed", "gate_up", "expert_mlp")).array
    down = block.down.rearrange(("experts", "expert_mlp", "embed")).array
    y = _routed_experts(spec, x, ids, weights, gate_up, down, mesh).astype(x.dtype)
    if block.shared_gate_up is not None and block.shared_down is not None and block.shared_gate is not None:
        gu = jnp.einsum("th,hgi->tgi", x, block.shared_gate_up.rearrange(("embed", "gate_up", "shared_mlp")).array)
        shared = jnp.dot(jax.nn.silu(gu[:, 0]) * gu[:, 1], block.shared_down.rearrange(("shared_mlp", "embed")).array)
        y = y + jax.nn.sigmoid(jnp.dot(x, block.shared_gate.array))[:, None] * shared
    return hax.named(y.reshape(b, t, dim), hr.axes)


def _routed_experts(
    spec: ModelSpec,
    x: jax.Array,
    ids: jax.Array,
    weights: jax.Array,
    gate_up: jax.Array,
    down: jax.Array,
    mesh: Mesh | AbstractMesh | None,
) -> jax.Array:
    """The routed experts' float32 output [T, embed], per device under ``shard_map`` when the
    experts (``expert`` axis) or their hidden width (``model`` axis) are sharded."""
    impl = grouped_impl()
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

    def per_device(x: jax.Array, ids: jax.Array, weights: jax.Array, gate_up: jax.Array, down: jax.Array) -> jax.Array:
        first = jax.lax.axis_index(experts_axis) * local_experts if experts_axis else 0
        part = expert_mlp(x, ids, weights, gate_up, down, jax.nn.silu, first_expert=first, impl=impl)
        return jax.lax.psum(part, summed)

    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(P(), P(), P(), P(experts_axis, None, None, width_axis), P(experts_axis, width_axis, None)),
        out_specs=P(),
        check_vma=False,
    )(x, ids, weights, gate_up, down)
