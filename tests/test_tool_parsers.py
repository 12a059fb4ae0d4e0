"""Tool-call and reasoning parsers on tables of model outputs, host only (milliseconds).

Every row is parsed three ways: the whole output at once (a non-streamed response), one character
at a time, and in random pieces (streamed responses); all three must give the row's content and
calls, and the streamed deltas must add up to the non-streamed message.
"""

from __future__ import annotations

import json
import random

import pytest

from myserve.frontend.chat_output import ChoiceMessage, ChoiceParser, finish_reason
from myserve.frontend.reasoning import FORMATS, ReasoningParser
from myserve.frontend.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    NamedCallParser,
    RequiredCallsParser,
    ToolParser,
)

W = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
T = {"name": "get_time", "arguments": {"zone": "CET"}}
W_ARGS = json.dumps(W["arguments"])
T_ARGS = json.dumps(T["arguments"])


def hermes(obj: dict) -> str:
    return f"<tool_call>\n{json.dumps(obj)}\n</tool_call>"


def llama(obj: dict) -> str:
    return json.dumps({"name": obj["name"], "parameters": obj["arguments"]})


# (parser factory, output, expected content, expected [(name, arguments)])
TABLE = [
    # hermes
    (HermesParser, "The weather is fine.", "The weather is fine.", []),
    (HermesParser, hermes(W), "", [("get_weather", W_ARGS)]),
    (HermesParser, hermes(W) + "\n" + hermes(T), "", [("get_weather", W_ARGS), ("get_time", T_ARGS)]),
    (HermesParser, "Let me check.\n" + hermes(W), "Let me check.", [("get_weather", W_ARGS)]),
    (HermesParser, "<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    (HermesParser, 'x <tool_call>{"name": "f"', 'x <tool_call>{"name": "f"', []),  # cut short
    (HermesParser, "<tool_call>" + json.dumps(W), "", [("get_weather", W_ARGS)]),  # no closing tag
    (HermesParser, "a < b and <tool_ca", "a < b and <tool_ca", []),
    (HermesParser, "line\n\n", "line\n\n", []),
    (HermesParser, hermes(W) + " done", "done", [("get_weather", W_ARGS)]),
    (HermesParser, '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    # llama3_json
    (Llama3JsonParser, "The weather is fine.", "The weather is fine.", []),
    (Llama3JsonParser, llama(W), "", [("get_weather", W_ARGS)]),
    (Llama3JsonParser, llama(W) + "; " + llama(T), "", [("get_weather", W_ARGS), ("get_time", T_ARGS)]),
    (Llama3JsonParser, "<|python_tag|>" + llama(W), "", [("get_weather", W_ARGS)]),
    (Llama3JsonParser, "Sure: " + llama(W), "Sure: " + llama(W), []),  # text first: not a call
    (Llama3JsonParser, '{"name": "get_weather", "parameters": {"city": ', None, []),  # malformed: all content
    (Llama3JsonParser, '{"answer": 42}', '{"answer": 42}', []),
    # mistral
    (MistralParser, "The weather is fine.", "The weather is fine.", []),
    (MistralParser, "[TOOL_CALLS]" + json.dumps([W]), "", [("get_weather", W_ARGS)]),
    (MistralParser, "[TOOL_CALLS] " + json.dumps([W, T]), "", [("get_weather", W_ARGS), ("get_time", T_ARGS)]),
    (MistralParser, "Checking. [TOOL_CALLS]" + json.dumps([W]), "Checking.", [("get_weather", W_ARGS)]),
    (MistralParser, "[TOOL_CALLS]get_weather[ARGS]" + W_ARGS, "", [("get_weather", W_ARGS)]),
    (
        MistralParser,
        "[TOOL_CALLS]get_weather[ARGS]" + W_ARGS + "[TOOL_CALLS]get_time[ARGS]" + T_ARGS,
        "",
        [("get_weather", W_ARGS), ("get_time", T_ARGS)],
    ),
    (MistralParser, "[TOOL_CALLS][{broken", "[TOOL_CALLS][{broken", []),
    # forced: a named function, and required
    (lambda: NamedCallParser("get_weather"), W_ARGS, "", [("get_weather", W_ARGS)]),
    (RequiredCallsParser, json.dumps([W]), "", [("get_weather", W_ARGS)]),
    (RequiredCallsParser, json.dumps([W, T]), "", [("get_weather", W_ARGS), ("get_time", T_ARGS)]),
    (RequiredCallsParser, '[{"name": "get_weather", "argu', '[{"name": "get_weather", "argu', []),
]


def pieces(text: str, how: str) -> list[str]:
    if how == "whole":
        return [text]
    if how == "chars":
        return list(text)
    rng = random.Random(len(text))
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 7)
        out.append(text[i : i + n])
        i += n
    return out


def run(parser: ChoiceParser, chunks: list[str]) -> tuple[ChoiceMessage, list[dict]]:
    """Feed the chunks as the HTTP layer does; the summed message and the streamed delta JSONs."""
    message, deltas = ChoiceMessage(), []
    for k, chunk in enumerate(chunks):
        delta = parser.feed(chunk, final=k == len(chunks) - 1)
        message.add(delta)
        deltas.append(delta.json())
    return message, deltas


def streamed_calls(deltas: list[dict]) -> list[tuple[str, str]]:
    """Tool calls put together from streamed deltas as the OpenAI SDK does (by index)."""
    calls: dict[int, dict] = {}
    for d in deltas:
        for entry in d.get("tool_calls", []):
            call = calls.setdefault(entry["index"], {"name": None, "arguments": "", "id": None})
            if "id" in entry:
                assert call["id"] is None and call["arguments"] == "", "id and name come first, once"
                call["id"], call["name"] = entry["id"], entry["function"]["name"]
            call["arguments"] += entry["function"].get("arguments", "")
    return [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("how", ["whole", "chars", "random"])
@pytest.mark.parametrize(("make", "output", "content", "calls"), TABLE)
def test_parser_table(make, output: str, content: str | None, calls: list, how: str) -> None:
    parser = ChoiceParser(None, make())
    message, deltas = run(parser, pieces(output, how))
    assert message.content == (output if content is None else content)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in parser.calls] == calls
    assert streamed_calls(deltas) == calls
    assert "".join(d.get("content", "") for d in deltas) == message.content
    body = message.json(parser)
    if calls:
        assert body["content"] == (message.content or None)
        assert all(c["id"].startswith("call_") and len(c["id"]) > 10 for c in body["tool_calls"])
        assert finish_reason("stop", parser) == "tool_calls" and finish_reason("length", parser) == "length"
    else:
        assert "tool_calls" not in body and finish_reason("stop", parser) == "stop"


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    parser = ChoiceParser(None, HermesParser(), parallel_tool_calls=False)
    message, deltas = run(parser, pieces(hermes(W) + hermes(T), "chars"))
    assert streamed_calls(deltas) == [("get_weather", W_ARGS)]
    assert len(parser.calls) == 1


def test_named_call_arguments_stream_token_by_token() -> None:
    parser = ChoiceParser(None, NamedCallParser("get_weather"))
    _, deltas = run(parser, ['{"city": ', '"Paris"', "}"])
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": '}
    assert [d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:]] == ['"Paris"', "}"]


