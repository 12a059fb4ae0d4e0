"""vLLM's (and llama-server's) request fields through the real app over HTTP, most of them sent by
the real OpenAI SDK in ``extra_body`` as vLLM's users send them, on a tiny random Llama with
SmolLM2's tokenizer. The model writes gibberish, so each test derives what to expect from the
model's own greedy output (token ids read back with ``return_tokens_as_token_ids``) or from the
rendered prompt, never from fixed text."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from test_server import LiveServer

from myserve.frontend.app import ServedModel, create_models_app
from myserve.frontend.guard import IGNORED_FIELDS_HEADER
from myserve.frontend.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from myserve.frontend.responses_protocol import ResponsesRequest
from myserve.frontend.routes import lora
from myserve.frontend.vllm_api import ENDPOINTS, FIELDS, markdown_tables
from myserve.testing import NESTED_SCHEMA, TINY_ENGINE, make_tiny_checkpoint, start_service

TEMPLATE = (
    "{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if reasoning_effort %} effort={{ reasoning_effort }}{% endif %}"
)
GREEDY = {"temperature": 0, "ignore_eos": True}
README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    checkpoint = make_tiny_checkpoint("llama3", tmp_path_factory.mktemp("fields"), vocab_size=49152)
    svc = start_service(checkpoint, *TINY_ENGINE, "engine.num_pages=256")
    yield svc
    svc.shutdown()


@pytest.fixture(scope="module")
def live(service):
    """The app as ``serve`` makes it, trusting request chat templates (vLLM's flag)."""
    app = create_models_app([ServedModel(engine=service, names=("tiny",), trust_request_chat_template=True)])
    server = LiveServer(app)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def sdk(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0)


def token_ids(logprobs_tokens: list[str]) -> list[int]:
    """Token ids out of logprobs tokens named ``token_id:<id>``."""
    assert all(t.startswith("token_id:") for t in logprobs_tokens)
    return [int(t.removeprefix("token_id:")) for t in logprobs_tokens]


def greedy_ids(sdk: openai.OpenAI, prompt: str | list[int], n: int) -> list[int]:
    """The model's first ``n`` greedy tokens after ``prompt``."""
    out = sdk.completions.create(
        model="tiny", prompt=prompt, max_tokens=n, logprobs=0, extra_body={**GREEDY, "return_tokens_as_token_ids": True}
    )
    return token_ids(out.choices[0].logprobs.tokens)


def detokenize(url: str, ids: list[int]) -> str:
    return httpx.post(f"{url}/detokenize", json={"tokens": ids}).json()["prompt"]


def tokenize(url: str, text: str) -> list[int]:
    return httpx.post(f"{url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]


def test_tokens_as_token_ids_on_both_endpoints(sdk, live) -> None:
    ids = greedy_ids(sdk, "The weather today", 4)
    plain = sdk.completions.create(
        model="tiny", prompt="The weather today", max_tokens=4, logprobs=0, extra_body=GREEDY
    )
    assert detokenize(live.url, ids) == plain.choices[0].text
    chat = sdk.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        extra_body={**GREEDY, "return_tokens_as_token_ids": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(token_ids([c.token for c in content])) == 3
    assert all(t.token.startswith("token_id:") for c in content for t in c.top_logprobs)
    assert bytes(content[0].bytes).decode() == content[0].token


def test_include_stop_str_in_output(sdk, live) -> None:
    ids = greedy_ids(sdk, [11, 12, 13, 14], 8)
    text = detokenize(live.url, ids)
    stop = next(text[i : i + 2] for i in range(1, len(text) - 1) if text[i : i + 2].strip())
    at = text.index(stop)
    common = {"model": "tiny", "prompt": [11, 12, 13, 14], "max_tokens": 8, "stop": [stop]}
    cut = sdk.completions.create(**common, extra_body=GREEDY)
    kept = sdk.completions.create(**common, extra_body={**GREEDY, "include_stop_str_in_output": True})
    assert cut.choices[0].text == text[:at] and cut.choices[0].finish_reason == "stop"
    assert kept.choices[0].text == text[: at + len(stop)]
    # A stop token id's text is kept too (EOS never is).
    body = {**common, "stop": None, "stop_token_ids": [ids[3]], **GREEDY}
    first = ids.index(ids[3])
    by_id = httpx.post(f"{live.url}/v1/completions", json=body).json()["choices"][0]
    with_id = httpx.post(f"{live.url}/v1/completions", json={**body, "include_stop_str_in_output": True}).json()
    assert by_id["text"] == detokenize(live.url, ids[:first])
    assert with_id["choices"][0]["text"] == detokenize(live.url, ids[: first + 1])


def test_allowed_token_ids_confine_sampling(sdk) -> None:
    allowed = [300, 301, 302, 4000, 4001]
    for temperature in (0, 1.0):
        out = sdk.completions.create(
            model="tiny",
            prompt="Once upon a time",
            max_tokens=6,
            logprobs=0,
            temperature=temperature,
            seed=3,
            extra_body={"allowed_token_ids": allowed, "return_tokens_as_token_ids": True},
        )
        got = token_ids(out.choices[0].logprobs.tokens)
        assert len(got) == 6 and set(got) <= set(allowed)  # EOS is not allowed either: it runs to length
    bad = httpx.post(f"{sdk.base_url}completions", json={"model": "tiny", "prompt": "x", "allowed_token_ids": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "allowed_token_ids"


def test_bad_words_are_never_generated(sdk, live) -> None:
    prompt = [21, 22, 23]
    ids = greedy_ids(sdk, prompt, 6)
    # A generated token that is a word of its own: its text tokenizes back to it alone.
    word_id = next(t for t in ids if tokenize(live.url, detokenize(live.url, [t])) == [t])
    word = detokenize(live.url, [word_id])
    out = sdk.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=6,
        logprobs=0,
        extra_body={**GREEDY, "bad_words": [word], "return_tokens_as_token_ids": True},
    )
    got = token_ids(out.choices[0].logprobs.tokens)
    assert word_id not in got
    assert got[: ids.index(word_id)] == ids[: ids.index(word_id)]  # greedy until the banned token


def test_prompt_logprobs_on_completions_and_chat(sdk, live) -> None:
    prompt = [40, 41, 42, 43, 44, 45]
    echo = sdk.completions.create(model="tiny", prompt=prompt, max_tokens=1, logprobs=3, echo=True, extra_body=GREEDY)
    out = sdk.completions.create(model="tiny", prompt=prompt, max_tokens=1, extra_body={**GREEDY, "prompt_logprobs": 3})
    scored = out.choices[0].model_extra["prompt_logprobs"]
    assert len(scored) == len(prompt) and scored[0] is None
    for pos, entry in enumerate(scored[1:], start=1):
        mine = entry[str(prompt[pos])]
        assert mine["logprob"] == pytest.approx(echo.choices[0].logprobs.token_logprobs[pos], abs=1e-5)
        assert mine["decoded_token"] == detokenize(live.url, [prompt[pos]])
        tops = sorted((e for t, e in entry.items() if t != str(prompt[pos]) or e["rank"] <= 3), key=lambda e: e["rank"])
        assert [e["rank"] for e in tops][:3] == [1, 2, 3]
        better = sum(1 for e in entry.values() if e["logprob"] > mine["logprob"])
        assert mine["rank"] >= better + 1 and (mine["rank"] > 3) == (len(entry) == 4)
    chat = sdk.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    scores = chat.model_extra["prompt_logprobs"]
    assert len(scores) == chat.usage.prompt_tokens and scores[0] is None
    assert all(len(entry) == 1 and next(iter(entry.values()))["rank"] >= 1 for entry in scores[1:])
    streamed = httpx.post(
        f"{live.url}/v1/completions", json={"model": "tiny", "prompt": "x", "stream": True, "prompt_logprobs": 1}
    )
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


def test_truncate_prompt_tokens_keeps_the_end(sdk) -> None:
    prompt = list(range(100, 130))
    cut = sdk.completions.create(
        model="tiny", prompt=prompt, max_tokens=3, extra_body={**GREEDY, "truncate_prompt_tokens": 5}
    )
    tail = sdk.completions.create(model="tiny", prompt=prompt[-5:], max_tokens=3, extra_body=GREEDY)
    assert cut.usage.prompt_tokens == 5 and cut.choices[0].text == tail.choices[0].text
    chat = sdk.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "a " * 40}],
        max_tokens=1,
        extra_body={"truncate_prompt_tokens": 7},
    )
    assert chat.usage.prompt_tokens == 7


def test_continue_final_message_and_echo(sdk, live) -> None:
    messages = [{"role": "user", "content": "Say hello"}, {"role": "assistant", "content": "Hello there"}]
    fields = {"add_generation_prompt": False, "continue_final_message": True}
    rendered = httpx.post(f"{live.url}/tokenize", json={"messages": messages, **fields}).json()["tokens"]
    text = detokenize(live.url, rendered)
    assert text.endswith("Hello there")  # left open: no end of turn, no new assistant turn
    closed = httpx.post(f"{live.url}/tokenize", json={"messages": messages}).json()["tokens"]
    assert not detokenize(live.url, closed).endswith("Hello there")
    out = sdk.chat.completions.create(
        model="tiny", messages=messages, max_tokens=3, extra_body={**GREEDY, **fields, "echo": True}
    )
    assert out.usage.prompt_tokens == len(rendered)
    assert out.choices[0].message.content.startswith("Hello there")
    chunks = list(
        sdk.chat.completions.create(
            model="tiny", messages=messages, max_tokens=3, stream=True, extra_body={**GREEDY, **fields, "echo": True}
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == out.choices[0].message.content
    both = httpx.post(
        f"{live.url}/v1/chat/completions",
        json={"model": "tiny", "messages": messages, "continue_final_message": True},
    )
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    user_last = httpx.post(
        f"{live.url}/v1/chat/completions", json={"model": "tiny", "messages": messages[:1], **fields}
    )
    assert user_last.status_code == 400 and user_last.json()["error"]["param"] == "continue_final_message"


def test_request_chat_template_documents_and_reasoning_effort(sdk, live, service) -> None:
    docs = [{"title": "A", "text": "cats purr"}, {"title": "B", "text": "dogs bark"}]
    messages = [{"role": "user", "content": "Which purrs?"}]
    want = "[A: cats purr][B: dogs bark]<user>Which purrs? effort=low"
    out = sdk.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=1,
        reasoning_effort="low",
        extra_body={"chat_template": TEMPLATE, "documents": docs},
    )
    assert out.usage.prompt_tokens == len(tokenize(live.url, want))
    body = {"messages": messages, "chat_template": TEMPLATE, "documents": docs, "add_generation_prompt": False}
    assert (
        detokenize(live.url, httpx.post(f"{live.url}/tokenize", json=body).json()["tokens"])
        == want[: -len(" effort=low")]
    )
    # A server that does not trust request templates refuses them, naming the field.
    untrusting = LiveServer(create_models_app([ServedModel(engine=service, names=("tiny",))]))
    try:
        refused = httpx.post(
            f"{untrusting.url}/v1/chat/completions",
            json={"model": "tiny", "messages": messages, "chat_template": TEMPLATE},
        )
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
    finally:
        untrusting.stop()


def test_llama_server_grammar_json_schema_and_n_predict(sdk, live) -> None:
    yes_no = sdk.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "yes or no?"}],
        max_tokens=5,
        extra_body={"grammar": 'root ::= "yes" | "no"'},
    )
    assert yes_no.choices[0].message.content in ("yes", "no")
    person = sdk.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "a person"}],
        max_tokens=200,
        extra_body={"json_schema": NESTED_SCHEMA, "temperature": 0},
    )
    jsonschema.validate(json.loads(person.choices[0].message.content), NESTED_SCHEMA)
    n = httpx.post(f"{live.url}/v1/completions", json={"model": "tiny", "prompt": "x", "n_predict": 3, **GREEDY}).json()
    assert n["usage"]["completion_tokens"] == 3
    both = httpx.post(
        f"{live.url}/v1/completions",
        json={"model": "tiny", "prompt": "x", "grammar": 'root ::= "a"', "response_format": {"type": "json_object"}},
    )
    assert both.status_code == 400 and "not several" in both.json()["error"]["message"]


