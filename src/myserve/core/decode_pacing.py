"""How long a several-token decode call may run: the wait it puts on requests that arrive meanwhile.

A decode call of K tokens (``engine.decode_steps``) saves K - 1 host round trips, but a request that
arrives while it runs waits for the whole call (two with ``async_scheduling``: the next is queued
before this one is read) before its prompt is prefilled. Where one token of the batch is cheap (a
small model, a few rows, an accelerator) the call is short and the saving is the point; where one
token of the batch is expensive (SmolLM2 at 64 rows on a 2-core CPU: ~250 ms) a K = 8 call lasts
seconds, and every new request's time to first token grows by that much while the saving is a few
per cent of the step (measured in docs/performance.md, "Several tokens per call and TTFT").

So the engine times its decode-only calls per batch size and makes a decode several tokens long only
where K iterations at that size are expected to take at most ``engine.decode_call_budget_ms``. The
first call of a batch size is allowed (nothing is known yet); a one-token decode-only step measures
the size as well as a K-token call does, so a size that was too slow is measured again as it runs.
"""

from __future__ import annotations

import time
from collections.abc import Sized
from typing import Protocol


class TimedStep(Protocol):
    """What the pacer reads of a dispatched step (``runner.PlannedStep``)."""

    decode_iterations: int
    """Model iterations of a decode-only call (K, or 1); 0 for any step with a prompt chunk."""
    dispatched_at: float
    """``time.perf_counter()`` when it was handed to the device."""

    @property
    def chunks(self) -> Sized:
        """One per sequence in the step."""
        ...


class DecodePacer:
    """Seconds per model iteration of decode-only calls, by batch size (powers of two), smoothed."""

    SMOOTHING = 0.3
    """Weight of the newest call in the running estimate: one slow call (a compile elsewhere on the
    machine) does not switch the engine to one token per call, a few do."""

    def __init__(self, budget_s: float):
        """``budget_s``: the longest a several-token call may be expected to run; 0 = no limit."""
        self.budget_s = budget_s
        self._per_iteration: dict[int, float] = {}
        self._last_read = 0.0

    @staticmethod
    def _size(rows: int) -> int:
        return (max(rows, 1) - 1).bit_length()  # 33-64 rows: one size

    def observe(self, step: TimedStep, read_at: float | None = None) -> None:
        """``step``'s results were read at ``read_at`` (now if None). Its device time is counted from
        its dispatch, or from the read of the step before when it was queued behind that one."""
        read_at = time.perf_counter() if read_at is None else read_at
        start, self._last_read = max(step.dispatched_at, self._last_read), read_at
        if step.decode_iterations <= 0 or step.dispatched_at <= 0:
            return
        size = self._size(len(step.chunks))
        seconds = (read_at - start) / step.decode_iterations
        old = self._per_iteration.get(size)
        self._per_iteration[size] = seconds if old is None else old + self.SMOOTHING * (seconds - old)

    def allows(self, rows: int, steps: int) -> bool:
        """Whether a decode call of ``steps`` iterations over ``rows`` sequences fits the budget."""
        if self.budget_s <= 0 or steps <= 1:
            return True
        per_iteration = self._per_iteration.get(self._size(rows))
        return per_iteration is None or per_iteration * steps <= self.budget_s

    def estimate(self, rows: int) -> float | None:
        """Measured seconds per iteration at ``rows``' batch size (None: not measured yet)."""
        return self._per_iteration.get(self._size(rows))
