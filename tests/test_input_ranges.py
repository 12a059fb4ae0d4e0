"""Every integer a client sends is range-checked at the edge: a 400 in OpenAI's envelope naming the
field, on both generation endpoints, streamed or not, against the engine in this process and against
an engine core in its own process (whose wire message holds 64-bit integers only)."""

from __future__ import annotations

import json
import math
import time

import httpx
import pytest

from myserve.frontend.protocol import INT64_MAX, INT64_MIN, MAX_N, CompletionRequest
from myserve.wire.params import InvalidParams, SamplingParams

MODEL = "smol"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def body_for(path: str, **fields) -> dict:
    base = {"model": MODEL, "max_tokens": 2}
    if path == CHAT:
        base["messages"] = [{"role": "user", "content": "hi"}]
    else:
        base["prompt"] = "hi"
    return {**base, **fields}


def assert_refused(response: httpx.Response, param: str | tuple[str, ...]) -> dict:
    assert response.status_code == 400, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == "invalid_request_error" and err["message"], err
    assert err["param"] in ((param,) if isinstance(param, str) else param), err
    return err


def wait_idle(service, within: float = 2.0) -> None:
    """Nothing left running or waiting (a core process reports its counters every few ms)."""
    deadline = time.monotonic() + within
    while (service.stats().running or service.stats().waiting) and time.monotonic() < deadline:
        time.sleep(0.02)
    s = service.stats()
    assert s.running == 0 and s.waiting == 0, s


BOTH = [CHAT, COMPLETIONS]
STREAM = [False, True]