def test_unread_fields_are_logged_and_named_in_a_header(sdk, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="myserve.frontend.generation"):
        raw = sdk.chat.completions.with_raw_response.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=1,
            extra_body={"mirostat": 2, "top_a": 0.1},
        )
    assert raw.headers[IGNORED_FIELDS_HEADER] == "mirostat, top_a"
    assert raw.parse().choices[0].message.content is not None
    assert [r for r in caplog.records if "mirostat" in r.getMessage()], "logged once"
    assert len([r for r in caplog.records if "mirostat" in r.getMessage()]) == 1
    clean = sdk.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1
    )
    assert IGNORED_FIELDS_HEADER not in clean.headers
    # Names no header could carry as they are (control characters, blanks) do not break the answer.
    odd = httpx.post(
        f"{sdk.base_url}chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
              "\r": 1, "": 2, " ": 3, "\x7f": 4, "é": 5, "d": 6},
    )  # fmt: skip
    assert odd.status_code == 200 and odd.headers[IGNORED_FIELDS_HEADER] == "\\r, \\u007f, \\u00e9, d"


REQUEST_CLASSES = {
    "completions": CompletionRequest,
    "chat": ChatCompletionRequest,
    "embeddings": EmbeddingRequest,
    "responses": ResponsesRequest,
}


