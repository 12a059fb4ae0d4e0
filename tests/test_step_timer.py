"""StepTimer: phases add up, and the gap runs from reading one step's results to the next dispatch."""

from __future__ import annotations

import time

from myserve.engine.step_timer import PHASES, StepTimer


def test_phases_and_the_gap_between_steps() -> None:
    timer = StepTimer()
    t = timer.now()
    timer.dispatching(t)  # the first step follows nothing: no gap
    t = timer.lap("dispatch", t)
    t = timer.lap("read", t)
    time.sleep(0.02)  # post-processing and planning of the next step: the device idles
    t = timer.lap("postprocess", t)
    timer.dispatching(t)
    assert 0.02 <= timer.mean_gap < 0.5
    assert set(timer.seconds) == set(PHASES) and timer.seconds["postprocess"] >= 0.02
    # After an idle wait for requests, the next dispatch is not a gap between steps.
    timer.lap("read", timer.now())
    timer.idle()
    time.sleep(0.05)
    timer.dispatching(timer.now())
    assert timer.mean_gap < 0.05
