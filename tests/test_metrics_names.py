"""``/metrics`` in vLLM's names and types (so vLLM's dashboards and autoscaling rules work
unchanged), read with prometheus_client's own parser from the real app over real HTTP (the tiny
Llama): the types, the ``model_name`` label, counters that move by what the requests did; and the
shipped Grafana dashboard, every expression of which must name a series the server exports."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server import LiveServer

from myserve.frontend.app import create_app

MODEL = "tiny"
DASHBOARD = Path(__file__).resolve().parents[1] / "config" / "grafana" / "myserve-dashboard.json"
VLLM_TYPES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_success": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
}
"""vLLM's families (prometheus_client's parser names a counter without ``_total``) and their types."""
PROMPT = list(range(1, 41))
"""40 token ids (the tiny vocabulary has 256): five full pages of 8, which a repeat finds cached."""


@pytest.fixture(scope="module")
def live(tiny_service):
    server = LiveServer(create_app(tiny_service, served_model_name=MODEL))
    yield server
    server.stop()


def scrape(live: LiveServer) -> tuple[dict[str, str], dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    """(family name -> type, (sample name, labels) -> value) of the live ``/metrics``."""
    text = httpx.get(f"{live.url}/metrics").text
    types, samples = {}, {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            samples[s.name, tuple(sorted(s.labels.items()))] = s.value
    return types, samples


def value(samples: dict, name: str, **labels: str) -> float:
    """One sample of the model's series (0 when it does not exist yet)."""
    return samples.get((name, tuple(sorted({"model_name": MODEL, **labels}.items()))), 0.0)


def complete(live: LiveServer, **body: object) -> dict:
    """A completion of ``PROMPT`` (greedy, EOS ignored: it ends by length)."""
    full = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True, **body}
    r = httpx.post(f"{live.url}/v1/completions", json=full, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_vllm_names_types_labels_and_counters_that_move(live) -> None:
    complete(live)  # the prompt's pages are cached from here on
    types, before = scrape(live)
    assert {name: types.get(name) for name in VLLM_TYPES} == VLLM_TYPES
    assert all(("model_name", MODEL) in labels for (name, labels) in before if name.startswith("vllm:"))
    assert not [
        name
        for name in types
        if name.startswith("myserve_")
        and name.removeprefix("myserve_")
        in {
            "prompt_tokens",
            "generation_tokens",
            "num_requests_running",
            "num_requests_waiting",
            "num_preemptions",
            "time_to_first_token_seconds",
            "inter_token_latency_seconds",
            "e2e_request_latency_seconds",
            "prefix_cache_hit_rate",
        }
    ]  # no duplicates of vLLM's series under our prefix

    usage = complete(live, n=2)["usage"]
    with httpx.stream(
        "POST",
        f"{live.url}/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "ignore_eos": True, "stream": True},
    ) as r:
        streamed = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert streamed[-1] == "data: [DONE]"
    _, after = scrape(live)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("vllm:prompt_tokens_total") == usage["prompt_tokens"] + len(PROMPT)
    assert moved("vllm:generation_tokens_total") == usage["completion_tokens"] + 3 == 2 * 4 + 3
    assert moved("vllm:request_success_total", finished_reason="length") == 3  # each choice, as vLLM's requests
    assert moved("vllm:request_success_total", finished_reason="stop") == 0
    assert moved("vllm:e2e_request_latency_seconds_count") == 2
    assert moved("vllm:time_to_first_token_seconds_count") == 2
    # One gap per delta after the first: the stream's 3 tokens came in 3 deltas (one per step: 2
    # gaps), 2 (a decode call's 2 tokens at once, or deltas coalesced for a reader that fell behind:
    # 1 gap) or, coalesced, 1 (no gap).
    assert moved("vllm:inter_token_latency_seconds_count") in (0, 1, 2)
    assert moved("vllm:prefix_cache_queries_total") >= 2 * len(PROMPT) - 2  # looked up for each request
    assert moved("vllm:prefix_cache_hits_total") >= 32  # at least the 4 full pages before the last token
    assert value(after, "vllm:kv_cache_usage_perc") == pytest.approx(
        value(after, "myserve_kv_pages_used") / value(after, "myserve_kv_pages_total")
    )
    assert value(after, "vllm:num_requests_running") == value(after, "vllm:num_requests_waiting") == 0
    # vLLM V0's names, which the production-stack router reads, tell the same truth.
    for old, new in (
        ("gpu_prefix_cache_hits_total", "prefix_cache_hits_total"),
        ("gpu_cache_usage_perc", "kv_cache_usage_perc"),
    ):
        assert value(after, f"vllm:{old}") == value(after, f"vllm:{new}")
    hits, queries = value(after, "vllm:prefix_cache_hits_total"), value(after, "vllm:prefix_cache_queries_total")
    assert value(after, "vllm:gpu_prefix_cache_hit_rate") == pytest.approx(hits / queries) and hits > 0


def test_an_aborted_request_counts_as_abort(live) -> None:
    _, before = scrape(live)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))  # then hang up
    for _ in range(100):
        _, after = scrape(live)
        key = ("vllm:request_success_total", (("finished_reason", "abort"), ("model_name", MODEL)))
        if after.get(key, 0.0) > before.get(key, 0.0):
            break
    assert after[key] - before.get(key, 0.0) == 1


def _expressions(node: object) -> Iterator[str]:
    """Every ``expr`` of the dashboard, and its template variables' queries."""
    if isinstance(node, dict):
        for key, child in node.items():
            if key in ("expr", "definition") and isinstance(child, str):
                yield child
            else:
                yield from _expressions(child)
    elif isinstance(node, list):
        for child in node:
            yield from _expressions(child)


SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*[{\[]|label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)")
"""A metric name in PromQL: the identifier before a selector's ``{`` or a range's ``[``, or the
first argument of Grafana's ``label_values(name, label)``."""
PROMQL_WORDS = {"sum", "avg", "rate", "by", "le", "histogram_quantile", "label_values", "model_name"}


def test_dashboard_loads_and_names_only_exported_series(live) -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    expressions = list(_expressions(dashboard))
    assert len(dashboard["panels"]) >= 8 and len(expressions) >= 15
    complete(live, n=1)  # every labelled series exists (request_success's too)
    _, samples = scrape(live)
    exported = {name for name, _ in samples}
    named = set()
    for expr in expressions:
        names = {a or b for a, b in SELECTOR.findall(expr)}
        assert names, expr
        # Every identifier that is not PromQL's own is one of those names (none slipped past the pattern).
        words = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", re.sub(r'"[^"]*"|\[[^\]]*\]', "", expr)))
        assert words - PROMQL_WORDS - {"p", "finished_reason", "endpoint", "status", "phase"} <= names, expr
        named |= names
    assert named - exported == set()
    for family in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds"):
        assert f"{family}_bucket" in named  # latency percentiles over vLLM's histograms
    assert {"vllm:prefix_cache_hits_total", "vllm:num_preemptions_total", "vllm:kv_cache_usage_perc"} <= named