def test_readme_tables_are_the_modules_and_every_row_holds(service, monkeypatch) -> None:
    assert markdown_tables() in README.read_text(), "README's vLLM tables are stale: paste vllm_api.markdown_tables()"
    for row in FIELDS:
        for name in row.name.split(", "):
            if row.status == "same":
                for endpoint in row.where.split(", "):
                    assert name in REQUEST_CLASSES[endpoint].model_fields, (name, endpoint)
            else:  # refused, or read by nothing (and so named in the header)
                for cls in (CompletionRequest, ChatCompletionRequest):
                    assert name not in cls.model_fields or any(u.field == name for u in cls.UNSUPPORTED), name
    monkeypatch.setenv(lora.ENV, "true")  # the runtime adapter endpoints' opt-in (and sleep mode's, below)
    live = LiveServer(create_models_app([ServedModel(engine=service, names=("tiny",))], sleep_mode=True))
    try:
        for row in ENDPOINTS:
            method, path = row.name.split(" ")
            answer = httpx.request(method, live.url + path.replace("{response_id}", "resp_none"), json={})
            unrouted = answer.status_code in (404, 405) and answer.json()["error"]["message"] in (
                "Not Found",
                "Method Not Allowed",
            )
            assert unrouted == (row.status != "same"), row.name
    finally:
        live.stop()
