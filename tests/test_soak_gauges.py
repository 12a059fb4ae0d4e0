"""The soak benchmark's idle gauges: grammar matchers alive and penalty slots used rise while
constrained / penalised requests run in an engine core process and return to 0 once they finish,
are aborted, or end with several choices, as ``/metrics`` shows them."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from myserve.bench.soak_checks import parse_metrics
from myserve.frontend.metrics import Metrics, ModelMetrics
from myserve.grammar import GrammarSpec
from myserve.testing import TINY_ENGINE, collect, make_tiny_checkpoint, start_client
from myserve.wire.params import SamplingParams

PROMPT = [(7 * j) % 5000 + 100 for j in range(12)]
GAUGES = ("myserve_grammar_matchers_active", "myserve_penalty_slots_used", "myserve_kv_pages_used")


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory):
    # SmolLM2's vocabulary, so that grammars over its tokenizer apply to the model's tokens.
    checkpoint = make_tiny_checkpoint("llama3", tmp_path_factory.mktemp("vocab") / "llama", vocab_size=49152)
    client = start_client(Path(checkpoint), *TINY_ENGINE, "engine.num_pages=256")
    yield client
    client.shutdown()


def gauges(metrics: ModelMetrics) -> dict[str, float]:
    figures = parse_metrics(metrics.render().decode())
    return {name: figures[name] for name in GAUGES}


def wait_for(metrics: ModelMetrics, predicate, timeout_s: float = 10.0) -> dict[str, float]:
    """The gauges once ``predicate`` holds for them (the core reports every 0.25 s)."""
    deadline = time.monotonic() + timeout_s
    while not predicate(seen := gauges(metrics)):
        assert time.monotonic() < deadline, seen
        time.sleep(0.05)
    return seen


@pytest.mark.slow  # about 35 s on 2 cores: a tiny checkpoint with SmolLM2's vocabulary, warmup
def test_matchers_and_penalty_slots_return_to_zero(client) -> None:
    metrics = Metrics().for_model("tiny", client)  # one model's series, its engine's gauges read per scrape
    assert gauges(metrics) == dict.fromkeys(GAUGES, 0.0)
    digits = GrammarSpec("regex", "[0-9]{200}")
    long_ones = [
        client.submit(PROMPT, SamplingParams(max_tokens=300, temperature=1.0, seed=1, grammar=digits)),
        client.submit(PROMPT, SamplingParams(max_tokens=300, temperature=1.0, seed=2, presence_penalty=0.5)),
        client.submit(PROMPT, SamplingParams(max_tokens=300, seed=3, n=2, repetition_penalty=1.2, grammar=digits)),
    ]
    # A matcher exists from the request's arrival, a penalty slot and pages from its admission, and
    # the core reports every 0.25 s: a report may fall between the two, so wait for all of them.
    wait_for(
        metrics,
        lambda g: (
            g["myserve_grammar_matchers_active"] == 3
            and g["myserve_penalty_slots_used"] >= 1
            and g["myserve_kv_pages_used"] > 0
        ),
    )
    client.abort(long_ones[2].request_id)  # aborted mid-way: both choices give theirs back
    for stream in long_ones:
        list(stream)
    # Constrained last: the runner still refers to the last step's sequences, not to their matchers.
    short = [
        SamplingParams(max_tokens=8, n=3, presence_penalty=0.2),
        SamplingParams(max_tokens=8, frequency_penalty=0.4, grammar=GrammarSpec("choice", '["yes", "no"]')),
    ]
    for params in short:
        assert collect(client.submit(PROMPT, params))[2] in ("stop", "length")
    wait_for(metrics, lambda g: g == dict.fromkeys(GAUGES, 0.0))