REASONING = [
    # (format, prompt end, output, reasoning, content)
    ("qwen3", "<|im_start|>assistant\n", "<think>\nplan it\n</think>\n\nAnswer.", "\nplan it\n", "Answer."),
    ("qwen3", "<|im_start|>assistant\n", "Answer without thinking.", "", "Answer without thinking."),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "Answer.", "", "Answer."),
    ("qwen3", "<|im_start|>assistant\n", "<think>never closed", "never closed", ""),
    ("qwen3", "<|im_start|>assistant\n", "<thin", "", "<thin"),
    ("deepseek_r1", "<|Assistant|><think>\n", "plan</think>Answer.", "plan", "Answer."),
    ("deepseek_r1", "<|Assistant|>", "plan</think>Answer.", "plan", "Answer."),
    ("deepseek_r1", "<|Assistant|>", "<think>plan</think>Answer.", "plan", "Answer."),
    ("deepseek_r1", "<|Assistant|><think>\n", "all thought", "all thought", ""),
]


@pytest.mark.parametrize("how", ["whole", "chars", "random"])
@pytest.mark.parametrize(("name", "prompt", "output", "reasoning", "content"), REASONING)
def test_reasoning_table(name: str, prompt: str, output: str, reasoning: str, content: str, how: str) -> None:
    fmt = FORMATS[name]
    parser = ChoiceParser(ReasoningParser(fmt, fmt.initial_state(prompt)), None)
    message, _ = run(parser, pieces(output, how))
    assert (message.reasoning, message.content) == (reasoning, content)
    assert message.json(parser)["reasoning_content"] == (reasoning or None)


@pytest.mark.parametrize("how", ["whole", "chars", "random"])
def test_reasoning_then_tool_call(how: str) -> None:
    fmt = FORMATS["qwen3"]
    parser = ChoiceParser(ReasoningParser(fmt, "undecided"), HermesParser())
    message, deltas = run(parser, pieces("<think>weather? call it</think>\n\n" + hermes(W), how))
    assert message.reasoning == "weather? call it" and message.content == ""
    assert streamed_calls(deltas) == [("get_weather", W_ARGS)]


def test_every_parser_is_a_tool_parser() -> None:
    from myserve.frontend.tool_parsers import PARSERS

    assert set(PARSERS) == {"hermes", "llama3_json", "mistral"}
    assert all(issubclass(p, ToolParser) for p in PARSERS.values())
    assert PARSERS["mistral"].keeps_special_tokens and not PARSERS["hermes"].keeps_special_tokens
