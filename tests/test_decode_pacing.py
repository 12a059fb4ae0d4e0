"""``DecodePacer``: decode-call timing by batch size, smoothed, and the budget it enforces."""

from __future__ import annotations

import dataclasses

import pytest

from myserve.core.decode_pacing import DecodePacer


@dataclasses.dataclass
class Step:
    decode_iterations: int
    dispatched_at: float
    rows: dataclasses.InitVar[int]
    chunks: range = dataclasses.field(init=False)

    def __post_init__(self, rows: int) -> None:
        self.chunks = range(rows)


def test_a_k_token_call_is_allowed_until_measured_then_only_within_the_budget() -> None:
    pacer = DecodePacer(budget_s=0.12)
    assert pacer.allows(64, 8)  # nothing known yet
    pacer.observe(Step(8, dispatched_at=1.0, rows=64), read_at=1.4)  # 50 ms a token at 33-64 rows
    assert pacer.estimate(40) == pytest.approx(0.05) == pacer.estimate(64) and pacer.estimate(65) is None
    assert not pacer.allows(64, 8) and pacer.allows(64, 2) and pacer.allows(64, 1)
    assert pacer.allows(3, 8)  # another batch size: not measured
    assert DecodePacer(budget_s=0).allows(64, 8)  # no limit


def test_a_queued_step_counts_from_the_read_before_it_and_prompt_steps_are_not_timed() -> None:
    pacer = DecodePacer(budget_s=1.0)
    pacer.observe(Step(0, dispatched_at=1.0, rows=4), read_at=2.0)  # a prefill: not timed
    assert pacer.estimate(4) is None
    pacer.observe(Step(1, dispatched_at=1.5, rows=4), read_at=2.25)  # queued behind it: 0.25 s
    assert pacer.estimate(4) == pytest.approx(0.25)
    # One slow call moves the estimate by SMOOTHING of the difference, not all the way.
    pacer.observe(Step(1, dispatched_at=3.0, rows=4), read_at=4.25)
    assert pacer.estimate(4) == pytest.approx(0.25 + DecodePacer.SMOOTHING * 1.0)
