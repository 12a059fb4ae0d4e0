"""The device mesh: (data, model) over the visible devices, one row per data-parallel replica.

What each array shards over is the model's table of logical-axis rules (``models/sharding.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from myserve.errors import ConfigError
from myserve.models.sharding import DATA, MODEL


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


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device of the mesh holds the whole array."""
    return NamedSharding(mesh, PartitionSpec())
