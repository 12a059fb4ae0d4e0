"""Where the engine thread's time goes, step by step: planning, dispatch, reading results, post-processing.

The device idles from the moment one step's results are ready until the next step is dispatched; on
an accelerator, and on CPU with a tiny model, that gap is what limits throughput. The host cannot
see when the device finished, so the *host-measured gap* runs from the end of reading step N's
results to the dispatch of step N+1. One step at a time, it is post-processing N and planning N+1;
with overlapped steps (``engine.async_scheduling``) step N+1 is dispatched before N is read, and
the gap is negative: the device had its next step queued before the host saw the last one end.

``timeline`` keeps the recent loop events with their times (``plan`` start, ``dispatched``,
``wait`` start, ``read``), a trace of the overlap: ``python -m myserve.bench.timeline`` prints it.
"""

from __future__ import annotations

import collections
import time

PHASES = ("schedule", "plan", "dispatch", "read", "postprocess", "deliver")
"""schedule: choosing the step's sequences and tokens (``Scheduler.schedule``); plan: building the
step's ops and host arrays (``ModelRunner.plan``); dispatch: handing them to the device (not
awaited); read: waiting for and fetching the results; postprocess: appending tokens, stop checks,
making the outputs, freeing finished sequences; deliver: handing the outputs to the sink (the
output thread's queue in process, the socket to the front end from the core process)."""


class StepTimer:
    """Cumulative host seconds per phase of the engine loop, and the recent gaps between steps."""

    def __init__(self, window: int = 100, timeline: int = 512):
        self.seconds = dict.fromkeys(PHASES, 0.0)
        """Host seconds spent in each phase so far."""
        self._gaps: collections.deque[float] = collections.deque(maxlen=window)
        self._dispatched: dict[int, float] = {}  # iteration -> when its steps were dispatched
        self._read_end: tuple[int, float] | None = None  # the last read iteration and when it ended
        self.timeline: collections.deque[tuple[int, str, float]] = collections.deque(maxlen=timeline)
        """Recent (iteration, event, perf_counter time) of the loop: plan (scheduling starts),
        dispatched, wait (the host starts waiting for the iteration's results), read (it has them)."""

    @staticmethod
    def now() -> float:
        """A timestamp for ``lap``."""
        return time.perf_counter()

    def lap(self, phase: str, since: float) -> float:
        """Add the time since ``since`` to ``phase``; returns now, the start of the next phase."""
        now = time.perf_counter()
        self.seconds[phase] += now - since
        return now

    def dispatching(self, iteration: int, at: float) -> None:
        """Iteration ``iteration``'s first step is dispatched at ``at`` (planned from ``plan_started``)."""
        if iteration in self._dispatched:
            return
        self._dispatched[iteration] = at
        self.timeline.append((iteration, "dispatched", at))
        if self._read_end is not None and self._read_end[0] == iteration - 1:
            self._gaps.append(at - self._read_end[1])  # dispatched after the previous step was read
            self._read_end = None

    def plan_started(self, iteration: int, at: float) -> None:
        """Iteration ``iteration`` starts scheduling and planning at ``at``."""
        self.timeline.append((iteration, "plan", at))

    def read_done(self, iteration: int, at: float) -> None:
        """Iteration ``iteration``'s results were read by ``at``."""
        self.timeline.append((iteration, "read", at))
        following = self._dispatched.pop(iteration + 1, None)
        self._dispatched.pop(iteration, None)
        if following is not None:
            self._gaps.append(following - at)  # the next step was queued before this one was read
        else:
            self._read_end = (iteration, at)

    def idle(self) -> None:
        """The engine had nothing to do: the next dispatch does not follow a step (no gap to count)."""
        self._read_end = None
        self._dispatched.clear()

    @property
    def mean_gap(self) -> float:
        """Mean host-measured gap between consecutive steps, over the recent window (seconds)."""
        return sum(self._gaps) / len(self._gaps) if self._gaps else 0.0
