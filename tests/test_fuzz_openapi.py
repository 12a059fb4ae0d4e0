"""Schemathesis against the app's own ``/openapi.json``, served by uvicorn over the real engine (the
session's SmolLM2 core process, as ``python -m myserve.serve`` runs it).

Bodies that fit the schema (positive) and bodies that break it (negative) are sent to every operation;
each answer must be below 500, and every 4xx must be OpenAI's error envelope. Afterwards the server is
healthy, still answers a chat request, and the engine runs nothing. Hypothesis is derandomized (a
fixed seed per operation and mode, no example database), so CI replays the same requests every run.

What is adjusted in the generated requests, so that the run fits CI on two cores, and why it hides
nothing: ``model`` strings are set to the served name (a random name only ever reaches the 404 that
``test_conformance`` covers, and nothing behind it); a ``max_tokens``/``max_completion_tokens``
(``max_output_tokens`` on responses) that would generate more than ``MAX_NEW`` tokens is set to
``MAX_NEW``, and so is an absent or null one (16 on completions, the context length on chat and
responses). Values beyond the context length, negative or of the wrong type are sent as they were
generated.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from test_server import LiveServer

from myserve.frontend.app import create_app

MODEL = "smol"
MAX_NEW = 3
"""Most tokens a fuzzed request may generate (per choice)."""
EXAMPLES = {"POST": 30, "GET": 5}
"""Examples per operation and generation mode. For a deeper local run: MYSERVE_FUZZ_EXAMPLES=500
(every operation), and MYSERVE_FUZZ_RANDOM=1 for fresh random examples instead of CI's fixed ones."""
if os.environ.get("MYSERVE_FUZZ_EXAMPLES"):
    EXAMPLES = dict.fromkeys(EXAMPLES, int(os.environ["MYSERVE_FUZZ_EXAMPLES"]))
DERANDOMIZE = not os.environ.get("MYSERVE_FUZZ_RANDOM")
GENERATION = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
MAX_KEYS = {
    "/v1/completions": ["max_tokens"],
    "/v1/chat/completions": ["max_tokens", "max_completion_tokens"],
    "/v1/responses": ["max_output_tokens"],
}
"""Each generation route's fields that bound the new tokens."""
BODIES = {
    "/v1/chat/completions": "ChatCompletionRequest",
    "/v1/responses": "ResponsesRequest",
    "/v1/completions": "CompletionRequest",
    "/tokenize": "TokenizeRequest",
    "/detokenize": "DetokenizeRequest",
}
OPERATIONS = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/responses"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/v1/models/{model}"),
    ("GET", "/v1/models"),
    ("GET", "/health"),
    ("GET", "/metrics"),
]


@pytest.fixture(scope="module", autouse=True)
def hypothesis_globals_restored() -> Iterator[None]:
    """Schemathesis patches Hypothesis' globals on first use (schemathesis/generation/hypothesis:
    ``setup``: a printer that prints no falsifying example, a larger buffer); the test files after this
    one get Hypothesis back as it was."""
    import hypothesis.core
    import hypothesis.internal.conjecture.engine
    import hypothesis.internal.entropy
    import hypothesis.strategies._internal.collections
    import hypothesis.strategies._internal.core
    from schemathesis.generation import hypothesis as schemathesis_hypothesis

    patched = [
        (hypothesis.core, "RepresentationPrinter"),
        (hypothesis.core, "BUFFER_SIZE"),
        (hypothesis.internal.conjecture.engine, "BUFFER_SIZE"),
        (hypothesis.strategies._internal.collections, "BUFFER_SIZE"),
        (hypothesis.strategies._internal.core, "is_first_param_referenced_in_function"),
        (hypothesis.internal.entropy, "register_random"),
    ]
    missing = object()
    saved = [(module, name, getattr(module, name, missing)) for module, name in patched]
    was_patched = getattr(schemathesis_hypothesis.setup, "_is_patched", False)
    yield
    if was_patched:
        return
    for module, name, value in saved:
        if value is missing:
            if hasattr(module, name):
                delattr(module, name)
        else:
            setattr(module, name, value)
    schemathesis_hypothesis.setup._is_patched = False  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def service(smol_client):
    return smol_client


