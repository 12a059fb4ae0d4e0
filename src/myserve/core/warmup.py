"""Warmup: every replica's runner builds its step executables before the engine serves.

Executables are compiled, or loaded from the step cache or JAX's persistent compilation cache;
the log says how many of each and how long it took, counted from when the deployment started
building steps early (``Deployment.load(prebuild=True)``) when it did.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from myserve.runtime.device import Device
from myserve.runtime.kv_sizing import peak_report
from myserve.runtime.step_ops import CompileSteps

_BAR_LOCK = threading.RLock()
"""The lock of every warm-up progress bar of this process."""

logger = logging.getLogger(__name__)


class Builder(Protocol):
    """What warmup builds through: a replica's runner, or its draft model's proposer."""

    device: Device
    warmed_up: bool

    def compile_ops(self) -> tuple[CompileSteps, CompileSteps]:
        """Its builds before serving, and those in the background."""
        ...

    def warmup(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Make its builds, telling ``progress(done, total)`` of each."""
        ...


def warm_up(
    runners: Sequence[Builder],
    compile_counts: Callable[[], tuple[int, int]],
    *,
    since: tuple[float, int, int] | None = None,
    progress: Callable[[int, int], None] | None = None,
    memory_utilization: float = 0.9,
) -> None:
    """Build every runner's step shapes. ``progress(done, total)`` is told of each shape built; by
    default a tqdm bar shows it. ``since``: (perf_counter, compiled, loaded) when the builds began.
    Then the devices' peak memory is logged against ``memory_utilization`` (where they report it)."""
    t0 = time.perf_counter()
    counts = [runner.compile_ops()[0].count for runner in runners]
    total = sum(counts)
    bar = None
    if progress is None:
        from tqdm import tqdm

        # tqdm's default lock is a multiprocessing semaphore, which a core process leaves
        # behind (it ends with os._exit) and the resource tracker warns about at exit. One lock
        # for the process: engines warming up in threads at once (replicas) each setting a new
        # one would release a lock another bar acquired ("cannot release un-acquired lock").
        tqdm.set_lock(_BAR_LOCK)
        bar = tqdm(total=total, desc="warmup (compiling step shapes)", unit="shape")
    # Counted from when the deployment started building steps early, if it did.
    t0, *before = since or (t0, *compile_counts())
    compiled, loaded = before
    for k, runner in enumerate(runners):

        def report(done: int, _: int, before: int = sum(counts[:k])) -> None:
            if bar is not None:
                bar.update(before + done - bar.n)
            elif progress is not None:
                progress(before + done, total)

        runner.warmup(report)
    if bar is not None:
        bar.close()
    compiled, loaded = (now - before for now, before in zip(compile_counts(), (compiled, loaded), strict=True))
    logger.info(
        "warmup: %d executables (%d compiled, %d loaded from the compilation cache) in %.1fs",
        compiled + loaded,
        compiled,
        loaded,
        time.perf_counter() - t0,
    )
    memory = peak_report([s for runner in runners for s in runner.device.memory_stats()], memory_utilization)
    if memory is not None:
        line, over = memory
        (logger.warning if over else logger.info)(line)