# (field values, the param the error must name); the acceptance cases of the issue first.
CASES = [
    ({"seed": 2**80}, "seed"),
    ({"seed": -(2**70)}, "seed"),
    ({"seed": INT64_MAX + 1}, "seed"),
    ({"seed": INT64_MIN - 1}, "seed"),
    ({"logit_bias": {str(10**12): 1}}, "logit_bias"),
    ({"logit_bias": {str(2**80): 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"n": 10**6}, "n"),
    ({"n": 2**80}, "n"),
    ({"n": MAX_N + 1}, "n"),
    ({"top_k": 2**70}, "top_k"),
    ({"top_k": 2**31}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"min_tokens": 2**70}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"stop_token_ids": [2**70]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 10**30}, "max_tokens"),
]
# max_tokens 2^63-1 fits the wire: the context-length check refuses it, naming the prompt's field.
TOO_LONG = {"max_tokens": INT64_MAX}
CHAT_CASES = [
    (TOO_LONG, "messages"),
    ({"max_completion_tokens": 10**30}, "max_completion_tokens"),
    ({"max_completion_tokens": -5}, "max_completion_tokens"),
    ({"logprobs": True, "top_logprobs": 2**70}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
]
COMPLETION_CASES = [
    (TOO_LONG, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": [1, 2**80]}, "prompt"),
    ({"prompt": [[1, 2], [-1]]}, "prompt"),
    ({"prompt": [[10**9]]}, "prompt"),
    # Refused before echo decodes the prompt (found by test_fuzz_openapi: a 500 OverflowError).
    ({"prompt": [-1], "echo": True}, "prompt"),
    ({"prompt": [[10**9]], "echo": True, "logprobs": 1}, "prompt"),
    ({"logprobs": 2**70}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"best_of": 2**80}, "best_of"),
]
ALL = [(path, *case) for path in BOTH for case in CASES]
ALL += [(CHAT, *case) for case in CHAT_CASES] + [(COMPLETIONS, *case) for case in COMPLETION_CASES]


@pytest.mark.parametrize("stream", STREAM, ids=["plain", "stream"])
@pytest.mark.parametrize(("path", "fields", "param"), ALL, ids=[f"{p[4:]}-{json.dumps(f)}" for p, f, _ in ALL])
def test_out_of_range_integers_are_400_naming_the_field(live, service, path, fields, param, stream) -> None:
    r = httpx.post(f"{live.url}{path}", json=body_for(path, stream=stream, **fields), timeout=60)
    err = assert_refused(r, param)
    if fields is TOO_LONG:
        assert err["code"] == "context_length_exceeded", err
    wait_idle(service)


# Raw JSON: numbers that Python's json reads as infinity, or as integers of any length.
RAW = [
    (b'"temperature": 1e400', "temperature"),
    (b'"temperature": NaN', "temperature"),
    (b'"top_p": -1e400', "top_p"),
    (b'"presence_penalty": 1e400', "presence_penalty"),
    (b'"logit_bias": {"5": 1e400}', "logit_bias"),
    (b'"max_tokens": 1e400', "max_tokens"),
    (b'"seed": 1e400', "seed"),
    (b'"seed": 1e30', "seed"),
    (b'"n": ' + b"9" * 400, "n"),
]


@pytest.mark.parametrize("path", BOTH)
@pytest.mark.parametrize(("raw", "param"), RAW, ids=[r.decode()[:24] for r, _ in RAW])
def test_overflowing_json_numbers_are_400(live, service, path, raw, param) -> None:
    body = json.dumps(body_for(path)).encode()[:-1] + b", " + raw + b"}"
    r = httpx.post(f"{live.url}{path}", content=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert_refused(r, param)
    # An integer longer than Python's int-from-text limit (4300 digits) is refused as unreadable JSON.
    body = json.dumps(body_for(path)).encode()[:-1] + b', "metadata": {"x": ' + b"9" * 5000 + b"}}"
    r = httpx.post(f"{live.url}{path}", content=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    wait_idle(service)


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_token_lists_of_tokenize_and_detokenize(live, service, path) -> None:
    if path == "/detokenize":
        for tokens in ([-1], [10**9], [1, 2**80], [service.vocab_size]):
            assert_refused(httpx.post(f"{live.url}{path}", json={"tokens": tokens}), "tokens")
        ok = httpx.post(f"{live.url}{path}", json={"tokens": [0, service.vocab_size - 1]})
        assert ok.status_code == 200, ok.text
    else:  # /tokenize takes text only: its ids come from the tokenizer
        r = httpx.post(f"{live.url}{path}", json={"prompt": "hello"})
        assert r.status_code == 200 and all(0 <= t < service.vocab_size for t in r.json()["tokens"])


@pytest.mark.parametrize("stream", STREAM, ids=["plain", "stream"])
@pytest.mark.parametrize("path", BOTH)
def test_the_bounds_themselves_are_served(live, service, path, stream) -> None:
    """The extreme values inside every range are accepted, and cross the wire to a core process."""
    vocab = service.vocab_size
    fields = {
        "seed": INT64_MAX,
        "logit_bias": {"0": 1, str(vocab - 1): -1},
        "stop_token_ids": [0, vocab - 1],
        "top_k": 2**31 - 1,
        "n": 2,
        "temperature": 0.5,
    }
    r = httpx.post(f"{live.url}{path}", json=body_for(path, stream=stream, **fields), timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{live.url}{path}", json=body_for(path, seed=INT64_MIN, top_k=-1), timeout=60)
    assert r.status_code == 200, r.text
    if path == COMPLETIONS:
        r = httpx.post(f"{live.url}{path}", json=body_for(path, prompt=[[0, vocab - 1], [5]]), timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    wait_idle(service)


def test_the_schema_ranges_are_the_engines() -> None:
    """The ranges protocol.py states (for the schema and the 400s) are SamplingParams' own."""
    SamplingParams(n=MAX_N)
    with pytest.raises(InvalidParams):
        SamplingParams(n=MAX_N + 1)
    SamplingParams(top_k=-1)
    with pytest.raises(InvalidParams):
        SamplingParams(top_k=-2)
    properties = CompletionRequest.model_json_schema()["properties"]
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p", "repetition_penalty"):
        bounds = next(s for s in properties[name]["anyOf"] if s.get("type") == "number")
        high = bounds["maximum"]
        SamplingParams(**{name: high})
        with pytest.raises(InvalidParams):
            SamplingParams(**{name: math.nextafter(high, math.inf)})
        if "minimum" in bounds:
            SamplingParams(**{name: bounds["minimum"]})
            with pytest.raises(InvalidParams):
                SamplingParams(**{name: math.nextafter(bounds["minimum"], -math.inf)})
        else:
            SamplingParams(**{name: math.nextafter(bounds["exclusiveMinimum"], math.inf)})
            with pytest.raises(InvalidParams):
                SamplingParams(**{name: bounds["exclusiveMinimum"]})


def test_the_engine_itself_refuses_a_top_k_its_sampling_rows_cannot_hold() -> None:
    # A Python caller of the engine (no HTTP in front) gets the same bound as the edge.
    from myserve.wire.params import InvalidParams, SamplingParams

    SamplingParams(top_k=2**31 - 1)
    with pytest.raises(InvalidParams) as refused:
        SamplingParams(top_k=2**31)
    assert refused.value.param == "top_k"
