"""Test-only launcher: ``python -m myserve.serve`` with a fault injected, for the supervision tests.

``MYSERVE_TEST_FAULT=dispatch:N`` makes the first engine step that holds N sequences raise (so
that many requests are in flight, however fast the steps are);
``MYSERVE_TEST_FAULT=warmup`` makes warmup raise. The product has no such switch: the fault is
patched in here, before the real entry point runs with this process's arguments, and in the engine
core's process through its test-only hook (``MYSERVE_CORE_HOOK``), which calls ``inject_from_env``
there before the core loads.
"""

from __future__ import annotations

import os
import sys

from myserve.core.runner import ModelRunner, PlannedStep
from myserve.entrypoints import serve


def inject(fault: str) -> None:
    """Patch the runner so that ``fault`` happens."""
    if fault == "warmup":

        def failing_warmup(self: ModelRunner, progress: object = None) -> None:
            raise RuntimeError("injected warmup failure")

        ModelRunner.warmup = failing_warmup  # type: ignore[method-assign]
        return
    kind, _, after = fault.partition(":")
    assert kind == "dispatch", fault
    real = ModelRunner.dispatch

    def failing_dispatch(self: ModelRunner, planned: PlannedStep) -> PlannedStep:
        if len({chunk.seq for chunk, _, _ in planned.chunks}) >= int(after):
            raise RuntimeError("injected device failure")
        return real(self, planned)

    ModelRunner.dispatch = failing_dispatch  # type: ignore[method-assign,assignment]


def inject_from_env() -> None:
    """The core process's hook: the fault named by ``MYSERVE_TEST_FAULT``."""
    inject(os.environ["MYSERVE_TEST_FAULT"])


if __name__ == "__main__":
    from myserve.core.process import CORE_HOOK_ENV

    inject_from_env()  # for a server that runs the engine in this process
    os.environ[CORE_HOOK_ENV] = "serve_with_fault:inject_from_env"
    sys.exit(serve.main(sys.argv[1:]))
