"""Several decode tokens per call, on the fake device (``FakeCore``: the real engine core,
scheduler and runner; no JAX): the same tokens and finishes as one token per call, pages reserved
for the call and given back, a call's tokens after the end dropped, and rows that need the host
between tokens kept to one."""

from __future__ import annotations

import time
from typing import Any

import pytest

from myserve.runtime.sampling_rows import BAN_STEPS, STEPS
from myserve.testing import FakeCore, FakeDevice, assert_consistent, scripted_token
from myserve.wire.params import SamplingParams

EOS = 2


def mixed(e: FakeCore) -> list[str]:
    """Requests ending every way: EOS, a stop id, max_tokens, ignore_eos, min_tokens, n > 1."""
    requests = {
        "eos": SamplingParams(max_tokens=30, temperature=1.0, seed=1),
        "stop-id": SamplingParams(max_tokens=30, temperature=1.0, seed=2, stop_token_ids=(77,)),
        "length": SamplingParams(max_tokens=4, temperature=1.0, seed=3),
        "ignore": SamplingParams(max_tokens=13, temperature=1.0, seed=4, ignore_eos=True),
        "min": SamplingParams(max_tokens=30, temperature=1.0, seed=5, min_tokens=9),
        "n2": SamplingParams(max_tokens=11, temperature=1.0, seed=6, n=2),
        "one": SamplingParams(max_tokens=1, temperature=1.0, seed=7),
    }
    for i, (name, params) in enumerate(requests.items()):
        e.submit(list(range(10 + i, 19 + 2 * i)), params, name)
    return list(requests)


def script(seed: int, choice: int, pos: int) -> int:
    """EOS at position 5 (and 12), token 77 at position 3: every finish happens mid-call."""
    return {5: EOS, 12: EOS, 3: 77}.get(pos, scripted_token(seed, choice, pos))


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("steps", [4, 8])
def test_the_same_tokens_as_one_per_call(steps: int, overlap: bool) -> None:
    runs = {}
    for k in (1, steps):
        e = FakeCore(
            device=FakeDevice(script), decode_steps=k, overlap=overlap, num_pages=40, budget=16, max_num_seqs=8
        )
        names = mixed(e)
        e.run()
        runs[k] = {name: e.finished(name) for name in names}
        assert_consistent(e.scheduler, e.live)
        assert e.scheduler.allocator.num_used == 0  # every reserved page came back
        calls = [op for op in e.device.steps if op.steps > 1]
        assert bool(calls) == (k > 1)
        if k > 1:
            assert max(int(op.ints[:, STEPS].max()) for op in calls) == k
    assert runs[1] == runs[steps]
    assert runs[1]["eos"][0][1] == "stop" and runs[1]["eos"][0][0][-1] == EOS
    assert runs[1]["stop-id"][0][0][-1] == 77 and runs[1]["length"][0][1] == "length"
    assert len(runs[1]["min"][0][0]) > 9 and EOS not in runs[1]["min"][0][0][:9]


def test_a_call_never_runs_past_max_tokens_and_bans_only_under_min_tokens() -> None:
    e = FakeCore(device=FakeDevice(lambda s, c, p: EOS if p in (2, 5) else 40), decode_steps=8)
    e.submit([5, 6, 7], SamplingParams(max_tokens=6, temperature=1.0, seed=0, min_tokens=5, ignore_eos=False), "r")
    e.run()
    tokens, finish = e.finished("r")[0]
    assert finish == "stop" and len(tokens) == 6 and EOS not in tokens[:5]
    calls = [op for op in e.device.steps if op.steps > 1]
    assert calls
    first = calls[0].ints[0]
    assert first[STEPS] <= 6 - 1  # the prefill step sampled one token; max_tokens caps the rest
    assert first[BAN_STEPS] == 5 - 1  # banned for the tokens still under min_tokens


def test_an_abort_ends_a_request_within_one_call_and_frees_its_pages() -> None:
    e = FakeCore(decode_steps=8, overlap=True)
    e.submit([5, 6, 7, 8], SamplingParams(max_tokens=100, temperature=1.0, seed=0), "r")
    e.step()
    e.step()
    e.step()
    e.core.abort("r")
    e.run()
    tokens, finish = e.finished("r")[0]
    assert finish == "abort" and len(tokens) < 100
    assert e.scheduler.allocator.num_used == 0
    assert_consistent(e.scheduler, e.live)


class SlowDevice(FakeDevice):
    """A fake device whose results take ``per_iteration`` seconds per model iteration of the call."""

    def __init__(self, per_iteration: float):
        super().__init__()
        self.per_iteration = per_iteration

    def read(self, output: Any, *, tops: bool, scored: bool, pooled: bool = False) -> Any:
        time.sleep(self.per_iteration * (output.tokens.shape[0] if output.tokens.ndim == 2 else 1))
        return super().read(output, tops=tops, scored=scored, pooled=pooled)


@pytest.mark.parametrize("per_iteration, several", [(0.0, True), (0.02, False)])
def test_decode_calls_stay_one_token_where_k_tokens_would_outlast_the_budget(per_iteration: float, several: bool):
    """A K = 8 call of 20 ms per token (160 ms) is over a 50 ms budget: after the first call has
    measured it, decode-only steps are one token each, so a request arriving meanwhile waits one
    token; a fast device keeps K tokens per call throughout."""
    e = FakeCore(device=SlowDevice(per_iteration), decode_steps=8, decode_call_budget_s=0.05, num_pages=40)
    e.submit([5, 6, 7], SamplingParams(max_tokens=40, temperature=1.0, seed=0, ignore_eos=True), "r")
    e.run()
    assert len(e.finished("r")[0][0]) == 40
    decode_only = [b for b in e.batches if b.decodes and not b.prefills]
    long_calls = [b for b in decode_only if max(c.steps for c in b.decodes) > 1]
    if several:
        assert len(long_calls) == len(decode_only) >= 4
    else:
        assert len(long_calls) == 1 and decode_only[0] is long_calls[0]  # the one that measured it
        assert len(decode_only) >= 30
    pacer = e.core.replicas[0].runner.pacer
    estimate = pacer.estimate(1)
    assert estimate is not None and (estimate >= 0.015) == (not several)
