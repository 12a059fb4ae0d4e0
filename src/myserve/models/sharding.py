"""The one table of logical-axis sharding rules, and the shardings it gives each weight and cache array.

Every weight and cache array carries logical axis names; ``LOGICAL_AXIS_RULES`` says which mesh
axis each name shards over. A rule applies only when the dimension divides the mesh axis size;
otherwise that dimension is replicated (e.g. SmolLM2's 3 KV heads on ``model=2``). The mesh itself
is built by the runtime (``runtime/mesh.py``) with the axis names defined here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from myserve.models.axes import ModelAxes
from myserve.models.spec import ModelSpec

DATA, EXPERT, MODEL = "data", "expert", "model"
"""The mesh axes: data-parallel replicas; within one, expert parallelism (MoE experts) and tensor
parallelism."""

type MeshAxes = str | tuple[str, ...]
"""What one array dimension shards over: a mesh axis, or several (their product)."""

# logical axis name -> the mesh axes it shards over, in order of preference: the first whose size
# divides the dimension wins, else the dimension is replicated. Axes not listed (embed, qkv,
# q_per_kv, head_size, gate_up, routes, layers, position) are replicated. Query heads are grouped
# under their KV head (see models/llama.py), so sharding kv_heads shards the whole attention: q/k/v
# projections, o_proj and the KV cache. A MoE layer's experts shard over `expert` and each expert's
# width over `model` (models/moe.py); the rest of a MoE model (attention, KV cache, vocabulary)
# shards over `expert` and `model` together where its dimension divides their product, so the
# expert-parallel devices also split the attention and the cache instead of each repeating them.
LOGICAL_AXIS_RULES: Mapping[str, tuple[tuple[str, ...], ...]] = {
    "kv_heads": ((EXPERT, MODEL), (MODEL,)),
    "mlp": ((EXPERT, MODEL), (MODEL,)),
    "vocab": ((EXPERT, MODEL), (MODEL,)),
    "experts": ((EXPERT,),),
    "expert_mlp": ((MODEL,),),
    "shared_mlp": ((EXPERT, MODEL), (MODEL,)),
}


def axis_mapping(spec: ModelSpec, mesh: Mesh | AbstractMesh) -> dict[str, MeshAxes]:
    """The sharding rules for this model on this mesh: per logical axis, the first choice of mesh
    axes whose size divides its dimension (axes of size 1 left out); none: not in the mapping."""
    axes = ModelAxes.of(spec)
    sizes = {ax.name: ax.size for ax in (getattr(axes, f.name) for f in dataclasses.fields(axes))}
    mapping: dict[str, MeshAxes] = {}
    for logical, choices in LOGICAL_AXIS_RULES.items():
        dim = sizes.get(logical)
        for choice in choices:
            if dim is None or dim % math.prod(mesh.shape.get(a, 1) for a in choice) == 0:
                # Size-1 axes add nothing: `model` alone keeps the specs of meshes without `expert`.
                used = tuple(a for a in choice if mesh.shape.get(a, 1) > 1) or choice[-1:]
                mapping[logical] = used[0] if len(used) == 1 else used
                break
    return mapping


def named_sharding(axes: Sequence[str], mapping: Mapping[str, MeshAxes], mesh: Mesh) -> NamedSharding:
    """The NamedSharding of an array whose dimensions have these logical names."""
    return NamedSharding(mesh, PartitionSpec(*(mapping.get(a) for a in axes)))


def kv_cache_sharding(mapping: Mapping[str, MeshAxes], mesh: Mesh, backend: str = "reference") -> NamedSharding:
    """Sharding of each KV cache array (``ops/paged_cache.py``): KV heads over ``model``. The
    kernel's layout [layers, pages, page_size, 2 * kv_heads, head_dim] splits its combined heads
    axis in blocks, so each device keeps whole K/V pairs of its own heads."""
    if backend == "pallas":
        return named_sharding(("layers", "pages", "page_size", "kv_heads", "head_size"), mapping, mesh)
    return named_sharding(("layers", "kv_heads", "pages", "page_size", "head_size"), mapping, mesh)
