"""XLA:CPU's dots on a small host: single-threaded, so that they stop contending with the host.

On the two-core reference machine, XLA:CPU's multi-threaded Eigen dots were slower than its
single-threaded ones (``--xla_cpu_multi_thread_eigen=false``) for the shapes a server runs: a
[256, 576] x [576, 1536] matmul 1.7 ms against 3.0, a one-row [576] x [576, 49152] head 3.6 against
6.9 (docs/performance.md, "XLA:CPU's dots on two cores"). Served, the host-bound yardstick's one stream
decoded 1.13-1.25x faster and SmolLM2 ran the same or slightly faster: with two cores, a dot that
spreads over both takes the core the engine thread, the front end and XLA's other thunks need.

Set only where the process may use two CPUs or fewer (measured there; on more cores a large dot
needs its threads) and only before JAX starts its backends (the flag is read once, and the step
cache keys executables by ``XLA_FLAGS``). ``XLA_FLAGS`` that already name the flag decide alone.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

logger = logging.getLogger(__name__)

FLAG = "--xla_cpu_multi_thread_eigen=false"
"""Single-threaded Eigen dots on XLA:CPU (the flag has no effect on a GPU's or TPU's executables)."""

SMALL_HOST_CPUS = 2
"""Usable CPUs up to which a host counts as small."""


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity where the OS says it, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (macOS has no affinity call)
        return os.cpu_count() or 1


def single_threaded_dots_on_small_hosts(
    env: MutableMapping[str, str] | None = None, cpus: int | None = None, backends_started: bool | None = None
) -> bool:
    """Before JAX starts (a core process, the one process, a benchmark): add ``FLAG`` to
    ``XLA_FLAGS`` on a host of ``SMALL_HOST_CPUS`` usable CPUs or fewer. Returns whether it did.

    Left alone: a bigger host, ``XLA_FLAGS`` that already say ``xla_cpu_multi_thread_eigen`` either
    way (the user's choice), and a process whose JAX backends have started (too late to take effect,
    and the step cache would key executables by a flag they were not built with)."""
    env = os.environ if env is None else env
    cpus = usable_cpus() if cpus is None else cpus
    flags = env.get("XLA_FLAGS", "")
    if cpus > SMALL_HOST_CPUS or "xla_cpu_multi_thread_eigen" in flags:
        return False
    if backends_started is None:
        backends_started = _backends_started()
    if backends_started:
        return False
    env["XLA_FLAGS"] = f"{flags} {FLAG}".strip()
    logger.debug("%d usable CPUs: XLA:CPU's dots single-threaded (%s)", cpus, FLAG)
    return True


def _backends_started() -> bool:
    """Whether this process's JAX has started its backends (False where JAX cannot say)."""
    try:
        from jax._src import xla_bridge
    except ImportError:
        return False
    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started()) if started is not None else False