@pytest.fixture(scope="module")
def live(service) -> Iterator[LiveServer]:
    server = LiveServer(create_app(service, served_model_name=MODEL, max_body_bytes=256 * 1024))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def schema(live):
    return schemathesis.openapi.from_url(f"{live.url}/openapi.json")


def test_openapi_declares_the_request_bodies(live, service) -> None:
    spec = httpx.get(f"{live.url}/openapi.json").json()
    for path, model in BODIES.items():
        body = spec["paths"][path]["post"]["requestBody"]
        assert body["required"] and body["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{model}"
        }
    fields = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"messages", "model", "max_tokens", "seed", "n", "logit_bias", "stream"} <= set(fields)
    seed = next(s for s in fields["seed"]["anyOf"] if s.get("type") == "integer")
    assert (seed["minimum"], seed["exclusiveMaximum"]) == (-(2**63), 2**63)
    # Token ids: bounded by the model's vocabulary, known to the schema once the model has loaded.
    vocab = service.vocab_size
    tokens = spec["components"]["schemas"]["DetokenizeRequest"]["properties"]["tokens"]["items"]
    assert (tokens["minimum"], tokens["maximum"]) == (0, vocab - 1)
    prompt = spec["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": vocab - 1}} in prompt


def test_unparsable_body_names_no_field(live) -> None:
    """Found by the fuzzer: the error of a body that is not JSON named its character offset as param."""
    for raw in (b"{not json", b'{"model": "smol", "prompt": "x",}'):
        r = httpx.post(f"{live.url}/v1/completions", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] is None, r.text


def bounded(case: Any, max_model_len: int) -> Any:
    """``case`` with the served model name and at most MAX_NEW new tokens (see the module's docstring)."""
    body = case.body
    if case.path not in BODIES or not isinstance(body, dict):
        return case
    if isinstance(body.get("model"), str):
        body["model"] = MODEL
    if case.path in GENERATION:
        keys = MAX_KEYS[case.path]
        given = [k for k in keys if body.get(k) is not None]
        if not given:  # completions' default is 16; None (chat's, responses' default) is the context length
            body[keys[0]] = MAX_NEW
        for k in given:
            if isinstance(body[k], int) and MAX_NEW < body[k] <= max_model_len:
                body[k] = MAX_NEW
    return case


def check_answer(case: Any, response: Any) -> None:
    """Below 500; a 4xx is OpenAI's envelope."""
    what = f"{case.method} {case.formatted_path} {case.body!r:.2000} -> {response.status_code} {response.text:.2000}"
    assert response.status_code < 500, what
    if response.status_code >= 400:
        body = response.json()
        assert isinstance(body, dict) and set(body) == {"error"}, what
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, what
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), what
        assert err["param"] is None or isinstance(err["param"], str), what
        assert err["code"] is None or isinstance(err["code"], str), what


# Negative mode for the operations with a body: the others have nothing that can break the schema
# (no parameters, or a path string that any string fits).
CASES = [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS]
CASES += [(m, p, GenerationMode.NEGATIVE) for m, p in OPERATIONS if p in BODIES]


@pytest.mark.slow
@pytest.mark.parametrize(("method", "path", "mode"), CASES, ids=[f"{m} {p} {g}" for m, p, g in CASES])
def test_fuzz(schema, live, service, method, path, mode) -> None:
    operation = schema[path][method]
    strategy = operation.as_strategy(generation_mode=mode).map(lambda c: bounded(c, service.max_model_len))
    seen: list[int] = []

    @settings(
        max_examples=EXAMPLES[method],
        derandomize=DERANDOMIZE,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )
    @given(case=strategy)
    def one(case: Any) -> None:
        response = case.call(base_url=live.url, timeout=60)
        seen.append(response.status_code)
        check_answer(case, response)

    one()
    assert seen
    if method == "POST" and mode == GenerationMode.POSITIVE:  # the fuzzer got past validation, to the engine
        assert 200 in seen, seen


def test_healthy_after_fuzzing(live, service) -> None:
    """Runs after the fuzz tests (file order): nothing left behind, and the server still serves."""
    assert httpx.get(f"{live.url}/health").status_code == 200
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None, r.text
    deadline = time.monotonic() + 2.0
    while (service.stats().running or service.stats().waiting) and time.monotonic() < deadline:
        time.sleep(0.02)
    s = service.stats()
    assert s.running == 0 and s.waiting == 0 and s.pages_used == 0, s
