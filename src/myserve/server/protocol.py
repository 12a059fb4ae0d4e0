"""OpenAI request schemas (pydantic), with vLLM's extra sampling fields. Unknown fields are ignored.

OpenAI fields that would change the output but that we do not implement are declared so that a
request using them is refused (400 ``unsupported_parameter``) rather than silently answered
differently: each request class lists them in its ``UNSUPPORTED`` table. Fields that change nothing
here (``metadata``, ``service_tier``, ...) are ignored like unknown ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator


@dataclasses.dataclass(frozen=True)
class Unsupported:
    """A request field we refuse, and the values of it that we refuse (others are fine)."""

    field: str
    refused: Callable[[Any], bool]
    """Whether the field's value asks for something we do not implement."""
    message: str


def _given(value: Any) -> bool:
    return value is not None


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    UNSUPPORTED: ClassVar[tuple[Unsupported, ...]] = ()

    def unsupported(self) -> Unsupported | None:
        """The first field of ``UNSUPPORTED`` this request sets to a refused value, if any."""
        return next((u for u in self.UNSUPPORTED if u.refused(getattr(self, u.field))), None)


class StreamOptions(_Request):
    """``stream_options``: ``include_usage`` adds a final chunk with usage and no choices."""

    include_usage: bool = False


class _Sampling(_Request):
    """Fields shared by completions and chat completions."""

    model: str
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    response_format: dict[str, Any] | None = None
    """OpenAI's output format: text, json_object or json_schema (``server/structured.py``)."""
    structured_outputs: dict[str, Any] | None = None
    """vLLM's constraint: one of json, json_object, regex, choice, grammar (``server/structured.py``)."""

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    UNSUPPORTED = (
        Unsupported("best_of", lambda v: v not in (None, 1), "best_of other than 1 is not supported"),
        Unsupported("suffix", bool, "suffix is not supported"),
    )


class TextPart(_Request):
    """A text part of a message's content list."""

    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    """The function an assistant message called: its name and its arguments as JSON text."""

    name: str
    arguments: str


class MessageToolCall(_Request):
    """One call in an assistant message's ``tool_calls`` (conversation history)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Request):
    """A callable function: its name, what it does, and its parameters' JSON schema."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    """An entry of ``tools``."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    """The function a ``tool_choice`` object names."""

    name: str


class NamedToolChoice(_Request):
    """``tool_choice`` naming one function: the model must call it."""

    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Request):
    """One message of a conversation."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(default=None, validate_default=True)
    """Required (not null) except on assistant messages, which may carry only tool calls."""
    name: str | None = None
    tool_call_id: str | None = None
    """A ``tool`` message: the id of the call it answers."""
    tool_calls: list[MessageToolCall] | None = None
    """An assistant message: the calls it made."""

    @field_validator("content")
    @classmethod
    def _required_unless_assistant(cls, value: str | list[TextPart] | None, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if value is None and role is not None and role != "assistant":
            raise ValueError(f"a {role} message must have content")
        return value

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM extras
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template (e.g. ``{"enable_thinking": false}`` for Qwen3)."""
    # Declared to be refused (UNSUPPORTED); the types only admit what OpenAI documents.
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    store: bool | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None

    UNSUPPORTED = (
        Unsupported("functions", bool, "functions (legacy function calling) are not supported"),
        Unsupported("function_call", _given, "function_call (legacy function calling) is not supported"),
        Unsupported("audio", _given, "audio output is not supported"),
        Unsupported("modalities", lambda v: v not in (None, ["text"]), "only the text modality is supported"),
        Unsupported("prediction", _given, "predicted outputs are not supported"),
        Unsupported("web_search_options", _given, "web search is not supported"),
        Unsupported("store", lambda v: v is True, "store is not supported: completions are not stored"),
        Unsupported("reasoning_effort", _given, "reasoning_effort is not supported"),
        Unsupported("verbosity", _given, "verbosity is not supported"),
    )


class TokenizeRequest(_Request):
    """``POST /tokenize``: a prompt, or messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]
