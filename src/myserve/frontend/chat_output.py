"""One chat choice's generated text as OpenAI message fields: ``reasoning_content``, ``content`` and
``tool_calls``, built as it streams.

The reasoning parser (if any) takes the text first; what it passes as content goes to the tool
parser (if any). ``feed`` returns the delta of one streamed chunk; the non-streamed message is the
same deltas added up (``ChoiceMessage``), so the two agree by construction.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from myserve.frontend.reasoning import ReasoningParser
from myserve.frontend.tool_parsers import ToolParser


def new_call_id() -> str:
    """An OpenAI-style tool call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclasses.dataclass
class ChoiceDelta:
    """What one piece of output adds to a choice."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """OpenAI delta entries: ``{"index", "id", "type", "function": {"name", "arguments"}}`` when a call
    starts, ``{"index", "function": {"arguments"}}`` for more of its arguments."""
    order: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    """The same pieces in the order of the text: ``("reasoning" | "content" | "args", text)`` and
    ``("call", {"id", "name"})`` (the Responses API's output items follow it)."""

    def json(self) -> dict[str, Any]:
        """The chunk's ``delta`` (only the fields this piece has)."""
        delta: dict[str, Any] = {}
        if self.reasoning:
            delta["reasoning_content"] = self.reasoning
        if self.content:
            delta["content"] = self.content
        if self.tool_calls:
            delta["tool_calls"] = self.tool_calls
        return delta


class ChoiceParser:
    """Splits one choice's text deltas into reasoning, content and tool calls."""

    def __init__(
        self, reasoning: ReasoningParser | None, tools: ToolParser | None, *, parallel_tool_calls: bool = True
    ):
        self.reasoning, self.tools, self.parallel = reasoning, tools, parallel_tool_calls
        self.calls: list[dict[str, Any]] = []
        """Complete calls so far: ``{"id", "type", "function": {"name", "arguments"}}``."""
        self._dropping = False  # a second call when parallel_tool_calls is false

    def feed(self, text: str, *, final: bool = False) -> ChoiceDelta:
        """The delta of a piece of output text; ``final``: the output ends with it, so whatever the
        parsers still held is settled too."""
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        if final and self.reasoning is not None:
            more_reasoning, more_content = self.reasoning.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        delta = ChoiceDelta(reasoning=reasoning)
        if reasoning:
            delta.order.append(("reasoning", reasoning))
        if self.tools is None:
            delta.content = content
            if content:
                delta.order.append(("content", content))
            return delta
        events = self.tools.feed(content) if content else []
        if final:
            events += self.tools.finish()
        for kind, piece in events:
            self._apply(delta, kind, piece)
        return delta

    def _apply(self, delta: ChoiceDelta, kind: str, text: str) -> None:
        if kind == "content":
            delta.content += text
            delta.order.append(("content", text))
            return
        if kind == "call":
            if self.calls and not self.parallel:
                self._dropping = True  # one call asked for: the model's further calls are dropped
                return
            call_id = new_call_id()
            self.calls.append({"id": call_id, "type": "function", "function": {"name": text, "arguments": ""}})
            entry = {"index": len(self.calls) - 1, "id": call_id, "type": "function"}
            delta.tool_calls.append({**entry, "function": {"name": text, "arguments": ""}})
            delta.order.append(("call", {"id": call_id, "name": text}))
            return
        if self._dropping:
            return
        index = len(self.calls) - 1
        self.calls[index]["function"]["arguments"] += text
        delta.order.append(("args", text))
        last = delta.tool_calls[-1] if delta.tool_calls else None
        if last is not None and last["index"] == index:
            last["function"]["arguments"] += text
        else:
            delta.tool_calls.append({"index": index, "function": {"arguments": text}})


@dataclasses.dataclass
class ChoiceMessage:
    """A non-streamed choice's message, the sum of its deltas."""

    reasoning: str = ""
    content: str = ""

    def add(self, delta: ChoiceDelta) -> None:
        """Add one delta's text (calls are read from the parser at the end)."""
        self.reasoning += delta.reasoning
        self.content += delta.content

    def json(self, parser: ChoiceParser | None) -> dict[str, Any]:
        """The OpenAI ``message``."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if parser is not None and parser.reasoning is not None:
            message["reasoning_content"] = self.reasoning or None
        if parser is not None and parser.calls:
            message["content"] = self.content or None
            message["tool_calls"] = parser.calls
        return message


def finish_reason(engine_reason: str | None, parser: ChoiceParser | None) -> str | None:
    """``tool_calls`` for an output that ended naturally with calls; the engine's reason otherwise."""
    if engine_reason == "stop" and parser is not None and parser.calls:
        return "tool_calls"
    return engine_reason
