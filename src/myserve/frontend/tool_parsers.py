"""Tool-call parsers: a chat choice's generated text split into content and function calls, as it
streams.

Each parser is fed the text deltas of one choice and returns events: ``("content", text)``,
``("call", name)`` (a new call; its id is made by the caller) and ``("args", text)`` (a fragment of
the latest call's arguments, a JSON string). A parser's events depend only on the text fed so far,
never on how it was cut into deltas, so a streamed response and a non-streamed one (the same
parser fed everything at once) carry the same content and the same calls. Text a parser cannot read
as a call comes back as content, never as an error.

The formats (``--tool-call-parser``):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, text around
  them (Hermes, Qwen2.5, Qwen3, and ``config/templates/hermes-tools.jinja``).
- ``llama3_json``: the whole output is ``{"name": ..., "parameters": {...}}`` (several joined by
  ``;``), optionally after ``<|python_tag|>`` (Llama 3.1-3.3's JSON tool calling).
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` objects, or (newer
  tokenizers) ``name[ARGS]{...}``, after optional text.

Auto-parsed calls are announced when complete (a call that turns out malformed must become
content, and streamed text cannot be taken back). Calls forced by ``tool_choice`` (a named function,
or ``required``) are generated under a grammar and parsed by ``NamedCallParser`` and
``RequiredCallsParser``: a named call's arguments stream token by token.
"""

from __future__ import annotations

import abc
import json
import re
from typing import Any, ClassVar

Event = tuple[str, str]
"""("content" | "call" | "args", text)."""


