"""Tools and structured outputs through the real app over HTTP with the OpenAI SDK, on the bundled
SmolLM2 served as the README shows: ``--chat-template config/templates/hermes-tools.jinja
--enable-auto-tool-choice --tool-call-parser hermes``."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from test_server import HERMES_TEMPLATE, LiveServer, tools_server

from myserve.frontend.app import create_app
from myserve.testing import NESTED_SCHEMA, WEATHER_PARAMS, streamed_and_not

MODEL = "smol-tools"
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER_PARAMS},
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 8}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
PERSON = NESTED_SCHEMA


@pytest.fixture(scope="module", params=["in_process", "core_process"])
def live(request) -> Iterator[LiveServer]:
    """The app over the engine in this process, and over an engine core process (grammars are then
    validated in the front end and enforced in the core)."""
    service = request.getfixturevalue("smol_service" if request.param == "in_process" else "smol_client")
    server = tools_server(service, MODEL)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0)


def chat(client: openai.OpenAI, **kw):
    kw.setdefault("messages", ASK)
    return client.chat.completions.create(model=MODEL, max_tokens=80, **kw)


def streamed(client: openai.OpenAI, **kw) -> tuple[str, list[tuple[str, str, str]], str | None]:
    """A streamed chat put together as an SDK user would: (content, [(id, name, arguments)], finish)."""
    content, calls, finish = "", {}, None
    for chunk in chat(client, stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                if d.id is not None:
                    assert d.index not in calls and d.function.name, "id and name come first, once"
                    calls[d.index] = [d.id, d.function.name, ""]
                calls[d.index][2] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [tuple(c) for _, c in sorted(calls.items())], finish


@pytest.mark.parametrize(
    "tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"], ids=["named", "required"]
)
def test_forced_tool_call_parses_validates_and_streams_the_same(client, tool_choice) -> None:
    full = chat(
        client,
        tools=[WEATHER, TIME] if tool_choice == "required" else [WEATHER],
        tool_choice=tool_choice,
        temperature=0,
    )
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    if tool_choice != "required":
        assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    schema = WEATHER_PARAMS if call.function.name == "get_weather" else TIME["function"]["parameters"]
    jsonschema.validate(args, schema)
    content, calls, finish = streamed(
        client,
        tools=[WEATHER, TIME] if tool_choice == "required" else [WEATHER],
        tool_choice=tool_choice,
        temperature=0,
    )
    assert finish == "tool_calls" and not content
    assert [(n, a) for _, n, a in calls] == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_tool_result_back_with_tool_choice_none_gives_content(client) -> None:
    first = chat(
        client, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})},
    ]
    answer = chat(client, messages=history, tools=[WEATHER], tool_choice="none", temperature=0)
    choice = answer.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_auto_tool_choice_gives_a_well_formed_answer(client) -> None:
    full = chat(client, tools=[WEATHER], temperature=0)
    choice = full.choices[0]
    if choice.message.tool_calls:  # whatever the small model chose, it reads as one of two things
        assert choice.finish_reason == "tool_calls"
        jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), {"type": "object"})
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")
    content, calls, finish = streamed(client, tools=[WEATHER], temperature=0)
    assert (content or None, [(n, a) for _, n, a in calls]) == (
        choice.message.content,
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []],
    )
    assert finish == choice.finish_reason


def test_seeded_json_schema_requests_finish_validate_and_stream_the_same(client, live, request) -> None:
    """Seventeen seeded requests through the engine core process (what ``python -m myserve.serve``
    runs: more than one batch of 16, so one waits and joins running ones); four through the
    in-process engine, whose grammar path is the same (test_structured sends fifty through it on a
    tiny model)."""
    count = 17 if request.node.callspec.params["live"] == "core_process" else 4
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    messages = [{"role": "user", "content": "Describe a person as JSON."}]

    async def one(aclient: openai.AsyncOpenAI, seed: int, stream: bool) -> tuple[str, str | None]:
        kw = dict(model=MODEL, messages=messages, response_format=fmt, temperature=1.0, seed=seed, max_tokens=160)
        if not stream:
            r = await aclient.chat.completions.create(**kw)
            return r.choices[0].message.content, r.choices[0].finish_reason
        text, finish = "", None
        async for chunk in await aclient.chat.completions.create(stream=True, **kw):
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    clients: list[openai.AsyncOpenAI] = []

    def aclient() -> openai.AsyncOpenAI:  # made inside the event loop that uses it
        if not clients:
            clients.append(openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0, timeout=600))
        return clients[0]

    full, parts = streamed_and_not(lambda seed, stream: one(aclient(), seed, stream), count)
    for text, finish in full:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
    assert parts == full


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
        ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, lambda t: len(t) == 6 and t[3] == "-"),
        (
            {"structured_outputs": {"grammar": 'start: "a" ("b" | "c")+'}},
            lambda t: t[0] == "a" and set(t[1:]) <= {"b", "c"},
        ),
        ({"structured_outputs": {"json": PERSON}}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ],
    ids=["json_object", "choice", "regex", "lark", "json"],
)
def test_structured_output_kinds_over_http(live, extra, check) -> None:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 120, "temperature": 0, **extra}
    r = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    assert check(text), text
    completion = httpx.post(
        f"{live.url}/v1/completions",
        json={"model": MODEL, "prompt": "Answer: ", "max_tokens": 120, "temperature": 0, **extra},
        timeout=120,
    )
    assert completion.status_code == 200, completion.text
    assert check(completion.json()["choices"][0]["text"])


def test_json_schema_without_strict_ignores_what_it_cannot_enforce(live) -> None:
    schema = {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2, "uniqueItems": True}
    body = {"model": MODEL, "messages": ASK, "max_tokens": 30, "temperature": 0}
    lenient = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    r = httpx.post(f"{live.url}/v1/chat/completions", json={**body, "response_format": lenient}, timeout=60)
    assert r.status_code == 200 and isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), list)
    strict = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    r = httpx.post(f"{live.url}/v1/chat/completions", json={**body, "response_format": strict}, timeout=60)
    assert r.status_code == 400 and "uniqueItems" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "response_format"


BAD = [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{nope"}}},
        "response_format.json_schema.schema",
    ),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    (
        {"structured_outputs": {"json": {"type": "object"}}, "response_format": {"type": "json_object"}},
        "structured_outputs",
    ),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
            "tool_choice": "required",
        },
        "tools",
    ),
]


@pytest.mark.parametrize(("extra", "param"), BAD)
def test_bad_constraints_and_tools_get_a_400_naming_the_field(live, extra, param) -> None:
    r = httpx.post(f"{live.url}/v1/chat/completions", json={"model": MODEL, "messages": ASK, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_auto_tool_choice_needs_the_parser_flag(smol_service) -> None:
    server = LiveServer(create_app(smol_service, served_model_name=MODEL, chat_template=HERMES_TEMPLATE))
    try:
        body = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "max_tokens": 5}
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
        forced = {**body, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
        r = httpx.post(f"{server.url}/v1/chat/completions", json=forced, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("tool_calls", "length")
    finally:
        server.stop()


# ChatML whose generation prompt opens a reasoning block (as DeepSeek-R1's does), or closes an
# empty one (as Qwen3's does with enable_thinking false).
THINKING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
)


@pytest.fixture(scope="module")
def thinking(smol_service) -> Iterator[LiveServer]:
    app = create_app(smol_service, served_model_name=MODEL, chat_template=THINKING, reasoning_parser="deepseek_r1")
    server = LiveServer(app)
    yield server
    server.stop()


def test_reasoning_parser_splits_and_the_grammar_waits_for_the_block_to_end(thinking) -> None:
    """Inside an open block every token is reasoning (the small model does not close it within 40
    tokens), and a grammar does not apply yet; with the block closed by the prompt, the output is
    content and the grammar applies from its first token."""
    client = openai.OpenAI(base_url=f"{thinking.url}/v1", api_key="none", max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": NESTED_SCHEMA, "strict": True}}
    open_block = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=40, temperature=0, response_format=fmt
    ).choices[0]
    assert open_block.message.reasoning_content and not open_block.message.content
    assert "</think>" not in open_block.message.reasoning_content
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=40, temperature=0, response_format=fmt, stream=True
    ):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    assert (reasoning, content) == (open_block.message.reasoning_content, "")
    closed = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=160,
        temperature=0,
        response_format=fmt,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    ).choices[0]
    assert closed.message.reasoning_content is None and closed.finish_reason == "stop"
    jsonschema.validate(json.loads(closed.message.content), NESTED_SCHEMA)
