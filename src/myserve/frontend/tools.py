"""What a chat request's ``tools`` and ``tool_choice`` mean for its prompt, its grammar and the
parsing of its output.

- ``none`` (the default without tools): the tools are left out of the prompt and nothing is parsed
  as a call.
- ``auto`` (the default with tools): the tools go to the chat template and the server's tool-call
  parser (``--tool-call-parser``, enabled by ``--enable-auto-tool-choice``, as in vLLM) reads calls
  out of the text. Without it, ``auto`` is a 400.
- ``required``: a grammar makes the output a JSON list of ``{"name", "arguments"}`` objects, each one
  of the tools with arguments matching its parameter schema (one object if ``parallel_tool_calls``
  is false).
- a named function: a grammar makes the output that function's arguments.

Forced calls need no parser flag: their format is the grammar's, not the model's.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from myserve.frontend.errors import APIError
from myserve.frontend.protocol import ChatCompletionRequest, ChatMessage, ImagePart, NamedToolChoice
from myserve.frontend.tool_parsers import NamedCallParser, RequiredCallsParser, ToolParser
from myserve.grammar import GrammarSpec

_ANY_OBJECT = {"type": "object"}


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """How one request's tools are served."""

    template_tools: list[dict[str, Any]] | None = None
    """The tools as the chat template's ``tools`` variable (None: left out)."""
    grammar: GrammarSpec | None = None
    """The constraint forcing a call (``required`` or a named function)."""
    parser: Callable[[], ToolParser] | None = None
    """A fresh parser for each choice's output (None: the output is content)."""
    keeps_special_tokens: bool = False
    """The parser's markers are special tokens: the output is detokenized with them."""


def plan_tools(req: ChatCompletionRequest, auto_parser: type[ToolParser] | None) -> ToolPlan:
    """The plan for ``req``; ``auto_parser`` is the server's parser when auto tool choice is enabled."""
    tools = req.tools or []
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if not tools:
        if choice != "none":
            raise APIError(400, "tool_choice requires tools", param="tool_choice", code="invalid_value")
        return ToolPlan()
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tool function names must be unique", param="tools", code="invalid_value")
    if choice == "none":
        return ToolPlan()
    template_tools = [t.model_dump(exclude_none=True) for t in tools]
    if choice == "auto":
        if auto_parser is None:
            raise APIError(
                400,
                '"auto" tool choice requires the server to run with --enable-auto-tool-choice and '
                "--tool-call-parser; use tool_choice required or a named function",
                param="tool_choice",
                code="invalid_value",
            )
        return ToolPlan(template_tools, None, auto_parser, auto_parser.keeps_special_tokens)
    if isinstance(choice, NamedToolChoice):
        named = next((t for t in tools if t.function.name == choice.function.name), None)
        if named is None:
            raise APIError(
                400, f"tool_choice names {choice.function.name!r}, which is not in tools", param="tool_choice"
            )
        fn = named.function
        grammar = GrammarSpec("json_schema", json.dumps(fn.parameters or _ANY_OBJECT), lenient=not fn.strict)
        return ToolPlan(template_tools, grammar, lambda: NamedCallParser(fn.name))
    return ToolPlan(template_tools, _required_grammar(req), RequiredCallsParser)


def _required_grammar(req: ChatCompletionRequest) -> GrammarSpec:
    """A JSON list of calls, each one of the tools with arguments matching its parameters."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "arguments": t.function.parameters or _ANY_OBJECT},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in req.tools or []
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not req.parallel_tool_calls:
        schema["maxItems"] = 1
    strict = all(t.function.strict for t in req.tools or [])
    return GrammarSpec("json_schema", json.dumps(schema), lenient=not strict)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates take them: text content, an assistant's ``tool_calls`` with their
    arguments as objects (what HF templates expect), a tool message's ``tool_call_id``."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": _template_content(m)}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments_object(c.function.arguments)},
                }
                for c in m.tool_calls
            ]
        out.append(d)
    return out


def _template_content(m: ChatMessage) -> str | list[dict[str, str]]:
    """A message's content as templates take it: its text, or, when it holds images, its parts in
    order (``{"type": "image"}`` where the template writes the model's image placeholder)."""
    if not isinstance(m.content, list) or not any(isinstance(p, ImagePart) for p in m.content):
        return m.text()
    return [{"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": p.text} for p in m.content]


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # the template gets what the client sent
