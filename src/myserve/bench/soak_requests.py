"""The soak benchmark's requests: a random request of each scenario, sent over HTTP and judged
(status, a complete answer with every choice, constrained outputs that match their grammar), with
a client that may hang up before the answer or mid-stream (``bench/soak.py`` runs them)."""

from __future__ import annotations

import contextlib
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from myserve.bench.prompts import BUILTIN_PROMPTS
from myserve.bench.soak_checks import DISCONNECTED, OK, OVERLOADED

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                          "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}}  # fmt: skip
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
          "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
PHONE, DIGITS, CHOICES = r"[0-9]{3}-[0-9]{4}", r"[0-9]{1,40}", ["yes", "no", "maybe"]
WEIGHTS = {"chat": 3, "n>1": 2, "penalties": 2, "logprobs": 2, "json_schema": 2, "regex": 1, "choice": 1,
           "tool": 2, "long": 1, "mixed": 1}  # fmt: skip
"""Scenarios and how often clients pick them (``mixed``: regex + n=2 + penalties + logprobs)."""

Choice = tuple[str | None, str, list[str]]
"""One choice of an answer: (finish reason, text, tool-call arguments)."""


def _each_finished(test: Callable[[str, list[str]], bool]) -> Callable[[list[Choice]], str | None]:
    """A check of each choice that finished naturally (a cut-off one may be an unfinished match)."""

    def check(choices: list[Choice]) -> str | None:
        bad = [(t, a) for f, t, a in choices if f in ("stop", "tool_calls") and not test(t, a)]
        return f"breaks its grammar: {bad[0]!r}" if bad else None

    return check


def _json_obj(text: str, keys: tuple[str, ...]) -> bool:
    with contextlib.suppress(ValueError):
        value = json.loads(text)
        return isinstance(value, dict) and all(k in value for k in keys)
    return False


@dataclass(frozen=True)
class Req:
    scenario: str
    path: str
    body: dict[str, Any]
    check: Callable[[list[Choice]], str | None] | None = None


