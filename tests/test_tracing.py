"""OpenTelemetry traces (``frontend/tracing.py``): one span per request, child of the client's
``traceparent``, with the GenAI attributes, through the real app over real HTTP into the SDK's
in-memory exporter; and a server without tracing never loads the SDK."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from test_server import LiveServer

from myserve.frontend import tracing
from myserve.frontend.app import create_app

MODEL = "tiny"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def traced(tiny_service):
    """A live app over the tiny Llama whose spans go to an in-memory exporter: (server, exporter)."""
    exporter = InMemorySpanExporter()
    tracer = tracing.install(exporter)
    server = LiveServer(create_app(tiny_service, served_model_name=MODEL, tracer=tracer))
    yield server, exporter
    server.stop()
    tracer.shutdown()


def test_a_request_with_a_traceparent_makes_one_child_span_with_the_genai_attributes(traced) -> None:
    server, exporter = traced
    exporter.clear()
    body = {
        "model": MODEL,
        "prompt": [5, 6, 7, 8],
        "max_tokens": 4,
        "ignore_eos": True,
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 3,
    }
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    spans = exporter.get_finished_spans()
    assert len(spans) == 1
    span = spans[0]
    assert span.parent is not None and span.parent.span_id == int(PARENT_SPAN_ID, 16) and span.parent.is_remote
    assert span.context.trace_id == int(TRACE_ID, 16) and span.context.span_id != int(PARENT_SPAN_ID, 16)
    assert span.name == f"text_completion {MODEL}" and span.kind == SpanKind.SERVER
    assert span.status.status_code == StatusCode.UNSET
    a = dict(span.attributes or {})
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == MODEL
    assert a["gen_ai.response.id"] == out["id"]
    assert a["gen_ai.usage.input_tokens"] == out["usage"]["prompt_tokens"] == 4
    assert a["gen_ai.usage.output_tokens"] == out["usage"]["completion_tokens"] == 4
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.temperature"], a["gen_ai.request.top_p"]) == (4, 0.5, 0.9)
    assert a["gen_ai.request.seed"] == 3 and "gen_ai.request.choice.count" not in a
    ttft, e2e = a["gen_ai.latency.time_to_first_token"], a["gen_ai.latency.e2e"]
    assert isinstance(ttft, float) and isinstance(e2e, float) and 0 < ttft <= e2e
    # The span covers the request from its arrival to its end: its duration is the e2e latency.
    assert span.start_time is not None and span.end_time is not None
    assert abs((span.end_time - span.start_time) / 1e9 - e2e) < 0.05


def test_a_streamed_request_without_traceparent_is_a_root_span_and_each_request_has_its_own(traced) -> None:
    server, exporter = traced
    exporter.clear()
    body = {"model": MODEL, "prompt": [9, 10], "max_tokens": 3, "ignore_eos": True, "n": 2, "stream": True}
    for _ in range(2):
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
    spans = exporter.get_finished_spans()
    assert len(spans) == 2 and spans[0].context.trace_id != spans[1].context.trace_id
    for span in spans:
        a = dict(span.attributes or {})
        assert span.parent is None
        assert a["gen_ai.usage.output_tokens"] == 6 and a["gen_ai.response.finish_reasons"] == ("length", "length")
        assert a["gen_ai.request.choice.count"] == 2 and "gen_ai.request.seed" not in a
        assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]


def test_a_client_that_hangs_up_ends_its_span_as_an_error(traced) -> None:
    server, exporter = traced
    exporter.clear()
    body = {"model": MODEL, "prompt": [11, 12], "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))  # one chunk, then hang up
    deadline = time.monotonic() + 30
    while not exporter.get_finished_spans():  # the server notices when it next writes
        assert time.monotonic() < deadline, "the span did not end"
        time.sleep(0.05)
    (span,) = exporter.get_finished_spans()
    a = dict(span.attributes or {})
    assert span.status.status_code == StatusCode.ERROR and a["error.type"] == "disconnected"
    assert 1 <= a["gen_ai.usage.output_tokens"] < 200 and "gen_ai.response.finish_reasons" not in a


_SERVE_UNTRACED = """
import json, sys, threading
from fastapi.testclient import TestClient
from myserve.config import Config
from myserve.frontend.app import ServedModel
from myserve.frontend.http_server import app_for_models

class Loading:  # an engine still loading: the app is built and answers 503 (models, generation)
    tokenizer, vocab_size, max_model_len, ready, adapter_paths = None, 0, 0, threading.Event(), {}
    def stats(self): raise AssertionError("not scraped")

app = app_for_models(Config(), [ServedModel(engine=Loading(), names=("m",))])
answers = [TestClient(app).get("/v1/models").status_code, TestClient(app).post(
    "/v1/completions", json={"model": "m", "prompt": "x"}).status_code]
def otel_modules():
    return sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk", "myserve.frontend.tracing")))
off = otel_modules()
import myserve.frontend.tracing  # the check sees the SDK once tracing is loaded
print(json.dumps({"answers": answers, "off": off, "on": otel_modules()}))
"""


def test_a_server_without_tracing_never_imports_the_sdk() -> None:
    done = subprocess.run([sys.executable, "-c", _SERVE_UNTRACED], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["answers"] == [503, 503]
    assert result["off"] == []
    assert {"opentelemetry.sdk.trace", "myserve.frontend.tracing"} <= set(result["on"])


def test_an_unknown_otlp_protocol_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="grpc, http/protobuf"):
        tracing.otlp_tracer("http://localhost:4317")
