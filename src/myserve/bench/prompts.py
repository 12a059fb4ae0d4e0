"""Prompt sources for the load generator: built-in varied prompts, or a JSONL file.

A JSONL file holds one JSON object per line with either ``prompt`` (a string, or a list of token
ids for the completions endpoint) or ``messages`` (a chat message list, chat endpoint only). A
``prompt`` string sent to the chat endpoint becomes one user message. Blank lines are skipped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENDPOINTS = ("chat", "completions")

_SHORT = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish, German and Italian.",
]

_MEDIUM = [
    "Explain how a refrigerator keeps food cold. Cover the refrigerant cycle, the role of the "
    "compressor and the condenser coils, and why the back of the appliance feels warm.",
    "Write a short story, about two paragraphs long, about a lighthouse keeper who finds a message "
    "in a bottle that seems to have been written by her grandmother decades ago.",
    "Give me a one-week beginner running plan. For each day say the distance or duration, the pace "
    "to aim for, and one tip about stretching, hydration or sleep.",
    "Compare arrays and linked lists. Discuss memory layout, the cost of random access, insertion "
    "and deletion in the middle, and cache behaviour, and say when you would choose each.",
]

_LONG_CONTEXT = (
    "The town of Westmere sits where two rivers meet, and for most of its history the rivers decided "
    "its fortunes. In the early years the settlers built mills along the faster of the two streams, "
    "using the current to grind grain brought in from the surrounding farms. The mills drew traders, "
    "the traders drew inns and blacksmiths, and within a generation the crossing had become a market "
    "town with a weekly fair. Floods were a constant worry: the lower streets were inundated every few "
    "springs, and the town council spent decades arguing over who should pay for an embankment. When "
    "the railway arrived, the station was built on the higher ground to the north, and the centre of "
    "gravity slowly shifted away from the water. The mills closed one by one as steam and later "
    "electricity made the current unnecessary, and several of the old buildings were converted into "
    "warehouses, then workshops, and finally apartments. Today the riverside is a park with a walking "
    "path that follows the old mill race, and the embankment the council argued about for so long was "
    "finally completed after a particularly severe flood damaged the library and the school. Residents "
    "still hold the weekly fair, although it now sells more crafts and coffee than grain, and a small "
    "museum in the last surviving mill displays the original grinding stones, ledgers from the trading "
    "houses, and photographs of the great flood."
)

_LONG = [
    f"Read the following passage and summarize it in three sentences.\n\n{_LONG_CONTEXT}",
    f"{_LONG_CONTEXT}\n\nBased on the passage above, list every change in how the town used its rivers, "
    "in chronological order, with one sentence on the cause of each change.",
    "You are reviewing a pull request. The author changed a web service so that every request handler "
    "opens its own database connection instead of borrowing one from a shared pool. They argue that this "
    "removes a class of bugs where a handler forgot to return its connection, and that the database can "
    "handle the extra connections. The service handles about two thousand requests per second at peak, "
    "each request runs two or three short queries, and the database is configured with a limit of five "
    "hundred connections. Write a careful review: say whether you would approve it, explain the "
    "performance and reliability consequences under peak load, and propose an alternative that keeps the "
    "benefit the author wants without the costs you identified.",
    "Explain what the following Python function does, point out any bugs, and rewrite it to be clearer "
    "and faster. Keep the same behaviour for valid inputs.\n\n"
    "def merge(intervals):\n"
    "    result = []\n"
    "    for start, end in sorted(intervals):\n"
    "        if result and start <= result[-1][1]:\n"
    "            result[-1] = (result[-1][0], max(result[-1][1], end))\n"
    "        else:\n"
    "            result.append((start, end))\n"
    "    total = 0\n"
    "    for start, end in result:\n"
    "        total = total + (end - start)\n"
    "    return result, total\n\n"
    "Then write three unit tests for it, including one with touching intervals and one with an empty list.",
]

# Interleaved so that any prefix of the list (a small --num-prompts) mixes short, medium and long.
BUILTIN_PROMPTS: tuple[str, ...] = tuple(p for group in zip(_SHORT, _MEDIUM, _LONG, strict=True) for p in group)


class DatasetError(ValueError):
    """A prompt file that cannot be read or does not fit the endpoint."""


@dataclass(frozen=True)
class Prompt:
    """One request's input: a completion prompt (text or token ids) or a chat message list."""

    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None

    def payload(self, endpoint: str) -> dict[str, Any]:
        """The ``prompt`` or ``messages`` part of a request body for ``endpoint``."""
        if endpoint == "chat":
            if self.messages is not None:
                return {"messages": self.messages}
            if isinstance(self.prompt, str):
                return {"messages": [{"role": "user", "content": self.prompt}]}
            raise DatasetError("the chat endpoint needs messages or a text prompt, not token ids")
        if self.prompt is None:
            raise DatasetError("the completions endpoint needs a prompt, not messages")
        return {"prompt": self.prompt}


def builtin_prompts(n: int) -> list[Prompt]:
    """``n`` prompts cycling through ``BUILTIN_PROMPTS``.

    Repeats get a distinct leading tag so a server's prefix cache cannot serve them whole, which
    would make later requests look faster than first-time traffic.
    """
    out = []
    for i in range(n):
        text = BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)]
        out.append(Prompt(prompt=text if i < len(BUILTIN_PROMPTS) else f"[{i}] {text}"))
    return out


def read_jsonl(path: str | Path) -> list[Prompt]:
    """Every prompt in a JSONL file, validated; errors name the line."""
    prompts = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise DatasetError(f"{path}: {e.strerror or e}") from e
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{where}: not JSON ({e.msg})") from e
        if not isinstance(obj, dict):
            raise DatasetError(f"{where}: expected a JSON object")
        prompts.append(_prompt_from(obj, where))
    if not prompts:
        raise DatasetError(f"{path}: no prompts")
    return prompts


def _prompt_from(obj: dict[str, Any], where: str) -> Prompt:
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if messages is not None:
        if not (isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)):
            raise DatasetError(f"{where}: messages must be a non-empty list of objects")
        return Prompt(prompt=prompt if isinstance(prompt, str) else None, messages=messages)
    if isinstance(prompt, str):
        return Prompt(prompt=prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return Prompt(prompt=prompt)
    raise DatasetError(f"{where}: needs 'prompt' (a string or a list of token ids) or 'messages'")


def load_prompts(dataset: str, n: int, endpoint: str) -> list[Prompt]:
    """``n`` prompts from ``dataset`` ("builtin" or a JSONL path), cycling if it holds fewer.

    Every prompt is checked against ``endpoint`` here, so a mismatch fails before any request.
    """
    if dataset == "builtin":
        return builtin_prompts(n)
    source = read_jsonl(dataset)
    for i, p in enumerate(source):
        try:
            p.payload(endpoint)
        except DatasetError as e:
            raise DatasetError(f"{dataset}: prompt {i + 1}: {e}") from e
    return [source[i % len(source)] for i in range(n)]