def build(scenario: str, rng: random.Random, model: str, long_text: str) -> Req:
    """A random request of ``scenario`` (a key of ``WEIGHTS``, or ``burst``): half of them streamed."""
    prompt = rng.choice(BUILTIN_PROMPTS)
    chat: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}]}
    comp: dict[str, Any] = {"prompt": prompt}
    body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(8, 48), "seed": rng.randrange(1 << 30)}
    body["temperature"] = rng.choice([0.0, 0.7, 1.0])
    check = None
    if scenario == "chat":
        body |= chat
    elif scenario == "burst":
        body |= {**chat, "max_tokens": rng.randint(2, 8)}
    elif scenario == "n>1":
        body |= {**comp, "n": rng.randint(2, 3), "temperature": 0.8}
    elif scenario == "penalties":
        body |= rng.choice([chat, comp])
        body |= {"presence_penalty": rng.uniform(0, 1.5), "frequency_penalty": rng.uniform(0, 1.5)}
        body |= {"repetition_penalty": rng.uniform(1.0, 1.3)}
    elif scenario == "logprobs":
        with_chat = {**chat, "logprobs": True, "top_logprobs": rng.randint(0, 5)}
        body |= rng.choice([with_chat, {**comp, "logprobs": rng.randint(0, 5)}])
    elif scenario == "json_schema":
        schema = {"name": "person", "schema": PERSON, "strict": True}
        body |= {"messages": [{"role": "user", "content": "Invent a person."}], "max_tokens": 64}
        body |= {"response_format": {"type": "json_schema", "json_schema": schema}}
        check = _each_finished(lambda t, _: _json_obj(t, ("name", "age")))
    elif scenario == "regex":
        body |= {**comp, "structured_outputs": {"regex": PHONE}}
        check = _each_finished(lambda t, _: re.fullmatch(PHONE, t) is not None)
    elif scenario == "choice":
        body |= {**chat, "structured_outputs": {"choice": CHOICES}}
        check = _each_finished(lambda t, _: t in CHOICES)
    elif scenario == "tool":
        question = f"What is the weather in {rng.choice(['Paris', 'Oslo', 'Lima'])}?"
        body |= {"messages": [{"role": "user", "content": question}], "max_tokens": 64, "tools": [WEATHER]}
        body |= {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
        check = _each_finished(lambda _, a: len(a) == 1 and _json_obj(a[0], ("city", "unit")))
    elif scenario == "long":  # the same prompt each time (prefix-cache hits), or a new one
        note = f"Note {rng.randrange(10**6)}. {long_text}"
        unique: dict[str, Any] = {"messages": [{"role": "user", "content": note}]}
        body |= {**rng.choice([{"prompt": long_text}, unique]), "max_tokens": rng.randint(4, 32)}
    elif scenario == "mixed":
        body |= {**comp, "n": 2, "presence_penalty": 0.5, "repetition_penalty": 1.1, "logprobs": 2}
        body |= {"structured_outputs": {"regex": DIGITS}}
        check = _each_finished(lambda t, _: re.fullmatch(DIGITS, t) is not None)
    else:
        raise ValueError(f"unknown scenario {scenario!r}")
    if rng.random() < 0.5:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return Req(scenario, CHAT if "messages" in body else COMPLETIONS, body, check)


def _choices(payload: dict[str, Any]) -> list[Choice]:
    """The choices of a non-streamed answer."""
    out = []
    for c in sorted(payload["choices"], key=lambda c: c["index"]):
        message = c.get("message") or {}
        args = [tc["function"]["arguments"] for tc in message.get("tool_calls") or ()]
        out.append((c.get("finish_reason"), message.get("content") or c.get("text") or "", args))
    return out


@dataclass
class _StreamedChoices:
    finish: dict[int, str | None] = field(default_factory=dict)
    text: dict[int, str] = field(default_factory=dict)
    args: dict[int, dict[int, str]] = field(default_factory=dict)

    def feed(self, event: dict[str, Any]) -> None:
        for c in event.get("choices") or ():
            i, delta = c["index"], c.get("delta") or {}
            self.text[i] = self.text.get(i, "") + (delta.get("content") or c.get("text") or "")
            for tc in delta.get("tool_calls") or ():
                calls = self.args.setdefault(i, {})
                calls[tc["index"]] = calls.get(tc["index"], "") + ((tc.get("function") or {}).get("arguments") or "")
            self.finish[i] = c.get("finish_reason") or self.finish.get(i)

    def choices(self) -> list[Choice]:
        return [(self.finish.get(i), self.text[i], list(self.args.get(i, {}).values())) for i in sorted(self.text)]


def _judge(req: Req, choices: list[Choice], usage: Any) -> tuple[str, str, int]:
    tokens = usage.get("completion_tokens", 0) if isinstance(usage, dict) else 0
    if len(choices) != req.body.get("n", 1) or any(f is None for f, _, _ in choices):
        return "incomplete", f"choices {[f for f, _, _ in choices]} of n={req.body.get('n', 1)}", tokens
    problem = req.check(choices) if req.check is not None else None
    return ("bad_output", problem, tokens) if problem else (OK, "", tokens)


async def exchange(client: Any, url: str, req: Req, hang_after: int | None) -> tuple[str, str, int]:
    """Send ``req``; (outcome, detail, completion tokens). ``hang_after``: close after that many events."""
    async with client.stream("POST", url + req.path, json=req.body) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode("utf-8", "replace")[:300]
            if r.status_code == 429:
                return OVERLOADED, r.headers.get("retry-after", ""), 0
            return ("5xx" if r.status_code >= 500 else "4xx"), f"{r.status_code} {text}", 0
        if not req.body.get("stream"):
            payload = json.loads(await r.aread())
            return _judge(req, _choices(payload), payload.get("usage"))
        seen, usage, events = _StreamedChoices(), None, 0
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data, events = line[5:].strip(), events + 1
            if hang_after is not None and events >= hang_after:
                return DISCONNECTED, "", 0  # leaving the block closes the connection mid-stream
            if data == "[DONE]":
                return _judge(req, seen.choices(), usage)
            event = json.loads(data)
            if "error" in event:
                return "stream_error", str(event["error"]), 0
            usage = event.get("usage") or usage
            seen.feed(event)
        return "incomplete", "the stream ended before [DONE]", 0
