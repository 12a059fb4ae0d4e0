"""Multi-host serving: one leader process plans, every process runs the same device ops.

JAX is multi-controller: each process launches the jitted computations on its own devices, so
every process must call the same functions, in the same order, with the same arguments. myserve
keeps that simple by making a step plain data (``runtime/step_ops.py``): process 0 runs HTTP and
the scheduler and, before applying a replica's ops, sends them to the other processes over a host
socket (``runtime/step_channel.py``: not a device collective, which would queue behind the step in
flight and end the overlap of planning with device work); followers apply what they receive to
their identical executors, in order. A stop message ends the followers' loop.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence

import jax

from myserve.config import MESH_ENV, MeshConfig
from myserve.errors import ConfigError
from myserve.runtime.device import StepRead
from myserve.runtime.executor import Executor
from myserve.runtime.model_step import StepOutput
from myserve.runtime.step_channel import StepChannel, decode_step, encode_step
from myserve.runtime.step_layout import StepShape
from myserve.runtime.step_ops import Op, Progress

logger = logging.getLogger(__name__)

_channel: StepChannel | None = None
"""This process's end of the step channel, opened by ``initialize`` on a multi-process run."""


def initialize(mesh: MeshConfig) -> None:
    """``jax.distributed.initialize`` from the config; each value may also come from a ``MYSERVE_*`` env var.

    Nothing happens for one process (``mesh.num_processes: 1``, the default). ``num_processes: null``
    leaves the coordinator, count and id to JAX's detection (TPU pod slices, SLURM).
    """
    global _channel
    values = {key: mesh.from_env(key) for key in MESH_ENV}
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
    # The leader runs the coordinator, so the followers reach it at the coordinator's host: the
    # step channel binds that interface alone (or the one the config names).
    host = mesh.step_channel_host or (values["coordinator_address"] or "").rpartition(":")[0]
    try:
        address = socket.gethostbyname(host.strip("[]") or socket.gethostname())
        _channel = StepChannel.open(is_leader(), address, jax.process_count() - 1, mesh.heartbeat_timeout_s * 10)
    except (ConnectionError, OSError) as e:
        raise ConfigError(f"the step channel to the followers failed: {e}") from None
    logger.info(
        "process %d of %d: %d of %d devices are local",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


def shutdown() -> None:
    """End this process's part in a multi-process run (no-op for one process)."""
    if jax.process_count() > 1:
        jax.distributed.shutdown()


def is_leader() -> bool:
    """Whether this process runs HTTP and the scheduler (process 0)."""
    return jax.process_index() == 0


class BroadcastingDevice:
    """The leader's ``Device`` for one replica: broadcasts each op list, then applies it locally."""

    def __init__(self, executor: Executor, replica: int):
        self.executor = executor
        self.replica = replica

    def run(self, ops: Sequence[Op], progress: Progress | None = None) -> list[StepOutput]:
        """Send ``ops`` to the followers, then apply them here; the model calls' outputs."""
        _step_channel().send(encode_step(self.replica, ops))
        return self.executor.run(ops, progress)

    def read(self, output: StepOutput, *, tops: bool, scored: bool, pooled: bool = False) -> StepRead:
        """The step's results, read from this process's devices (every result is replicated)."""
        return self.executor.read(output, tops=tops, scored=scored, pooled=pooled)

    def background_builds_done(self, timeout: float | None = None) -> bool:
        """This process's background builds (followers build the same; one that lags waits for its own)."""
        return self.executor.background_builds_done(timeout)

    def stop_background_builds(self) -> None:
        """This process's background builds, stopped (``Executor.stop_background_builds``)."""
        self.executor.stop_background_builds()

    def memory_stats(self) -> list[dict[str, int]]:
        """This process's devices' allocator figures (``Executor.memory_stats``)."""
        return self.executor.memory_stats()

    def step_ready(self, shape: StepShape) -> bool:
        """Whether this process has built the forward of ``shape`` (a follower that has not yet
        waits for its own build when the step comes)."""
        return self.executor.step_ready(shape)

    def loop_ready(self, shape: StepShape, steps: int) -> bool:
        """Whether this process has built the several-token calls of ``shape`` (as ``step_ready``)."""
        return self.executor.loop_ready(shape, steps)

    def want_step(self, shape: StepShape) -> None:
        """This process's build of the forward of ``shape``, next (``Executor.want_step``)."""
        self.executor.want_step(shape)


def _step_channel() -> StepChannel:
    assert _channel is not None, "multihost.initialize opens the step channel of a multi-process run"
    return _channel


def stop_followers() -> None:
    """Leader: end every follower's loop (they return from ``follow``)."""
    _step_channel().send(None)


def follow(executors: Sequence[Executor]) -> int:
    """Follower: apply every op list the leader broadcasts until it says stop; returns the lists applied.

    A message that is not a step of ours raises ``StepChannelError`` (nothing of it is run)."""
    applied = 0
    while True:
        message = _step_channel().recv()
        if message is None:
            return applied
        replica, ops = decode_step(message, len(executors))
        executors[replica].run(ops)
        applied += 1
