"""A Responses API answer: the chat choice's deltas (``ChoiceDelta``: reasoning, content, tool
calls, from the same parsers as chat) as output items, one JSON ``response`` object or its typed
stream events.

``OutputItems`` turns deltas (their pieces in the order of the text) into items and the events
that build them: a ``reasoning`` item (its text as one ``reasoning_text`` part), a ``message`` item
(one ``output_text`` part) and a ``function_call`` item per call, in the order the output produced
them. A non-streamed response is the same builder fed the same deltas, with its events dropped, so
streamed and non-streamed outputs agree by construction; the items depend on the order of the
pieces (a new item starts where the kind changes), never on how the text was cut into deltas.

Stream: ``response.created``, ``response.in_progress``; per item ``response.output_item.added``,
(``response.content_part.added``), the deltas (``response.output_text.delta``,
``response.reasoning_text.delta``, ``response.function_call_arguments.delta``), their ``.done``
events, ``response.output_item.done``; then ``response.completed`` (or ``response.incomplete`` when
``max_output_tokens`` cut it short). An engine error or the deadline sends an ``error`` event.

A stored response is the final object (the JSON body, or the ``response.completed`` event's),
handed to ``on_final``; a background one is read by ``detached``, with no client waiting.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

from myserve.frontend.chat_output import ChoiceDelta
from myserve.frontend.errors import APIError
from myserve.frontend.responses import CompletionResponse
from myserve.frontend.sse import sse_event
from myserve.wire.outputs import RequestOutput, Usage


def _new_id(prefix: str) -> str:
    # uuid4 is 122 bits from os.urandom (what ``secrets`` reads): ids cannot be guessed, and a stored
    # response is found by its id alone (so are response ids: ``ResponseContext``).
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """One response's output items, built from its deltas; each step returns its stream events
    (``type`` and fields, without ``sequence_number``)."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        """Every item so far; the last is open until ``close``."""
        self._open: str | None = None  # "reasoning", "message" or "function_call"

    def add(self, delta: ChoiceDelta) -> list[dict[str, Any]]:
        """The events of one delta's pieces, in the order of the text."""
        events: list[dict[str, Any]] = []
        for kind, piece in delta.order:
            if kind in ("reasoning", "content"):
                events += self._text("reasoning" if kind == "reasoning" else "message", piece)
            elif kind == "call":  # a new call: its id and name come first
                events += self.close()
                item = {
                    "id": _new_id("fc"),
                    "type": "function_call",
                    "status": "in_progress",
                    "call_id": piece["id"],
                    "name": piece["name"],
                    "arguments": "",
                }
                events += self._opened(item)
            elif piece and self._open == "function_call":
                self.items[-1]["arguments"] += piece
                events.append({"type": "response.function_call_arguments.delta", **self._where(), "delta": piece})
        return events

    def close(self) -> list[dict[str, Any]]:
        """The events that finish the open item (none if none is open)."""
        kind, self._open = self._open, None
        if kind is None:
            return []
        item = self.items[-1]
        item["status"] = "completed"
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        events: list[dict[str, Any]]
        if kind == "function_call":
            events = [{"type": "response.function_call_arguments.done", **where, "arguments": item["arguments"]}]
        else:
            part = item["content"][0]
            done = "response.output_text.done" if kind == "message" else "response.reasoning_text.done"
            extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
            events = [
                {"type": done, **where, "content_index": 0, "text": part["text"], **extra},
                {"type": "response.content_part.done", **where, "content_index": 0, "part": dict(part)},
            ]
        done_item = {"type": "response.output_item.done", "output_index": where["output_index"], "item": _copy(item)}
        return [*events, done_item]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _opened(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        self._open = item["type"]
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": _copy(item)}]

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        """Text for a reasoning or message item, opening one if another kind of item is open."""
        events: list[dict[str, Any]] = []
        if self._open != kind:
            events += self.close()
            if kind == "message":
                item: dict[str, Any] = {"id": _new_id("msg"), "type": "message", "status": "in_progress"}
                item["role"] = "assistant"
                part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            else:
                item = {"id": _new_id("rs"), "type": "reasoning", "status": "in_progress", "summary": []}
                part = {"type": "reasoning_text", "text": ""}
            events += self._opened({**item, "content": []})
            self.items[-1]["content"].append(part)
            added = {"type": "response.content_part.added", **self._where(), "content_index": 0, "part": dict(part)}
            events.append(added)
        self.items[-1]["content"][0]["text"] += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        more: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        events.append({"type": name, **self._where(), "content_index": 0, "delta": text, **more})
        return events


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """An item as it is now (its content parts copied: they keep growing)."""
    return {**item, "content": [dict(p) for p in item["content"]]} if "content" in item else dict(item)


def usage_json(usage: Usage) -> dict[str, Any]:
    """The Responses API's ``usage``."""
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


class ResponsesAnswer(CompletionResponse):
    """A chat request's outputs answered in the Responses API's shapes (``ResponseContext.kind`` is
    ``"responses"``; one prompt, one choice). ``echo``: the request's fields that the response
    object repeats (``instructions``, ``tools``, ``text``, ``store``...). ``on_final``: given the
    final response object (completed or incomplete) when there is one: what is stored."""

    def __init__(
        self, *args: Any, echo: dict[str, Any], on_final: Callable[[dict[str, Any]], None] | None = None
    ) -> None:
        super().__init__(*args)
        self.echo = echo
        self.on_final = on_final
        self.items = OutputItems()
        self._finish: str | None = None
        self._sequence = 0
        self._settled = False  # counted and its streams closed (``_finished``)

    def _choice_delta(self, out: RequestOutput) -> ChoiceDelta:
        self._finish = out.finish_reason or self._finish
        parser = self._parser(0)
        if parser is None:
            return ChoiceDelta(content=out.text, order=[("content", out.text)] if out.text else [])
        return parser.feed(out.text, final=out.finish_reason is not None)

    def response_object(self, status: str, error: APIError | None = None) -> dict[str, Any]:
        """The response object before or without a final one: ``status`` queued, in_progress,
        cancelled or failed (with ``error``'s code and message); no output, no usage."""
        return self._response(status, None, error)

    def _response(self, status: str, usage: Usage | None, error: APIError | None = None) -> dict[str, Any]:
        """The ``response`` object; ``status`` in_progress, then completed (incomplete when the
        output met ``max_output_tokens``), or one of ``response_object``'s."""
        if status == "completed" and self._finish == "length":
            status = "incomplete"
        final = status in ("completed", "incomplete")
        return {
            "id": self.ctx.request_id,
            "object": "response",
            "created_at": self.ctx.created,
            "status": status,
            "error": {"code": error.code or "server_error", "message": error.message} if error else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.ctx.model,
            "output": [_copy(item) for item in self.items.items] if final else [],
            "usage": usage_json(usage) if usage is not None else None,
            "truncation": "disabled",
            "metadata": {},
            **self.echo,
        }

    def _final(self, usage: Usage) -> dict[str, Any]:
        """The completed (or incomplete) response object, handed to ``on_final``."""
        response = self._response("completed", usage)
        if self.on_final is not None:
            self.on_final(response)
        return response

    # -- no client (background) ---------------------------------------------------------------
    async def detached(self) -> dict[str, Any]:
        """Every output, read with no client to answer: the final response object (``on_final``
        has it too); ``APIError`` at the deadline or for an engine error. Cancelled, it leaves the
        request to ``abandon``."""
        collect = asyncio.ensure_future(self._collect())
        try:
            await collect
        except TimeoutError:
            pass  # ``_final_body`` answers it
        return self._final_body(collect)

    def abandon(self, status: str = "cancelled") -> None:
        """Close the streams (aborting what still runs) and count the request, unless that is done:
        a background response cancelled (its task may never have started) or failed in the front end."""
        if not self._settled:
            self._finished(status)

    def _finished(self, status: str, usage: Usage | None = None) -> None:
        self._settled = True
        super()._finished(status, usage)

    # -- one JSON body ------------------------------------------------------------------------
    def _body(self, outputs: list[tuple[int, RequestOutput]], usage: Usage) -> dict[str, Any]:
        for _, out in outputs:
            if not out.final:
                self.items.add(self._choice_delta(out))
        self.items.close()
        return self._final(usage)

    # -- server-sent events -------------------------------------------------------------------
    def _event(self, payload: dict[str, Any]) -> bytes:
        payload = {"type": payload["type"], "sequence_number": self._sequence, **payload}
        self._sequence += 1
        return sse_event(payload, payload["type"])

    def _opening_events(self) -> list[bytes]:
        return [
            self._event({"type": "response.created", "response": self._response("in_progress", None)}),
            self._event({"type": "response.in_progress", "response": self._response("in_progress", None)}),
        ]

    def _output_events(self, prompt: int, out: RequestOutput) -> list[bytes]:
        events = self.items.add(self._choice_delta(out))
        if out.finish_reason is not None:
            events += self.items.close()
        return [self._event(e) for e in events]

    def _closing_events(self, usage: Usage) -> list[bytes]:
        closing = [self._event(e) for e in self.items.close()]
        response = self._final(usage)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return [*closing, self._event({"type": kind, "response": response})]

    def _error_event(self, error: APIError) -> bytes:
        return self._event({"type": "error", "code": error.code, "message": error.message, "param": error.param})
