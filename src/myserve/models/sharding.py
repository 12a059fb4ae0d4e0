"""The one table of logical-axis sharding rules, and the shardings it gives each weight and cache array.

Every weight and cache array carries logical axis names; ``LOGICAL_AXIS_RULES`` says which mesh
axis each name shards over. A rule applies only when the dimension divides the mesh axis size;
otherwise that dimension is replicated (e.g. SmolLM2's 3 KV heads on ``model=2``). The mesh itself
is built by the runtime (``runtime/mesh.py``) with the axis names defined here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from myserve.models.axes import ModelAxes
from myserve.models.spec import ModelSpec

DATA, EXPERT, MODEL = "data", "expert", "model"
"""The mesh axes: data-parallel replicas; within one, expert parallelism (MoE experts) and tensor
parallelism."""

# logical axis name -> mesh axis. Axes not listed (embed, qkv, q_per_kv, head_size, gate_up, layers,
# position) are replicated. Query heads are grouped under their KV head (see models/llama.py), so
# sharding kv_heads shards the whole attention: q/k/v projections, o_proj and the KV cache. A MoE
# layer's experts shard over `expert` and each expert's width over `model` (models/moe.py);
# everything else is replicated over `expert`.
LOGICAL_AXIS_RULES: Mapping[str, str] = {
    "kv_heads": MODEL,
    "mlp": MODEL,
    "vocab": MODEL,
    "experts": EXPERT,
    "expert_mlp": MODEL,
    "shared_mlp": MODEL,
}


def axis_mapping(spec: ModelSpec, mesh: Mesh) -> dict[str, str]:
    """The sharding rules for this model on this mesh, dropping rules whose dimension does not divide."""
    axes = ModelAxes.of(spec)
    sizes = {ax.name: ax.size for ax in (getattr(axes, f.name) for f in dataclasses.fields(axes))}
    mapping = {}
    for logical, mesh_axis in LOGICAL_AXIS_RULES.items():
        dim = sizes.get(logical)
        if dim is None or dim % mesh.shape.get(mesh_axis, 1) == 0:
            mapping[logical] = mesh_axis
    return mapping


def named_sharding(axes: Sequence[str], mapping: Mapping[str, str], mesh: Mesh) -> NamedSharding:
    """The NamedSharding of an array whose dimensions have these logical names."""
    return NamedSharding(mesh, PartitionSpec(*(mapping.get(a) for a in axes)))


def kv_cache_sharding(mapping: Mapping[str, str], mesh: Mesh, backend: str = "reference") -> NamedSharding:
    """Sharding of each KV cache array (``ops/paged_cache.py``): KV heads over ``model``. The
    kernel's layout [layers, pages, page_size, 2 * kv_heads, head_dim] splits its combined heads
    axis in blocks, so each device keeps whole K/V pairs of its own heads."""
    if backend == "pallas":
        return named_sharding(("layers", "pages", "page_size", "kv_heads", "head_size"), mapping, mesh)
    return named_sharding(("layers", "kv_heads", "pages", "page_size", "head_size"), mapping, mesh)
