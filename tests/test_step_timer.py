"""StepTimer: phases add up; the gap runs from reading one step's results to the next dispatch, and is
negative when the next step was dispatched before the last was read (overlapped steps)."""

from __future__ import annotations

import time

from myserve.core.step_timer import PHASES, StepTimer


def test_phases_and_the_gap_between_steps_one_at_a_time() -> None:
    timer = StepTimer()
    t = timer.now()
    timer.dispatching(1, t)  # the first step follows nothing: no gap
    t = timer.lap("dispatch", t)
    t = timer.lap("read", t)
    timer.read_done(1, t)
    time.sleep(0.02)  # post-processing and planning of the next step: the device idles
    t = timer.lap("postprocess", t)
    timer.dispatching(2, t)
    assert 0.02 <= timer.mean_gap < 0.5
    assert set(timer.seconds) == set(PHASES) and timer.seconds["postprocess"] >= 0.02
    # After an idle wait for requests, the next dispatch is not a gap between steps.
    timer.read_done(2, timer.now())
    timer.idle()
    time.sleep(0.05)
    timer.dispatching(3, timer.now())
    assert timer.mean_gap < 0.05


def test_overlapped_steps_give_a_negative_gap_and_a_timeline() -> None:
    timer = StepTimer()
    timer.plan_started(1, timer.now())
    timer.dispatching(1, timer.now())
    timer.plan_started(2, timer.now())
    timer.dispatching(2, timer.now())  # step 2 is queued while step 1 runs
    time.sleep(0.01)
    timer.read_done(1, timer.now())  # step 1 read after step 2 was dispatched
    assert timer.mean_gap < -0.005
    events = [(i, e) for i, e, _ in timer.timeline]
    assert events == [(1, "plan"), (1, "dispatched"), (2, "plan"), (2, "dispatched"), (1, "read")]
