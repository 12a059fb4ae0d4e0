"""OpenAI request schemas (pydantic), with vLLM's extra sampling fields. Unknown fields are ignored.

OpenAI fields that would change the output but that we do not implement are declared so that a
request using them is refused (400 ``unsupported_parameter``) rather than silently answered
differently: each request class lists them in its ``UNSUPPORTED`` table. Fields that change nothing
here (``metadata``, ``service_tier``, ...) are ignored like unknown ones.

Every integer field carries its range here (so ``/openapi.json`` states it and pydantic refuses the
rest with a 400 naming the field): nothing a client sends reaches the engine core's wire message
(msgspec MessagePack, which holds signed or unsigned 64-bit integers only) or the device's int32
sampling rows out of range. The bounds that need the model's vocabulary (token ids: a completions
prompt, ``logit_bias`` keys, ``stop_token_ids``, ``/detokenize`` tokens) are checked by the app,
which knows it (``frontend/app.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from myserve.wire.params import MAX_TOP_LOGPROBS

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""What the wire to the engine core can carry (msgspec encodes a larger Python int as an OverflowError)."""
_INT64_END = 2**63
"""The bound as ``lt``: OpenAPI's numbers are floats, and 2**63 is one exactly (2**63 - 1 is not)."""
INT32_MAX = 2**31 - 1
MAX_N = 16
"""Most choices per prompt: ``SamplingParams``' own bound (``wire/params.py``), stated here for the schema."""

Int64 = Annotated[int, Field(ge=INT64_MIN, lt=_INT64_END)]
TokenCount = Annotated[int, Field(ge=0, lt=_INT64_END)]
"""``max_tokens`` and friends: beyond the context length they are refused by the engine's context
check (``context_length_exceeded``); beyond 64 bits already here."""


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
    _ignored: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _note_ignored(cls, data: Any, handler: Any) -> Any:
        # The body's top-level keys that no field reads: answered without them, but named (vLLM logs
        # them; ``generation.admit`` logs them once and the response's header names them).
        model = handler(data)
        if isinstance(data, dict) and isinstance(model, _Request):
            model._ignored = tuple(k for k in data if k not in cls.model_fields)
        return model

    def unsupported(self) -> Unsupported | None:
        """The first field of ``UNSUPPORTED`` this request sets to a refused value, if any."""
        return next((u for u in self.UNSUPPORTED if u.refused(getattr(self, u.field))), None)

    @property
    def ignored_fields(self) -> tuple[str, ...]:
        """The top-level fields of the body that this server does not read (unknown to it)."""
        return self._ignored


class StreamOptions(_Request):
    """``stream_options``: ``include_usage`` adds a final chunk with usage and no choices."""

    include_usage: bool = False


