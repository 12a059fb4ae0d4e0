"""Where the engine thread's time goes, step by step: planning, dispatch, reading results, post-processing.

The device idles from the moment one step's results are ready until the next step is dispatched; on
an accelerator, and on CPU with a tiny model, that gap is what limits throughput. The host cannot
see when the device finished, so the *host-measured gap* runs from the end of reading step N's
results to the start of step N+1's dispatch (post-processing N, planning N+1): an upper bound on
what an overlapped (pipelined) loop could hide.
"""

from __future__ import annotations

import collections
import time

PHASES = ("plan", "dispatch", "read", "postprocess")
"""plan: scheduling and building the step's ops; dispatch: handing them to the device (not awaited);
read: waiting for and fetching the results; postprocess: appending tokens, detokenizing, stop
checks, delivering outputs, freeing finished sequences."""


class StepTimer:
    """Cumulative host seconds per phase of the engine loop, and the recent gaps between steps."""

    def __init__(self, window: int = 100):
        self.seconds = dict.fromkeys(PHASES, 0.0)
        """Host seconds spent in each phase so far."""
        self._gaps: collections.deque[float] = collections.deque(maxlen=window)
        self._read_end: float | None = None

    @staticmethod
    def now() -> float:
        """A timestamp for ``lap``."""
        return time.perf_counter()

    def lap(self, phase: str, since: float) -> float:
        """Add the time since ``since`` to ``phase``; returns now, the start of the next phase."""
        now = time.perf_counter()
        self.seconds[phase] += now - since
        if phase == "read":
            self._read_end = now
        return now

    def dispatching(self, at: float) -> None:
        """A step is about to be dispatched at ``at``: records the gap since the last results were read."""
        if self._read_end is not None:
            self._gaps.append(at - self._read_end)
            self._read_end = None

    def idle(self) -> None:
        """The engine had nothing to do: the next dispatch does not follow a step (no gap to count)."""
        self._read_end = None

    @property
    def mean_gap(self) -> float:
        """Mean host-measured gap between consecutive steps, over the recent window (seconds)."""
        return sum(self._gaps) / len(self._gaps) if self._gaps else 0.0
