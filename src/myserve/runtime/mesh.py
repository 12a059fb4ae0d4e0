"""The device mesh and the one table of logical-axis sharding rules.

Every weight and cache array carries logical axis names; ``LOGICAL_AXIS_RULES`` says which mesh
axis each name shards over. A rule applies only when the dimension divides the mesh axis size;
otherwise that dimension is replicated (e.g. SmolLM2's 3 KV heads on ``model=2``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import haliax as hax
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from myserve.errors import ConfigError
from myserve.models.llama import ModelAxes
from myserve.models.spec import ModelSpec

DATA, MODEL = "data", "model"

# logical axis name -> mesh axis. Axes not listed (embed, qkv, q_per_kv, head_size, gate_up, layers,
# position) are replicated. Query heads are grouped under their KV head (see models/llama.py), so
# sharding kv_heads shards the whole attention: q/k/v projections, o_proj and the KV cache.
LOGICAL_AXIS_RULES: Mapping[str, str] = {
    "kv_heads": MODEL,
    "mlp": MODEL,
    "vocab": MODEL,
}


def make_mesh(data: int = 1, model: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, model) mesh over the first ``data * model`` devices, or a clear error if too few.

    With several processes (multi-host) every row of the mesh — one data-parallel replica — takes
    the same number of devices from each process: the leader drives and reads every replica, so
    each must have devices on it (``model`` must then be a multiple of the process count).
    """
    devices = list(jax.devices() if devices is None else devices)
    need = data * model
    if need > len(devices):
        raise ConfigError(
            f"mesh data={data} x model={model} needs {need} devices, but {len(devices)} "
            f"{devices[0].platform} device(s) are visible"
        )
    processes = sorted({d.process_index for d in devices})
    if len(processes) > 1:
        if need != len(devices) or model % len(processes):
            raise ConfigError(
                f"mesh data={data} x model={model} on {len(processes)} processes: a multi-host mesh must use "
                f"every device ({len(devices)}) and mesh.model must be a multiple of the process count"
            )
        # [process, local device] -> [local device, process]: consecutive devices alternate processes.
        by_process = np.array(sorted(devices, key=lambda d: (d.process_index, d.id))).reshape(len(processes), -1)
        devices = list(by_process.T.reshape(-1))
    return Mesh(np.array(devices[:need]).reshape(data, model), (DATA, MODEL))


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One (1, model) mesh per row of ``mesh``: the devices of each data-parallel replica."""
    return [Mesh(mesh.devices[d : d + 1], (DATA, MODEL)) for d in range(mesh.shape[DATA])]


def axis_mapping(spec: ModelSpec, mesh: Mesh) -> dict[str, str]:
    """The sharding rules for this model on this mesh, dropping rules whose dimension does not divide."""
    axes = ModelAxes.of(spec)
    sizes = {ax.name: ax.size for ax in (getattr(axes, f.name) for f in dataclasses.fields(axes))}
    mapping = {}
    for logical, mesh_axis in LOGICAL_AXIS_RULES.items():
        dim = sizes.get(logical)
        if dim is None or dim % mesh.shape[mesh_axis] == 0:
            mapping[logical] = mesh_axis
    return mapping


def named_sharding(axes: Sequence[str], mapping: Mapping[str, str], mesh: Mesh) -> NamedSharding:
    """The NamedSharding of an array whose dimensions have these logical names."""
    return NamedSharding(mesh, PartitionSpec(*(mapping.get(a) for a in axes)))


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device of the mesh holds the whole array."""
    return NamedSharding(mesh, PartitionSpec())


def kv_cache_sharding(mapping: Mapping[str, str], mesh: Mesh, backend: str = "reference") -> NamedSharding:
    """Sharding of each KV cache array (``runtime/kv_cache.py``): KV heads over ``model``. The
    kernel's layout [layers, pages, page_size, 2 * kv_heads, head_dim] splits its combined heads
    axis in blocks, so each device keeps whole K/V pairs of its own heads."""
    if backend == "pallas":
        return named_sharding(("layers", "pages", "page_size", "kv_heads", "head_size"), mapping, mesh)
    return named_sharding(("layers", "kv_heads", "pages", "page_size", "head_size"), mapping, mesh)


def shard_named(x: hax.NamedArray, mapping: Mapping[str, str], mesh: Mesh) -> hax.NamedArray:
    """Place one NamedArray on the mesh by the rules."""
    sharding = named_sharding([a.name for a in x.axes], mapping, mesh)
    return hax.named(jax.device_put(x.array, sharding), x.axes)