class _Sampling(_Request):
    """Fields shared by completions and chat completions."""

    # The schema states what the validator below enforces: stream_options only with stream true.
    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {"required": ["stream"], "properties": {"stream": {"const": True}}},
                {"properties": {"stream_options": {"type": "null"}}},
            ]
        }
    )

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    """vLLM's range (signed 64-bit, what the wire carries). The sampler keys jax.random with the
    seed's low 32 bits (``seed & 0xFFFFFFFF``, runtime/sampling_rows.py), so any int64 maps to a
    valid uint32 key, negative ones included; seeds equal modulo 2**32 sample alike."""
    # The float ranges are SamplingParams' (wire/params.py), stated here for the schema too.
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    """-1 or 0 disables; an int32 column of the device's sampling rows (at or above the vocabulary
    size it filters nothing)."""
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=2)] | None = None
    ignore_eos: bool = False
    min_tokens: TokenCount = 0
    stop_token_ids: list[int] | None = None
    """Inside the vocabulary (checked by the app)."""
    skip_special_tokens: bool = True
    response_format: dict[str, Any] | None = None
    """OpenAI's output format: text, json_object or json_schema (``frontend/structured.py``)."""
    structured_outputs: dict[str, Any] | None = None
    """vLLM's constraint: one of json, json_object, regex, choice, grammar (``frontend/structured.py``)."""
    include_stop_str_in_output: bool = False
    """Keep the stop string (or stop token id's text) that ended a choice in its text."""
    bad_words: list[str] | None = None
    """Words never generated: the last token of each word's tokenization (with and without a leading
    space) is banned where the output already ends with the tokens before it (vLLM's)."""
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1)
    """Only these token ids may be sampled (inside the vocabulary: checked by the app)."""
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    """The logprob of each prompt token (after the first) with the top k there, as vLLM returns
    them; not with ``stream``."""
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    """Keep only the prompt's last this many tokens; -1: the model's context length."""
    return_tokens_as_token_ids: bool = False
    """Logprobs name tokens as ``token_id:<id>`` (tokens that are not valid UTF-8 on their own stay
    identifiable)."""
    # llama-server's own fields, mapped onto ours (``frontend/structured.py``, ``max_tokens``).
    grammar: str | None = None
    """llama-server's GBNF grammar (as ``structured_outputs.grammar``)."""
    json_schema: dict[str, Any] | None = None
    """llama-server's JSON schema constraint (as ``structured_outputs.json``)."""
    n_predict: Annotated[int, Field(ge=-1, lt=_INT64_END)] | None = None
    """llama-server's ``max_tokens`` (-1: up to the context length); used when ``max_tokens`` is not given."""

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _not_streamed(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("stream"):  # vLLM's rule: they come in the one body
            raise ValueError("prompt_logprobs are not available when stream is true")
        return value


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    """Token ids inside the vocabulary (checked by the app)."""
    max_tokens: TokenCount | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
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


class ImageURL(_Request):
    """Where an image part's image is: a ``data:`` URL (base64 PNG, JPEG, WebP...), or an
    ``http(s)://`` / ``file://`` URL the server is configured to read."""

    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None
    """OpenAI's resolution hint; the model's own processor decides the size here."""


class ImagePart(_Request):
    """An image part of a message's content list (a vision-language model's input)."""

    type: Literal["image_url"]
    image_url: ImageURL


type ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]
"""A part of a message's content list."""


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

    # The schema states what the validator below enforces: content (not null) unless assistant.
    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {"properties": {"role": {"const": "assistant"}}},
                {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
            ]
        }
    )

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = Field(default=None, validate_default=True)
    """Required (not null) except on assistant messages, which may carry only tool calls."""
    name: str | None = None
    tool_call_id: str | None = None
    """A ``tool`` message: the id of the call it answers."""
    tool_calls: list[MessageToolCall] | None = None
    """An assistant message: the calls it made."""

    @field_validator("content")
    @classmethod
    def _required_unless_assistant(cls, value: str | list[ContentPart] | None, info: ValidationInfo) -> Any:
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
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def image_urls(self) -> list[str]:
        """The URLs of its image parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [part.image_url.url for part in self.content if isinstance(part, ImagePart)]


class ChatTemplateFields(_Request):
    """How messages are rendered with the chat template (vLLM's fields, on chat and ``/tokenize``)."""

    add_generation_prompt: bool = True
    """End the prompt with the template's opening of an assistant turn."""
    continue_final_message: bool = False
    """Leave the final (assistant) message open so the model continues it (assistant prefill);
    needs ``add_generation_prompt`` false."""
    documents: list[dict[str, str]] | None = None
    """Documents for templates that render them (retrieval-augmented generation)."""
    chat_template: str | None = None
    """A Jinja chat template for this request only (refused unless the server trusts request
    templates: ``server.trust_request_chat_template``)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template (e.g. ``{"enable_thinking": false}`` for Qwen3)."""

    @field_validator("continue_final_message")
    @classmethod
    def _not_with_generation_prompt(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("add_generation_prompt"):
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return value


class ChatCompletionRequest(ChatTemplateFields, _Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    # At least 1: only completions' echo scores a prompt without generating.
    max_tokens: Annotated[int, Field(ge=1, lt=_INT64_END)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, lt=_INT64_END)] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    """0 to 20, checked with ``logprobs`` by ``SamplingParams`` (whose errors name ``logprobs``)."""
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    """Passed to the chat template as ``reasoning_effort`` (templates such as gpt-oss's read it)."""
    # vLLM extras
    echo: bool = False
    """Start the answer with the final message's content when it has the answer's role (assistant)."""
    # Declared to be refused (UNSUPPORTED); the types only admit what OpenAI documents.
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    store: bool | None = None
    verbosity: str | None = None

    UNSUPPORTED = (
        Unsupported("functions", bool, "functions (legacy function calling) are not supported"),
        Unsupported("function_call", _given, "function_call (legacy function calling) is not supported"),
        Unsupported("audio", _given, "audio output is not supported"),
        Unsupported("modalities", lambda v: v not in (None, ["text"]), "only the text modality is supported"),
        Unsupported("prediction", _given, "predicted outputs are not supported"),
        Unsupported("web_search_options", _given, "web search is not supported"),
        Unsupported("store", lambda v: v is True, "store is not supported: completions are not stored"),
        Unsupported("verbosity", _given, "verbosity is not supported"),
    )

    def template_variables(self) -> dict[str, Any]:
        """Variables the chat template sees beyond messages and tools."""
        extra: dict[str, Any] = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            extra["reasoning_effort"] = self.reasoning_effort
        return extra


class TokenizeRequest(ChatTemplateFields):
    """``POST /tokenize``: a prompt, or messages rendered with the chat template."""

    # The schema states what the route enforces: exactly one of prompt and messages.
    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}}},
            ]
        }
    )

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Request):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]
    """Inside the vocabulary (checked by the app)."""


MAX_EMBEDDING_INPUTS = 2048
"""Most inputs in one embeddings request (OpenAI's limit)."""


class EmbeddingRequest(_Request):
    """``POST /v1/embeddings`` (OpenAI's fields, with vLLM's ``truncate_prompt_tokens`` and ``normalize``)."""

    model: str | None = None
    input: str | list[str] | list[Int64] | list[list[Int64]]
    """Text, texts, token ids or lists of token ids (inside the vocabulary: checked by the app)."""
    encoding_format: Literal["float", "base64"] = "float"
    """base64: each vector's little-endian float32 bytes, base64-encoded."""
    dimensions: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    """Matryoshka truncation (then renormalized), where the model supports it."""
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    """Keep only each input's last this many tokens; -1: the model's context length; None: an input
    longer than the context is refused."""
    normalize: bool | None = None
    """Unit-normalize each vector; None: the model's setting (``model.normalize``)."""
