"""The device mesh: (data, expert, model) over the visible devices, one row per data-parallel replica.

What each array shards over is the model's table of logical-axis rules (``models/sharding.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from myserve.config import too_few_devices
from myserve.errors import ConfigError
from myserve.models.sharding import DATA, EXPERT, MODEL


def make_mesh(data: int = 1, model: int = 1, devices: Sequence[jax.Device] | None = None, expert: int = 1) -> Mesh:
    """A (data, expert, model) mesh over the first ``data * expert * model`` devices, or a clear
    error if too few. ``model`` is the innermost axis, so tensor-parallel peers are neighbours.

    With several processes (multi-host) every row of the mesh — one data-parallel replica — takes
    the same number of devices from each process: the leader drives and reads every replica, so
    each must have devices on it (``expert * model`` must then be a multiple of the process count).
    """
    devices = list(jax.devices() if devices is None else devices)
    need = data * expert * model
    shape = f"data={data} x expert={expert} x model={model}" if expert > 1 else f"data={data} x model={model}"
    if need > len(devices):
        raise ConfigError(too_few_devices(data, expert, model, len(devices), devices[0].platform))
    processes = sorted({d.process_index for d in devices})
    if len(processes) > 1:
        if need != len(devices) or (expert * model) % len(processes):
            raise ConfigError(
                f"mesh {shape} on {len(processes)} processes: a multi-host mesh must use every device "
                f"({len(devices)}) and mesh.expert x mesh.model must be a multiple of the process count"
            )
        # [process, local device] -> [local device, process]: consecutive devices alternate processes.
        by_process = np.array(sorted(devices, key=lambda d: (d.process_index, d.id))).reshape(len(processes), -1)
        devices = list(by_process.T.reshape(-1))
    return Mesh(np.array(devices[:need]).reshape(data, expert, model), (DATA, EXPERT, MODEL))


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One (1, expert, model) mesh per row of ``mesh``: the devices of each data-parallel replica."""
    return [Mesh(mesh.devices[d : d + 1], (DATA, EXPERT, MODEL)) for d in range(mesh.shape[DATA])]


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device of the mesh holds the whole array."""
    return NamedSharding(mesh, PartitionSpec())