def holdback(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that could be the start of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _arguments_json(value: Any) -> str | None:
    """A call's arguments as the JSON string OpenAI sends; None if they are not an object."""
    if isinstance(value, str):  # some models write the arguments as a JSON string
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _call_events(obj: Any, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> list[Event] | None:
    """The events of one decoded ``{"name": ..., "arguments": {...}}`` object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in argument_keys if k in obj), None)
    arguments = "{}" if key is None else _arguments_json(obj[key])
    if arguments is None:
        return None
    return [("call", obj["name"]), ("args", arguments)]


def _decode_all(text: str, separators: str) -> list[Any] | None:
    """Every JSON value in ``text``, separated by whitespace and ``separators``; None if anything
    else is there."""
    decoder, values, pos = json.JSONDecoder(), list[Any](), 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos == len(text):
            return values
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        values.append(value)


class ToolParser(abc.ABC):
    """Base: the events of one choice's text. ``feed`` each delta, then ``finish`` once."""

    name: ClassVar[str] = ""
    keeps_special_tokens: ClassVar[bool] = False
    """The format's markers are special tokens, which must not be skipped when detokenizing."""

    @abc.abstractmethod
    def feed(self, text: str) -> list[Event]:
        """Events that the text so far settles."""

    @abc.abstractmethod
    def finish(self) -> list[Event]:
        """Events of whatever is still held, at the end of the output."""


class _MarkerParser(ToolParser):
    """Content until an opening marker; whitespace just before a call (or after one) is not content."""

    OPEN: ClassVar[str]

    def __init__(self) -> None:
        self._buf = ""
        self._space = ""  # whitespace held before a possible call
        self._in_calls = False
        self._after_call = False

    def _content(self, text: str) -> list[Event]:
        """Emit ``text`` as content, holding its trailing whitespace (it may precede a call)."""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return []
            self._after_call = False
        body = text.rstrip()
        if not body:
            self._space += text
            return []
        events = [("content", self._space + body)]
        self._space = text[len(body) :]
        return events

    def _text_mode(self) -> list[Event]:
        """Consume content up to an opening marker (switching to calls) or up to what might be one."""
        i = self._buf.find(self.OPEN)
        if i < 0:
            keep = holdback(self._buf, self.OPEN)
            events = self._content(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return events
        events = self._content(self._buf[:i])
        self._buf = self._buf[i:]
        self._in_calls = True
        return events

    def _unreadable(self, raw: str) -> list[Event]:
        """Text that looked like a call but is not one: content, with the whitespace before it."""
        events = [("content", self._space + raw)] if self._space + raw else []
        self._space, self._after_call = "", False
        return events

    def _called(self, events: list[Event]) -> list[Event]:
        self._space, self._after_call = "", True
        return events


class HermesParser(_MarkerParser):
    """``<tool_call>{json}</tool_call>`` blocks between text."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while True:
            if not self._in_calls:
                events += self._text_mode()
                if not self._in_calls:
                    return events
            j = self._buf.find(self.CLOSE)
            if j < 0:
                return events
            raw, self._buf = self._buf[: j + len(self.CLOSE)], self._buf[j + len(self.CLOSE) :]
            self._in_calls = False
            events += self._block(raw, raw[len(self.OPEN) : j])

    def _block(self, raw: str, body: str) -> list[Event]:
        try:
            call = _call_events(json.loads(body))
        except ValueError:
            call = None
        return self._unreadable(raw) if call is None else self._called(call)

    def finish(self) -> list[Event]:
        raw, self._buf = self._buf, ""
        if self._in_calls:  # a block the output ended in (its closing tag never came)
            return self._block(raw, raw[len(self.OPEN) :])
        events = self._content(raw)
        return events + ([("content", self._space)] if self._space and not self._after_call else [])


class MistralParser(_MarkerParser):
    """Text, then ``[TOOL_CALLS]`` and the calls until the end."""

    name = "mistral"
    keeps_special_tokens = True
    OPEN = "[TOOL_CALLS]"
    _NAMED = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*(?:\[ARGS\])?\s*(\{.*)", re.DOTALL)

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return [] if self._in_calls else self._text_mode()

    def finish(self) -> list[Event]:
        raw, self._buf = self._buf, ""
        if not self._in_calls:
            events = self._content(raw)
            return events + ([("content", self._space)] if self._space else [])
        calls: list[Event] = []
        for segment in raw.split(self.OPEN)[1:]:
            parsed = self._segment(segment)
            if parsed is None:
                return self._unreadable(raw)
            calls += parsed
        return self._called(calls) if calls else self._unreadable(raw)

    def _segment(self, segment: str) -> list[Event] | None:
        if not segment.strip():
            return []
        if segment.lstrip().startswith("["):  # a JSON list of calls
            values = _decode_all(segment, "")
            if values is None or len(values) != 1 or not isinstance(values[0], list):
                return None
            events: list[Event] = []
            for obj in values[0]:
                call = _call_events(obj)
                if call is None:
                    return None
                events += call
            return events
        match = self._NAMED.fullmatch(segment)  # name[ARGS]{...}
        if match is None:
            return None
        values = _decode_all(match.group(2), "")
        if values is None or len(values) != 1:
            return None
        return _call_events({"name": match.group(1), "arguments": values[0]})


class Llama3JsonParser(ToolParser):
    """The whole output is one or more ``{"name", "parameters"}`` objects (joined by ``;``)."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self._buf = ""
        self._mode = "undecided"  # then "calls" (held to the end) or "text"

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        if self._mode == "undecided":
            start = self._buf.lstrip()
            if not start or (self.TAG.startswith(start) and start != self.TAG):
                return []
            self._mode = "calls" if start.startswith(("{", self.TAG)) else "text"
        if self._mode == "calls":
            return []
        text, self._buf = self._buf, ""
        return [("content", text)] if text else []

    def finish(self) -> list[Event]:
        raw, self._buf = self._buf, ""
        if self._mode != "calls":
            return [("content", raw)] if raw else []
        values = _decode_all(raw.strip().removeprefix(self.TAG), ";")
        events: list[Event] = []
        for obj in values or [None]:
            call = _call_events(obj, ("parameters", "arguments"))
            if call is None:
                return [("content", raw)]
            events += call
        return events


class NamedCallParser(ToolParser):
    """``tool_choice`` names a function: the whole output is its arguments (grammar-enforced)."""

    def __init__(self, function: str):
        self.function = function
        self._started = False

    def _start(self) -> list[Event]:
        if self._started:
            return []
        self._started = True
        return [("call", self.function)]

    def feed(self, text: str) -> list[Event]:
        return self._start() + ([("args", text)] if text else [])

    def finish(self) -> list[Event]:
        return self._start()


class RequiredCallsParser(ToolParser):
    """``tool_choice: required``: the output is a JSON list of ``{"name", "arguments"}`` objects
    (grammar-enforced); each call is announced as its object closes."""

    def __init__(self) -> None:
        self._buf = ""
        self._pos = 0  # where the next list item (or the list) starts
        self._open = False
        self._events: list[Event] = []
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while "}" in text:  # an item can only have closed if a brace came
            self._skip("," if self._open else "")
            if not self._open:
                if self._buf[self._pos : self._pos + 1] != "[":
                    return events
                self._open, self._pos = True, self._pos + 1
                continue
            try:
                obj, end = self._decoder.raw_decode(self._buf, self._pos)
            except ValueError:
                return events
            call = _call_events(obj)
            if call is None:
                return events
            self._pos = end
            events += call
            self._events += call
        return events

    def _skip(self, chars: str) -> None:
        while self._pos < len(self._buf) and (self._buf[self._pos].isspace() or self._buf[self._pos] in chars):
            self._pos += 1

    def finish(self) -> list[Event]:
        self._skip(",")
        rest = self._buf[self._pos :].strip()
        if self._events and rest in ("]", ""):
            return []
        # Not a list of calls (the output was cut short): what was not read as calls is content.
        return [("content", self._buf[self._pos :] if self._events else self._buf)] if self._buf else []


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}
"""``--tool-call-parser`` names."""
