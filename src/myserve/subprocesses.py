"""What every child process of ``serve`` (the engine core, the extra front ends) shares: it dies
with its parent. Top level because both processes use it and neither may import the other."""

from __future__ import annotations

import signal
import sys


def die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies (no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
