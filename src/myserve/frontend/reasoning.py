"""Reasoning parsers (``--reasoning-parser``): a ``<think>…</think>`` block at the start of a chat
choice goes to ``reasoning_content``, the rest to the content (and to the tool parser).

- ``deepseek_r1``: the output is reasoning until ``</think>``, whether or not the model (or the
  prompt) opened it with ``<think>``; an output that never closes it is all reasoning.
- ``qwen3``: reasoning only if the output opens with ``<think>`` (or the prompt ends inside one);
  otherwise all content.

A prompt that already closed the block (Qwen3 with ``enable_thinking: false`` renders an empty
``<think></think>``) starts in the content. Like the tool parsers, the split depends only on the
text so far, never on how it was cut into deltas.

A grammar (``response_format``, or a forced tool call) applies after the reasoning: the engine
leaves the sequence free until its output contains the end marker's tokens
(``SamplingParams.grammar_after``), then constrains it.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from myserve.frontend.tool_parsers import holdback

State = Literal["undecided", "reasoning", "content"]


@dataclasses.dataclass(frozen=True)
class ReasoningFormat:
    """One model family's reasoning markers."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    implicit_start: bool = False
    """Text before the end marker is reasoning even when no start marker opened it."""

    def initial_state(self, prompt_text: str) -> State:
        """Where the output starts, from the rendered prompt's end."""
        tail = prompt_text.rstrip()
        if tail.endswith(self.end):
            return "content"
        if tail.endswith(self.start) or self.implicit_start:
            return "reasoning"
        return "undecided"


FORMATS = {f.name: f for f in (ReasoningFormat("deepseek_r1", implicit_start=True), ReasoningFormat("qwen3"))}
"""``--reasoning-parser`` names."""


class ReasoningParser:
    """One choice's text split into (reasoning, content) pieces."""

    def __init__(self, fmt: ReasoningFormat, state: State):
        self.fmt = fmt
        self.state: State = "content" if state == "content" else "undecided"
        self._otherwise: State = "reasoning" if state == "reasoning" or fmt.implicit_start else "content"
        """Where an output that does not open with the start marker is."""
        self._buf = ""
        self._strip_content = False  # drop the whitespace between the end marker and the content

    def feed(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) that the text so far settles."""
        self._buf += text
        reasoning = ""
        if self.state == "undecided":
            start = self._buf.lstrip()
            if self.fmt.start.startswith(start) and start != self.fmt.start:
                return "", ""  # could still be the start marker
            if start.startswith(self.fmt.start):  # (a model may repeat the prompt's opener)
                self.state, self._buf = "reasoning", start[len(self.fmt.start) :]
            else:
                self.state = self._otherwise
        if self.state == "reasoning":
            i = self._buf.find(self.fmt.end)
            if i < 0:
                keep = holdback(self._buf, self.fmt.end)
                reasoning, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
                return reasoning, ""
            reasoning, self._buf = self._buf[:i], self._buf[i + len(self.fmt.end) :]
            self.state, self._strip_content = "content", True
        if self._strip_content:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return reasoning, ""
            self._strip_content = False
        content, self._buf = self._buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held: an unclosed block's reasoning, or undecided text as content."""
        rest, self._buf = self._buf, ""
        if self.state == "reasoning" or (self.state == "undecided" and self._otherwise == "reasoning"):
            return rest, ""
        return "", "" if self._strip_content else rest
