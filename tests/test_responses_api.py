"""``POST /v1/responses`` through the real app over HTTP with the OpenAI SDK (``client.responses.create``
and ``client.responses.stream``), on a tiny random Llama with SmolLM2's vocabulary and tokenizer,
served in this process and by an engine core process, with the Hermes tool template and parser as
the README shows. The model writes gibberish, so the structured checks rely on grammars (a
json_schema ``text.format``, a forced function call), which guarantee valid output; streamed and
non-streamed answers must agree, and a Responses request must answer what the same chat
completions request answers (one path through the engine)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from test_server import LiveServer, tools_server

from myserve.frontend.app import create_app
from myserve.frontend.chat_output import ChoiceParser
from myserve.frontend.reasoning import FORMATS, ReasoningParser
from myserve.frontend.responses_api_output import OutputItems
from myserve.frontend.responses_protocol import ResponsesRequest, chat_messages
from myserve.frontend.tool_parsers import HermesParser
from myserve.testing import (
    NESTED_SCHEMA,
    TINY_ENGINE,
    WEATHER_PARAMS,
    make_tiny_checkpoint,
    start_client,
    start_service,
)

MODEL = "tiny"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": WEATHER_PARAMS,
    "strict": True,
}
PERSON_FORMAT = {"type": "json_schema", "name": "person", "schema": NESTED_SCHEMA, "strict": True}
# ChatML whose generation prompt opens a reasoning block (as DeepSeek-R1's does).
THINKING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n<think>\n"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(make_tiny_checkpoint("llama3", tmp_path_factory.mktemp("vocab") / "llama", vocab_size=49152))


@pytest.fixture(scope="module", params=["in_process", "core_process"])
def service(request, checkpoint: Path):
    """The engine in this process, and in a core process of its own (as ``serve`` runs it)."""
    start = start_service if request.param == "in_process" else start_client
    svc = start(checkpoint, *TINY_ENGINE, "engine.num_pages=256")
    yield svc
    svc.shutdown()


@pytest.fixture(scope="module")
def live(service) -> Iterator[LiveServer]:
    server = tools_server(service, MODEL)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0, timeout=300)


def streamed_events(client: openai.OpenAI, **kw) -> list:
    return list(client.responses.create(model=MODEL, stream=True, **kw))


def check_sequence(events: list) -> None:
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1


def test_text_streamed_equals_not_streamed_and_equals_chat(client) -> None:
    kw = dict(input="Tell me a story.", instructions="Be brief.", max_output_tokens=20, temperature=0)
    full = client.responses.create(model=MODEL, **kw)
    assert full.object == "response" and full.id.startswith("resp_") and full.model == MODEL
    assert [item.type for item in full.output] == ["message"]
    message = full.output[0]
    assert message.role == "assistant" and message.status == "completed" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and full.output_text == message.content[0].text
    assert full.usage.input_tokens > 5 and 1 <= full.usage.output_tokens <= 20
    assert full.usage.total_tokens == full.usage.input_tokens + full.usage.output_tokens
    if full.usage.output_tokens == 20:  # gibberish rarely ends before the limit
        assert full.status == "incomplete" and full.incomplete_details.reason == "max_output_tokens"
    else:
        assert full.status == "completed"
    assert full.instructions == "Be brief." and full.max_output_tokens == 20 and full.store is True

    events = streamed_events(client, **kw)
    check_sequence(events)
    types = [e.type for e in events]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == full.output_text
    assert {(e.output_index, e.content_index) for e in deltas} == {(0, 0)}
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == full.output_text
    last = events[-1]
    assert last.type == ("response.completed" if full.status == "completed" else "response.incomplete")
    assert last.response.output_text == full.output_text
    assert (last.response.usage.input_tokens, last.response.usage.output_tokens) == (
        full.usage.input_tokens,
        full.usage.output_tokens,
    )

    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}],
        max_completion_tokens=20,
        temperature=0,
    )
    assert chat.choices[0].message.content == full.output_text
    assert chat.usage.prompt_tokens == full.usage.input_tokens


def test_seeded_sampling_with_message_items_streams_the_same(client) -> None:
    history = [
        {"role": "user", "content": "Hi"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
        {"role": "developer", "content": [{"type": "input_text", "text": "Answer in French."}]},
        {"role": "user", "content": "How are you?"},
    ]
    kw = dict(input=history, max_output_tokens=24, temperature=1.0, top_p=0.9, extra_body={"seed": 5})
    full = client.responses.create(model=MODEL, **kw)
    with client.responses.stream(model=MODEL, **kw) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert text == full.output_text


def test_json_schema_text_format_validates_streamed_and_not(client) -> None:
    kw = dict(input="Describe a person as JSON.", text={"format": PERSON_FORMAT}, max_output_tokens=200)
    for seed in range(3):
        full = client.responses.create(model=MODEL, temperature=1.0, extra_body={"seed": seed}, **kw)
        assert full.status == "completed", full.output_text
        jsonschema.validate(json.loads(full.output_text), NESTED_SCHEMA)
        assert full.text.format.type == "json_schema"
        with client.responses.stream(model=MODEL, temperature=1.0, extra_body={"seed": seed}, **kw) as stream:
            events = list(stream)
            final = stream.get_final_response()
        check_sequence(events)
        assert events[-1].type == "response.completed"
        assert final.output_text == full.output_text


@pytest.mark.parametrize("tool_choice", [{"type": "function", "name": "get_weather"}, "required"])
def test_forced_function_call_round_trip(client, tool_choice) -> None:
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    kw = dict(input=ask, tools=[WEATHER], tool_choice=tool_choice, max_output_tokens=100, temperature=0)
    kw["parallel_tool_calls"] = False  # required: a list of one call
    full = client.responses.create(model=MODEL, **kw)
    assert full.status == "completed" and [item.type for item in full.output] == ["function_call"]
    call = full.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)
    assert full.tools[0].name == "get_weather" and full.output_text == ""

    with client.responses.stream(model=MODEL, **kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    check_sequence(events)
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert deltas and "".join(deltas) == call.arguments
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == call.arguments
    assert [(o.type, o.name, o.arguments) for o in final.output] == [("function_call", call.name, call.arguments)]

    # The call and its output go back as items; the answer is then text.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"temperature": 21})}
    then = dict(tools=[WEATHER], tool_choice="none", max_output_tokens=30, temperature=0)
    answer = client.responses.create(model=MODEL, input=[*ask, call.model_dump(exclude_none=True), result], **then)
    assert [item.type for item in answer.output] == ["message"] and answer.output_text
    without = client.responses.create(model=MODEL, input=ask, **then)
    assert answer.usage.input_tokens > without.usage.input_tokens + 10  # the call and the result were rendered


@pytest.fixture(scope="module")
def thinking(service) -> Iterator[LiveServer]:
    app = create_app(service, served_model_name=MODEL, chat_template=THINKING, reasoning_parser="deepseek_r1")
    server = LiveServer(app)
    yield server
    server.stop()


def test_reasoning_parser_gives_a_reasoning_item(thinking) -> None:
    client = openai.OpenAI(base_url=f"{thinking.url}/v1", api_key="none", max_retries=0, timeout=300)
    kw = dict(input="Why is the sky blue?", max_output_tokens=16, temperature=0)
    full = client.responses.create(model=MODEL, **kw)
    assert full.output[0].type == "reasoning" and full.output[0].id.startswith("rs_")
    reasoning = full.output[0].content[0].text
    assert reasoning and "</think>" not in reasoning
    events = streamed_events(client, **kw)
    check_sequence(events)
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == reasoning
    assert [o.model_dump(exclude={"id"}) for o in events[-1].response.output] == [
        o.model_dump(exclude={"id"}) for o in full.output
    ]


BAD = [
    ({"previous_response_id": "resp_1"}, 400, "previous_response_id"),  # not stored (test_responses_store)
    ({"conversation": "conv_1"}, 400, "conversation"),
    ({"background": True, "stream": True}, 400, "stream"),
    ({"reasoning": {"effort": "high"}}, 400, "reasoning"),
    ({"input": []}, 400, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, 400, None),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, 400, None),
    ({"tools": [{"type": "web_search"}]}, 400, None),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, 400, "tools.0.name"),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice"),
    ({"text": {"format": {"type": "xml"}}}, 400, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format"),
    (
        {"text": {"format": {"type": "json_schema", "name": "x", "strict": True, "schema": {"uniqueItems": True}}}},
        400,
        "text.format",
    ),
    ({"max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"max_output_tokens": 10**6}, 400, "input"),  # context_length_exceeded, as chat names its messages
    ({"model": "other"}, 404, "model"),
]


@pytest.mark.parametrize(("extra", "status", "param"), BAD)
def test_bad_requests_get_openai_errors(live, extra, status, param) -> None:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, **extra}
    r = httpx.post(f"{live.url}/v1/responses", json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_store_null_means_true_as_on_openai(live) -> None:
    for store, stored in ((False, False), (None, True), (True, True)):
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, "store": store}
        r = httpx.post(f"{live.url}/v1/responses", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["store"] is stored, r.text


def items_of(text: str, cuts: list[int]) -> list[tuple[str, str]]:
    """The output items (kind, text or arguments) of ``text`` cut into deltas at ``cuts``."""
    parser = ChoiceParser(ReasoningParser(FORMATS["deepseek_r1"], "undecided"), HermesParser())
    builder = OutputItems()
    bounds = [0, *cuts, len(text)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        builder.add(parser.feed(text[a:b], final=b == len(text)))
    builder.close()
    return [(i["type"], i["arguments"] if "arguments" in i else i["content"][0]["text"]) for i in builder.items]


def test_output_items_follow_the_text_however_it_is_cut() -> None:
    text = 'Hmm.</think> Sure. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call> Done.'
    whole = items_of(text, [])
    assert whole == [("reasoning", "Hmm."), ("message", "Sure."), ("function_call", '{"a": 1}'), ("message", "Done.")]
    rng = random.Random(0)
    for _ in range(50):
        assert items_of(text, sorted(rng.sample(range(1, len(text)), rng.randint(1, 30)))) == whole


def test_input_items_become_chat_messages() -> None:
    req = ResponsesRequest.model_validate(
        {
            "model": MODEL,
            "instructions": "Be kind.",
            "input": [
                {"role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
                {"role": "user", "content": "Weather?"},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "21"},
            ],
        }
    )
    roles = [(m["role"], m["content"], [c["id"] for c in m.get("tool_calls", [])]) for m in chat_messages(req)]
    assert roles == [
        ("system", "Be kind.", []),
        ("system", "Use tools.", []),
        ("user", "Weather?", []),
        ("assistant", None, ["c1", "c2"]),
        ("tool", "21", []),
    ]
