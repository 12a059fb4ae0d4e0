"""The host side of the packed sampling rows: what the jitted sampler will read, without a device."""

from __future__ import annotations

import numpy as np

from myserve.runtime.sampling_rows import (
    CHOICE,
    CONSTRAINED,
    FLOAT_PARAMS,
    LOGPROBS,
    POSITION,
    SEED,
    SLOT,
    TOP_K,
    WEIGHT,
    SamplingRows,
    head_mode,
)
from myserve.wire.params import SamplingParams


def test_leading_rows_carry_their_requests_and_padding_rows_stay_inert() -> None:
    a = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, presence_penalty=0.5, logprobs=2)
    b = SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=-0.5)
    rows = SamplingRows.empty(4, scratch_slot=9)
    rows.set_leading([a, b], seeds=[2**32 + 5, 2**31], choices=[0, 3], positions=[7, 0])

    for i, p in enumerate((a, b)):
        np.testing.assert_array_equal(
            rows.floats[i, : len(FLOAT_PARAMS)], np.float32([getattr(p, name) for name in FLOAT_PARAMS])
        )
    np.testing.assert_array_equal(rows.ints[:2, TOP_K], [5, 0])
    np.testing.assert_array_equal(rows.ints[:2, LOGPROBS], [1, 0])
    np.testing.assert_array_equal(rows.ints[:2, CHOICE], [0, 3])
    np.testing.assert_array_equal(rows.ints[:2, POSITION], [7, 0])
    # Seeds are taken modulo 2**32 and stored as the int32 with the same bits.
    assert rows.ints[:2, SEED].view(np.uint32).tolist() == [5, 2**31]
    np.testing.assert_array_equal(rows.ints[:, WEIGHT], [1, 1, 0, 0])
    # Penalty slots are the runner's to set; every row starts on the scratch slot.
    np.testing.assert_array_equal(rows.ints[:, SLOT], [9, 9, 9, 9])
    padding = SamplingRows.empty(2, scratch_slot=9)
    np.testing.assert_array_equal(rows.ints[2:], padding.ints)
    np.testing.assert_array_equal(rows.floats[2:], padding.floats)


def test_no_leading_rows_leaves_the_padding() -> None:
    rows = SamplingRows.empty(2, scratch_slot=1)
    rows.set_leading([], [], [], [])
    np.testing.assert_array_equal(rows.ints, SamplingRows.empty(2, scratch_slot=1).ints)


def test_the_host_picks_the_head_each_step_needs() -> None:
    """``head_mode``: the raw argmax only when every row is plain greedy; any edit, logprobs or a
    temperature takes ``sample``; a drawing row with top-k or top-p takes ``filter``; padding rows
    (past the step's sampling rows) never count."""

    def mode(*params: SamplingParams, banned: int | None = None, constrained: int | None = None) -> str:
        rows = SamplingRows.empty(len(params) + 2, scratch_slot=9)
        rows.set_leading(list(params), seeds=[0] * len(params), choices=[0] * len(params), positions=[0] * len(params))
        for i, p in enumerate(params):
            if p.logit_bias:
                ids, values = zip(*p.logit_bias, strict=True)
                rows.set_bias(i, ids, values)
        if banned is not None:
            rows.set_banned(banned, (2,))
        if constrained is not None:
            rows.ints[constrained, CONSTRAINED] = 1
        rows.floats[-1, 0] = 1.0  # a padding row's temperature: past the step's rows, ignored
        return head_mode(rows.ints, rows.floats, len(params))

    greedy = SamplingParams(temperature=0.0)
    assert mode(greedy, greedy) == "argmax"
    assert mode() == "argmax"
    assert mode(greedy, SamplingParams(temperature=0.0, logprobs=0)) == "sample"
    assert mode(greedy, SamplingParams(temperature=0.0, logit_bias=((5, 1.0),))) == "sample"
    assert mode(greedy, greedy, banned=1) == "sample"
    assert mode(greedy, greedy, constrained=0) == "sample"
    for penalty in (dict(repetition_penalty=1.1), dict(frequency_penalty=0.5), dict(presence_penalty=-0.5)):
        assert mode(greedy, SamplingParams(temperature=0.0, **penalty)) == "sample"
    assert mode(greedy, SamplingParams(temperature=0.8)) == "sample"
    assert mode(greedy, SamplingParams(temperature=0.8, min_p=0.1)) == "sample"
    assert mode(greedy, SamplingParams(temperature=0.8, top_p=0.9)) == "filter"
    assert mode(greedy, SamplingParams(temperature=0.8, top_k=40)) == "filter"
    # top-k/top-p on a greedy row filters nothing: no thresholds needed.
    assert mode(SamplingParams(temperature=0.0, top_k=5, top_p=0.5)) == "argmax"
