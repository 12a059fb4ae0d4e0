"""The real app over real HTTP (uvicorn on a free port) with the OpenAI SDK and raw requests."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from myserve.frontend.app import create_app

MODEL = "smol"
KEY = "sk-test-key"
QUESTION = "What is the capital of France? Answer with one word."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """uvicorn serving an app in a background thread."""

    def __init__(self, app):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # Keep-alive past a batch of requests: the tests' clients pool connections between batches
        # with no retries, and a server closing an idle connection just as the client reuses it
        # is a race every HTTP/1.1 client retries (the OpenAI SDK's default max_retries does).
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", timeout_keep_alive=120)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


HERMES_TEMPLATE = (Path(__file__).parents[1] / "config" / "templates" / "hermes-tools.jinja").read_text()
"""The chat template with tools that the tool-calling tests serve (Hermes ``<tool_call>`` format)."""


def tools_server(service, served_model_name: str) -> LiveServer:
    """A live app over ``service`` with the Hermes tools template, parser and ``tool_choice: auto``."""
    app = create_app(
        service,
        served_model_name=served_model_name,
        chat_template=HERMES_TEMPLATE,
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
    )
    return LiveServer(app)


@pytest.fixture(scope="module", params=["in_process", "core_process"])
def service(request):
    """Every test here runs against the engine in this process and against a core process."""
    return request.getfixturevalue("smol_service" if request.param == "in_process" else "smol_client")


@pytest.fixture(scope="module")
def live(service):
    server = LiveServer(create_app(service, served_model_name=MODEL, api_key=KEY, max_body_bytes=64 * 1024))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY, max_retries=0)


def chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}], **kw)


def test_sdk_chat_paris_streaming_and_not(client) -> None:
    full = chat(client, temperature=0, max_tokens=10)
    text = full.choices[0].message.content
    assert "Paris" in text
    assert full.id.startswith("chatcmpl-") and full.model == MODEL and full.system_fingerprint
    assert full.usage.prompt_tokens > 10 and full.usage.completion_tokens >= 1
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(chat(client, temperature=0, max_tokens=10, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_sdk_seeded_sampling_streamed_equals_not_streamed(client) -> None:
    kw = dict(temperature=0.9, top_p=0.95, seed=17, max_tokens=20)
    full = chat(client, **kw).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, stream=True, **kw) if c.choices)
    assert streamed == full


def test_async_sdk_and_completions_logprobs(live) -> None:
    async def go():
        client = openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key=KEY, max_retries=0)
        out = await client.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0, logprobs=3
        )
        chat_out = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=10,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
        )
        await client.close()
        return out, chat_out

    out, chat_out = asyncio.run(go())
    choice = out.choices[0]
    assert out.id.startswith("cmpl-") and choice.text
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == choice.text and all(len(t) == 3 for t in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)
    assert "Paris" in (chat_out.choices[0].message.content or "")
    content = chat_out.choices[0].logprobs.content
    assert len(content) == chat_out.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and bytes(c.bytes).decode("utf-8", "replace") == c.token for c in content)


def test_sixteen_concurrent_streams_are_batched(live, service) -> None:
    async def one(client, i):
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Count from {i} to {i + 5}."}],
            max_tokens=24,
            temperature=0,
            stream=True,
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def go():
        client = openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key=KEY, max_retries=0)
        texts = await asyncio.gather(*(one(client, i) for i in range(16)))
        await client.close()
        return texts

    before = service.stats()
    texts = asyncio.run(go())
    after = service.stats()
    assert len(texts) == 16 and all(texts)
    # Batched: on average each engine step of this test produced several tokens (one at a time
    # would be ~1 token per step).
    tokens_per_step = (after.generated_tokens - before.generated_tokens) / (after.steps - before.steps)
    assert tokens_per_step >= 4, tokens_per_step


def test_disconnect_mid_stream_frees_everything(live, service) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {KEY}"}) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            data: list[str] = []
            for line in lines:
                if line.startswith("data:"):
                    data.append(line)
                if len(data) == 3:
                    break
    deadline = time.monotonic() + 10.0  # freed within a step or two; 1 s was missed beside another worker
    while time.monotonic() < deadline:
        s = service.stats()
        if s.running == 0 and s.pages_used == 0:
            break
        time.sleep(0.02)
    s = service.stats()
    assert len(data) == 3 and s.running == 0 and s.waiting == 0 and s.pages_used == 0


def _chat_body(**extra):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}


BAD = [
    # (description, path, body or raw, headers override, status, type, param, code)
    ("temperature too high", _chat_body(temperature=3), 400, "temperature", "invalid_value"),
    ("temperature negative", _chat_body(temperature=-1), 400, "temperature", "invalid_value"),
    ("top_p zero", _chat_body(top_p=0), 400, "top_p", "invalid_value"),
    ("top_p above one", _chat_body(top_p=1.5), 400, "top_p", "invalid_value"),
    ("n zero", _chat_body(n=0), 400, "n", "invalid_value"),
    ("n too large", _chat_body(n=100), 400, "n", "invalid_value"),
    ("max_tokens zero", _chat_body(max_tokens=0), 400, "max_tokens", "invalid_value"),
    ("max_tokens wrong type", _chat_body(max_tokens="ten"), 400, "max_tokens", "invalid_value"),
    ("presence penalty out of range", _chat_body(presence_penalty=5), 400, "presence_penalty", "invalid_value"),
    ("frequency penalty out of range", _chat_body(frequency_penalty=-3), 400, "frequency_penalty", "invalid_value"),
    ("repetition penalty zero", _chat_body(repetition_penalty=0), 400, "repetition_penalty", "invalid_value"),
    ("top_logprobs too many", _chat_body(logprobs=True, top_logprobs=25), 400, "top_logprobs", "invalid_value"),
    ("top_logprobs without logprobs", _chat_body(top_logprobs=2), 400, "top_logprobs", "invalid_value"),
    ("logit_bias out of range", _chat_body(logit_bias={"5": 200}), 400, "logit_bias", "invalid_value"),
    ("logit_bias bad token", _chat_body(logit_bias={"99999999": 1}), 400, "logit_bias", "invalid_value"),
    ("logit_bias key not an id", _chat_body(logit_bias={"abc": 1}), 400, "logit_bias", "invalid_value"),
    ("empty messages", {"model": MODEL, "messages": []}, 400, "messages", "invalid_value"),
    (
        "bad role",
        {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages.0.role",
        "invalid_value",
    ),
    ("messages wrong type", {"model": MODEL, "messages": "hello"}, 400, "messages", "invalid_value"),
    ("missing model", {"messages": [{"role": "user", "content": "x"}]}, 400, "model", "invalid_value"),
    ("wrong model", _chat_body(model="gpt-9"), 404, "model", "model_not_found"),
    (
        "tools with auto choice and no parser",
        _chat_body(tools=[{"type": "function", "function": {"name": "f"}}]),
        400,
        "tool_choice",
        "invalid_value",
    ),
    (
        "unknown response format",
        _chat_body(response_format={"type": "xml"}),
        400,
        "response_format.type",
        "invalid_value",
    ),
    ("tool_choice without tools", _chat_body(tool_choice="required"), 400, "tool_choice", "invalid_value"),
    (
        "prompt too long",
        _chat_body(messages=[{"role": "user", "content": "word " * 600}]),
        400,
        "messages",
        "context_length_exceeded",
    ),
    ("max_tokens beyond context", _chat_body(max_tokens=600), 400, "messages", "context_length_exceeded"),
    ("min_tokens above max_tokens", _chat_body(max_tokens=2, min_tokens=5), 400, "min_tokens", "invalid_value"),
    ("empty stop string", _chat_body(stop=[""]), 400, "stop", "invalid_value"),
    ("stop_token_ids out of vocab", _chat_body(stop_token_ids=[10**9]), 400, "stop_token_ids", "invalid_value"),
]

BAD_COMPLETIONS = [
    ("empty prompt list", {"model": MODEL, "prompt": []}, 400, "prompt", "invalid_value"),
    ("prompt token out of vocab", {"model": MODEL, "prompt": [1, 2, 10**9]}, 400, "prompt", "invalid_value"),
    ("prompt wrong type", {"model": MODEL, "prompt": {"a": 1}}, 400, "prompt", "invalid_value"),
    ("logprobs too many", {"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs", "invalid_value"),
    ("empty token prompt", {"model": MODEL, "prompt": [[]]}, 400, "prompt", "invalid_value"),
]


@pytest.mark.parametrize(("what", "body", "status", "param", "code"), BAD, ids=[b[0] for b in BAD])
def test_bad_chat_requests(live, what, body, status, param, code) -> None:
    r = httpx.post(f"{live.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == code, err
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert err["message"]


@pytest.mark.parametrize(
    ("what", "body", "status", "param", "code"), BAD_COMPLETIONS, ids=[b[0] for b in BAD_COMPLETIONS]
)
def test_bad_completion_requests(live, what, body, status, param, code) -> None:
    r = httpx.post(f"{live.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == code, err


def test_auth_body_size_and_malformed_json(live) -> None:
    url = f"{live.url}/v1/chat/completions"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(url, json=_chat_body(), headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(
        url,
        content=b"{" + b" " * (70 * 1024) + b"}",
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(
        url, content=b"{not json", headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{live.url}/health").status_code == 200
    models = httpx.get(f"{live.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert models["data"][0]["id"] == MODEL


def test_unknown_fields_ignored_and_tokenize_roundtrip(live) -> None:
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{live.url}/v1/chat/completions", json=_chat_body(max_tokens=2, some_future_field=1), headers=h)
    assert r.status_code == 200
    tok = httpx.post(f"{live.url}/tokenize", json={"prompt": "Hello world"}, headers=h).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    text = httpx.post(f"{live.url}/detokenize", json={"tokens": tok["tokens"]}, headers=h).json()["prompt"]
    assert text == "Hello world"
    metrics = httpx.get(f"{live.url}/metrics").text
    assert "myserve_requests_total" in metrics and "myserve_kv_pages_used" in metrics
    assert f'myserve_engine_host_seconds{{model_name="{MODEL}",phase="postprocess"}}' in metrics
    assert f'myserve_engine_step_gap_seconds{{model_name="{MODEL}"}}' in metrics
    assert "myserve_frontend_seconds_total" in metrics and "myserve_compile_cache_loads" in metrics
    assert json.loads(json.dumps(tok))  # plain JSON


def test_full_queue_answers_429_with_retry_after(make_service) -> None:
    svc = make_service("engine.max_num_seqs=1", "engine.max_waiting=2")
    server = LiveServer(create_app(svc, served_model_name="tiny"))
    try:

        async def one(client: httpx.AsyncClient):
            return await client.post(
                "/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 40, "temperature": 0}
            )

        async def go():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                return await asyncio.gather(*(one(client) for _ in range(10)))

        responses = asyncio.run(go())
        codes = [r.status_code for r in responses]
        assert 429 in codes and 200 in codes, codes
        for r in responses:
            if r.status_code == 429:
                assert r.headers["Retry-After"] and r.json()["error"]["type"] == "rate_limit_error"
            else:
                assert r.json()["usage"]["completion_tokens"] == 40
        assert svc.stats().pages_used == 0
    finally:
        server.stop()


def test_echo_with_logprobs_scores_the_prompt(client, live) -> None:
    prompt = "The capital of France is"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2)
    choice = out.choices[0]
    lp = choice.logprobs
    n_prompt = out.usage.prompt_tokens
    assert choice.text.startswith(prompt) and "".join(lp.tokens) == choice.text
    assert len(lp.tokens) == n_prompt + out.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # lm-eval-harness style loglikelihood: echo, max_tokens 0, logprobs.
    only = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    assert only.choices[0].text == prompt and only.usage.completion_tokens == 0
    assert only.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:n_prompt], abs=1e-4)
    # Streaming: the echoed prompt (with its logprobs) first, then the completion.
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[0].choices[0].text == prompt and chunks[0].choices[0].logprobs.token_logprobs[0] is None


def test_disconnect_without_streaming_aborts(live, service) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=1.5)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and (service.stats().running or service.stats().pages_used):
        time.sleep(0.02)
    s = service.stats()
    assert s.running == 0 and s.pages_used == 0


def test_engine_error_mid_stream_sends_error_event(make_service) -> None:
    svc = make_service("engine.num_pages=64")
    server = LiveServer(create_app(svc, served_model_name="tiny"))
    runner = svc.replicas[0].runner
    real_dispatch, calls = runner.dispatch, []

    def failing_later(planned):
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("injected device failure")
        return real_dispatch(planned)

    runner.dispatch = failing_later  # type: ignore[method-assign]
    try:
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 50, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert r.status_code == 200
        payloads = [json.loads(e) for e in events if e != "[DONE]"]
        assert any("choices" in p for p in payloads)  # the stream had started
        assert "error" in payloads[-1] and "injected device failure" in payloads[-1]["error"]["message"]
        assert "[DONE]" not in events
        assert httpx.get(f"{server.url}/health").status_code == 503  # a dead engine is not healthy
        assert httpx.get(f"{server.url}/docs").status_code == 200
    finally:
        server.stop()


def test_prompt_lists_n_choices_interleaved_and_request_log(live, caplog: pytest.LogCaptureFixture) -> None:
    h = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "prompt": ["The sky is", "Water is"], "n": 2, "max_tokens": 6, "seed": 3}
    with caplog.at_level("INFO", logger="myserve"):
        chunks = []
        with httpx.stream("POST", f"{live.url}/v1/completions", json={**body, "stream": True}, headers=h) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[len("data: ") :]))
        plain = httpx.post(f"{live.url}/v1/completions", json={**body, "prompt": [[504, 3619], [5012]]}, headers=h)
    # Streaming: one id for the response; choices 0..3 (prompt i, choice j -> index 2i+j), each ending once.
    assert len({c["id"] for c in chunks}) == 1
    finished = sorted(ch["index"] for c in chunks for ch in c["choices"] if ch["finish_reason"])
    assert finished == [0, 1, 2, 3]
    texts = {i: "".join(ch["text"] for c in chunks for ch in c["choices"] if ch["index"] == i) for i in range(4)}
    assert all(texts.values())
    # Token-id prompts: same shape of answer, usage counts both prompts and all four choices.
    out = plain.json()
    assert sorted(c["index"] for c in out["choices"]) == [0, 1, 2, 3]
    assert out["usage"]["prompt_tokens"] == 3 and out["usage"]["completion_tokens"] == 4 * 6
    # One structured line per finished request, with its token counts, TTFT and finish reasons.
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request_id=")]
    assert len(lines) >= 2
    assert all(f"completion_tokens={4 * 6}" in line and "ttft_s=" in line and "finish=" in line for line in lines[-2:])
