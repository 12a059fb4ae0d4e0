"""OpenAI Responses API request schema (``POST /v1/responses``), and its translation into the chat
completions request that the server runs for it.

A Responses request is a chat in other clothes: ``instructions`` become a system message, ``input``
(a string, or message, ``function_call`` and ``function_call_output`` items) becomes the messages,
``text.format`` becomes ``response_format``, the flat function ``tools`` become chat tools, and
``max_output_tokens`` becomes ``max_completion_tokens``. ``chat_request`` makes that
``ChatCompletionRequest``, so the chat template, sampling, grammars, tool-call and reasoning
parsing are the chat route's own (``routes/chat.py::prepare_chat``).

Responses are stored as OpenAI's are (``store`` absent or null means true) while the server keeps
any (``server.responses_store_size`` > 0; else ``store: true`` is a 400): ``previous_response_id``
continues a stored response's conversation, given to ``chat_request`` as ``history`` (chat messages:
what ``input_messages`` and ``conversation_after`` made of that response). ``conversation`` objects
and item references are not supported. Input ``reasoning`` items are dropped (chat templates do not
render past reasoning).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, ValidationError

from myserve.frontend.errors import APIError
from myserve.frontend.protocol import _INT64_END, ChatCompletionRequest, Int64, Unsupported, _given, _Request


class InputText(_Request):
    """A text part of an input message's content (an assistant's earlier ``output_text`` too)."""

    type: Literal["input_text", "output_text"]
    text: str


class InputImage(_Request):
    """An image part of an input message (a vision-language model's): a URL, as chat's ``image_url``."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    """Files are not stored here: refused (send ``image_url``)."""
    detail: Literal["auto", "low", "high"] | None = None


type InputPart = Annotated[InputText | InputImage, Field(discriminator="type")]


class MessageItem(_Request):
    """An input message; ``type`` may be left out (OpenAI's "easy input message")."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputPart]

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, InputText))

    def chat_content(self) -> str | list[dict[str, Any]]:
        """The content as a chat message's: its text, or (with images) its parts as chat's."""
        if isinstance(self.content, str) or not any(isinstance(p, InputImage) for p in self.content):
            return self.text()
        parts: list[dict[str, Any]] = []
        for p in self.content:
            if isinstance(p, InputText):
                parts.append({"type": "text", "text": p.text})
            elif p.image_url is None:
                raise APIError(400, "input_image needs image_url (file ids are not supported)", param="input")
            else:
                parts.append({"type": "image_url", "image_url": {"url": p.image_url}})
        return parts


class FunctionCallItem(_Request):
    """A function call the model made earlier (conversation history)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(_Request):
    """The result of a function call, sent back for the model to read."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]


class ReasoningInputItem(_Request):
    """Reasoning the model returned earlier; accepted and dropped (templates do not render it)."""

    type: Literal["reasoning"]


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningInputItem


class FunctionTool(_Request):
    """A function the model may call (the Responses API's flat shape: no nested ``function``)."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Request):
    """``tool_choice`` naming one function: the model must call it."""

    type: Literal["function"]
    name: str


class TextConfig(_Request):
    """``text``: the output's ``format`` (``text``, ``json_object`` or ``json_schema`` with ``name``,
    ``schema``, ``strict`` beside ``type``)."""

    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ResponsesRequest(_Request):
    """``POST /v1/responses``."""

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1, lt=_INT64_END)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool | None = None
    """Keep the response for ``GET /v1/responses/{id}`` and ``previous_response_id``; absent or null:
    true if the server stores responses."""
    background: bool | None = None
    """Answer at once with a ``queued`` response and generate in the server (needs ``store``)."""
    previous_response_id: str | None = None
    """A stored response whose conversation (input and output) this request continues."""
    seed: Int64 | None = None
    """An extra, as on chat completions: seeded sampling."""
    # Declared to be refused (UNSUPPORTED).
    reasoning: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: int | None = None
    prompt: dict[str, Any] | None = None
    top_logprobs: int | None = None

    UNSUPPORTED = (
        Unsupported("conversation", _given, "conversation objects are not supported (previous_response_id is)"),
        Unsupported("prompt", _given, "prompt templates are not supported"),
        Unsupported("include", bool, "include is not supported"),
        Unsupported("truncation", lambda v: v == "auto", "truncation auto is not supported"),
        Unsupported("max_tool_calls", _given, "max_tool_calls is not supported"),
        Unsupported("top_logprobs", bool, "top_logprobs is not supported"),
        Unsupported(
            "reasoning",
            lambda v: bool(v) and any(x is not None for x in v.values()),
            "reasoning options are not supported (a server with --reasoning-parser returns reasoning items)",
        ),
        Unsupported("text", lambda v: v is not None and v.verbosity is not None, "text.verbosity is not supported"),
    )


def chat_messages(req: ResponsesRequest, history: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """The chat a request runs: ``instructions`` as a system message, then ``input_messages``."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    return [*system, *input_messages(req, history)]


def input_messages(req: ResponsesRequest, history: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """``history`` (a previous response's conversation, copied) followed by ``input`` as chat
    messages: function calls join the assistant message before them (or make one), function outputs
    become ``tool`` messages, reasoning is dropped."""
    items = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    return _add_items(copy.deepcopy(list(history)), items)


_OUTPUT_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(list[InputItem])


def conversation_after(messages: Sequence[dict[str, Any]], output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` (copied) followed by a response's ``output`` items, read as the input items a
    client would send back (OpenAI's ``previous_response_id`` continues exactly that)."""
    return _add_items(copy.deepcopy(list(messages)), _OUTPUT_ITEMS.validate_python(output))


def _add_items(messages: list[dict[str, Any]], items: Sequence[InputItem]) -> list[dict[str, Any]]:
    """``messages`` with ``items`` appended as chat messages (in place)."""
    for item in items:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": item.chat_content()})
        elif isinstance(item, FunctionCallItem):
            function = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": function}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
    return messages


def response_format(text: TextConfig | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.get("type") != "json_schema":
        return fmt
    keys = ("name", "schema", "strict", "description")
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in keys if k in fmt}}


def chat_request(req: ResponsesRequest, history: Sequence[dict[str, Any]] = ()) -> ChatCompletionRequest:
    """The chat completions request that answers ``req``, continuing ``history`` (chat messages: a
    previous response's conversation); 400 naming the Responses field if it does not validate."""
    choice: Any = req.tool_choice
    if isinstance(choice, FunctionChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    tools = [
        {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in req.tools or []
    ]
    body = {
        "model": req.model,
        "messages": chat_messages(req, history),
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "seed": req.seed,
        "response_format": response_format(req.text),
        "tools": tools or None,
        "tool_choice": choice,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "stream": req.stream,
    }
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        param = responses_param(".".join(str(p) for p in first["loc"] if not isinstance(p, int)))
        raise APIError(400, f"{param}: {first['msg']}", param=param, code="invalid_value") from None


_PARAMS = (
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("messages", "input"),
)


def responses_param(param: str | None) -> str | None:
    """A chat request's field, named as the Responses request has it (for errors)."""
    if param is None:
        return None
    for chat, responses in _PARAMS:
        if param == chat or param.startswith(chat + "."):
            return responses + param[len(chat) :]
    if param.startswith("tools.") and ".function." in param:
        return param.replace(".function.", ".", 1)
    return param
