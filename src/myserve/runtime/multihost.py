"""Multi-host serving: one leader process plans, every process runs the same device ops.

JAX is multi-controller: each process launches the jitted computations on its own devices, so
every process must call the same functions, in the same order, with the same arguments. myserve
keeps that simple by making a step plain data (``runtime/executor.py``): process 0 runs HTTP and
the scheduler and, before applying a replica's ops, broadcasts them to the other processes with a
JAX collective (``broadcast_one_to_all``, as MaxText does); followers apply what they receive to
their identical executors. A ``None`` message ends the followers' loop.

The step protocol, per ``Device.run`` on the leader:

1. header: int32 [2] = (payload bytes, replica index), broadcast from process 0;
2. payload: the pickled op list, padded to a power of two (>= 4 KiB) so broadcasts compile a
   handful of shapes, broadcast from process 0;
3. every process applies the ops to its executor of that replica.
"""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from myserve.config import MeshConfig
from myserve.errors import ConfigError
from myserve.runtime.executor import Executor, Op
from myserve.runtime.model_step import StepOutput

logger = logging.getLogger(__name__)

_MIN_PAYLOAD = 4096
_STOP = -1  # replica index of the message that ends the followers' loop

_ENV = {
    "coordinator_address": "MYSERVE_COORDINATOR_ADDRESS",
    "num_processes": "MYSERVE_NUM_PROCESSES",
    "process_id": "MYSERVE_PROCESS_ID",
}


def initialize(mesh: MeshConfig) -> None:
    """``jax.distributed.initialize`` from the config; each value may also come from a ``MYSERVE_*`` env var.

    Nothing happens for one process (``mesh.num_processes: 1``, the default). ``num_processes: null``
    leaves the coordinator, count and id to JAX's detection (TPU pod slices, SLURM).
    """
    values = {key: os.environ.get(env, getattr(mesh, key)) for key, env in _ENV.items()}
    num = values["num_processes"]
    if num is not None and int(num) == 1:
        return
    # Collectives between CPU processes (the multi-host tests, CPU clusters); TPU/GPU ignore it.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    pid = values["process_id"]
    try:
        jax.distributed.initialize(
            coordinator_address=values["coordinator_address"],
            num_processes=int(num) if num is not None else None,
            process_id=int(pid) if pid is not None else None,
            heartbeat_timeout_seconds=mesh.heartbeat_timeout_s,
        )
    except (RuntimeError, ValueError) as e:
        raise ConfigError(f"jax.distributed.initialize failed: {' '.join(str(e).split())}") from None
    logger.info(
        "process %d of %d: %d of %d devices are local",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


def is_leader() -> bool:
    """Whether this process runs HTTP and the scheduler (process 0)."""
    return jax.process_index() == 0


def _broadcast(message: bytes | None) -> bytes | None:
    """Process 0's message to every process (``message`` is ignored elsewhere)."""
    leader = is_leader()
    size = len(message) if leader and message is not None else 0
    header = np.array([size, 0 if leader and message is not None else _STOP], np.int32)
    header = np.asarray(multihost_utils.broadcast_one_to_all(header, is_source=leader))
    if header[1] == _STOP:
        return None
    size = int(header[0])
    padded = max(_MIN_PAYLOAD, 1 << (size - 1).bit_length())
    buf = np.zeros(padded, np.uint8)
    if leader and message is not None:
        buf[:size] = np.frombuffer(message, np.uint8)
    buf = np.asarray(multihost_utils.broadcast_one_to_all(buf, is_source=leader))
    return buf[:size].tobytes()


class BroadcastingDevice:
    """The leader's ``Device`` for one replica: broadcasts each op list, then applies it locally."""

    def __init__(self, executor: Executor, replica: int):
        self.executor = executor
        self.replica = replica

    def run(self, ops: Sequence[Op]) -> list[StepOutput]:
        """Send ``ops`` to the followers, then apply them here; the model calls' outputs."""
        _broadcast(pickle.dumps((self.replica, list(ops)), protocol=pickle.HIGHEST_PROTOCOL))
        return self.executor.run(ops)


def stop_followers() -> None:
    """Leader: end every follower's loop (they return from ``follow``)."""
    _broadcast(None)


def follow(executors: Sequence[Executor]) -> int:
    """Follower: apply every op list the leader broadcasts until it says stop; returns the lists applied."""
    applied = 0
    while True:
        message = _broadcast(None)
        if message is None:
            return applied
        replica, ops = pickle.loads(message)  # from our own leader process
        executors[replica].run(ops)
        applied += 1
