"""Typed results of client calls: frozen dataclasses read from the server's JSON.

Fields are OpenAI's, cut to what callers read; ``raw`` keeps the whole body for anything else
(logprobs, tool calls, system fingerprint).
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Usage:
    """Token counts of a request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def from_json(cls, body: dict[str, Any] | None) -> Usage | None:
        """From OpenAI's ``usage`` object (None stays None)."""
        if not body:
            return None
        prompt, completion = int(body.get("prompt_tokens", 0)), int(body.get("completion_tokens", 0))
        return cls(prompt, completion, int(body.get("total_tokens", prompt + completion)))


@dataclasses.dataclass(frozen=True)
class Choice:
    """One generated answer: a chat message's content, or a completion's text."""

    index: int
    text: str
    finish_reason: str | None
    reasoning: str | None = None
    """A reasoning parser's ``reasoning_content`` (chat only)."""


@dataclasses.dataclass(frozen=True)
class Completion:
    """A whole chat or completions answer."""

    id: str
    model: str
    choices: tuple[Choice, ...]
    usage: Usage | None
    raw: dict[str, Any] = dataclasses.field(repr=False, compare=False)

    @property
    def text(self) -> str:
        """The first choice's text (the whole answer when ``n`` is 1)."""
        return self.choices[0].text if self.choices else ""

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Completion:
        """From a ``chat.completion`` or ``text_completion`` body."""
        choices = [Choice(*_choice_fields(c, "message")) for c in body.get("choices", [])]
        return cls(body.get("id", ""), body.get("model", ""), tuple(choices), Usage.from_json(body.get("usage")), body)


@dataclasses.dataclass(frozen=True)
class ChunkChoice:
    """One choice's piece of a streamed answer."""

    index: int
    text: str
    finish_reason: str | None
    reasoning: str | None = None


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One SSE event of a streamed answer. The last one carries ``usage`` (and no choices) when
    the stream asked for it, which the client does by default."""

    id: str
    model: str
    choices: tuple[ChunkChoice, ...]
    usage: Usage | None
    raw: dict[str, Any] = dataclasses.field(repr=False, compare=False)

    @property
    def text(self) -> str:
        """The text this event adds, over its choices (one when ``n`` is 1)."""
        return "".join(c.text for c in self.choices)

    @property
    def finish_reason(self) -> str | None:
        """The first finish reason in this event, if one of its choices ended."""
        return next((c.finish_reason for c in self.choices if c.finish_reason), None)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Chunk:
        """From a ``chat.completion.chunk`` or streamed ``text_completion`` event."""
        choices = [ChunkChoice(*_choice_fields(c, "delta")) for c in body.get("choices", [])]
        return cls(body.get("id", ""), body.get("model", ""), tuple(choices), Usage.from_json(body.get("usage")), body)


@dataclasses.dataclass(frozen=True)
class Embeddings:
    """The vectors of an embeddings request, in input order."""

    model: str
    vectors: tuple[tuple[float, ...], ...]
    usage: Usage | None
    raw: dict[str, Any] = dataclasses.field(repr=False, compare=False)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Embeddings:
        """From a ``list`` of ``embedding`` objects (floats: the client asks for ``float``)."""
        data = sorted(body.get("data", []), key=lambda d: int(d.get("index", 0)))
        vectors = tuple(tuple(float(x) for x in d["embedding"]) for d in data)
        return cls(body.get("model", ""), vectors, Usage.from_json(body.get("usage")), body)


def _choice_fields(choice: dict[str, Any], part: str) -> tuple[int, str, str | None, str | None]:
    """(index, text, finish reason, reasoning) of one choice of a chat body (its ``message``) or
    chunk (its ``delta``: ``part``), or of a completions one (``text``)."""
    inner = choice.get(part)
    text = (inner.get("content") if inner is not None else choice.get("text")) or ""
    reasoning = inner.get("reasoning_content") if inner is not None else None
    return int(choice.get("index", 0)), text, choice.get("finish_reason"), reasoning
