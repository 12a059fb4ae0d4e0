"""SamplingParams: what a request asks of generation, validated once on the way in."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from myserve.grammar import GrammarSpec
from myserve.wire.pooling import PoolingParams

MAX_TOP_LOGPROBS = 20
"""Most top logprobs a request may ask for (OpenAI's limit); the step always computes this many."""


class InvalidParams(ValueError):
    """A sampling parameter is out of range; ``param`` names it (OpenAI's error ``param``)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings (OpenAI fields plus vLLM's extras), all checked in ``__post_init__``."""

    max_tokens: int | None = 16
    """Most tokens to generate; None = up to the model's context length."""
    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """<= 0 disables top-k."""
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits before sampling."""
    seed: int | None = None
    """Makes sampling reproducible, whatever else is batched with this request."""
    n: int = 1
    """Number of choices generated for the prompt."""
    stop: tuple[str, ...] = ()
    """Strings that end generation; not included in the output unless ``include_stop_str_in_output``."""
    include_stop_str_in_output: bool = False
    """Keep the stop string (or a stop token id's text) that ended a choice in its text."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation (in addition to EOS unless ``ignore_eos``)."""
    ignore_eos: bool = False
    min_tokens: int = 0
    """EOS and stop token ids are banned until this many tokens are generated."""
    logprobs: int | None = None
    """None = no logprobs; k = the chosen token's logprob plus the top k (k <= 20)."""
    prompt_logprobs: int | None = None
    """None = none; k = logprob of every prompt token after the first, plus the top k (k <= 20)."""
    skip_special_tokens: bool = True
    grammar: GrammarSpec | None = None
    """Constrains the output (a JSON schema, a regex, ...): ``grammar.py``."""
    allowed_token_ids: tuple[int, ...] = ()
    """Only these tokens may be sampled (empty: any); applied as a token mask, like a grammar's."""
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    """Token sequences never generated: the last token of each is banned where the output ends with
    the ones before it (vLLM's ``bad_words``, tokenized by the front end)."""
    grammar_after: tuple[int, ...] = ()
    """The grammar applies only after the output contains these tokens (a reasoning block's end
    marker); empty: from the first token."""
    adapter: str | None = None
    """The LoRA adapter the request runs through (its served name); None: the base model."""
    pooling: PoolingParams | None = None
    """An embedding request: the prompt is pooled into one vector and nothing is generated
    (``wire/pooling.py``); the sampling fields are then unused."""

    def __post_init__(self) -> None:
        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise InvalidParams(param, message)

        # max_tokens 0 is only meaningful when the prompt itself is scored (echo with logprobs).
        min_tokens_out = 0 if self.prompt_logprobs is not None else 1
        check(
            self.max_tokens is None or self.max_tokens >= min_tokens_out,
            "max_tokens",
            f"max_tokens must be at least {min_tokens_out}",
        )
        check(0.0 <= self.temperature <= 2.0, "temperature", "temperature must be between 0 and 2")
        check(0.0 < self.top_p <= 1.0, "top_p", "top_p must be in (0, 1]")
        # The device's sampling rows hold top_k as int32: a larger one would fail the engine's step.
        check(-1 <= self.top_k < 2**31, "top_k", "top_k must be -1 (disabled) or between 0 and 2^31-1")
        check(0.0 <= self.min_p <= 1.0, "min_p", "min_p must be between 0 and 1")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "presence_penalty must be in [-2, 2]")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "frequency_penalty must be in [-2, 2]")
        check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", "repetition_penalty must be in (0, 2]")
        check(1 <= self.n <= 16, "n", "n must be between 1 and 16")
        check(self.min_tokens >= 0, "min_tokens", "min_tokens must be >= 0")
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            "min_tokens must not exceed max_tokens",
        )
        check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
            "logprobs",
            f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}",
        )
        check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS,
            "logprobs",
            f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}",
        )
        check(len(self.logit_bias) <= 300, "logit_bias", "logit_bias may hold at most 300 tokens")
        for _, bias in self.logit_bias:
            check(-100.0 <= bias <= 100.0, "logit_bias", "logit_bias values must be between -100 and 100")
        check(all(s for s in self.stop), "stop", "stop strings must not be empty")
        check(len(self.stop) <= 16, "stop", "at most 16 stop strings")
        check(not self.grammar_after or self.grammar is not None, "grammar_after", "grammar_after needs a grammar")
        check(len(self.bad_words_ids) <= 256, "bad_words", "at most 256 bad words")
        check(all(self.bad_words_ids), "bad_words", "a bad word must be at least one token")
        if self.pooling is not None:
            check(self.n == 1, "n", "an embedding request has one choice")
            dims = self.pooling.dimensions
            check(dims is None or dims >= 1, "dimensions", "dimensions must be at least 1")

    @property
    def masks_tokens(self) -> bool:
        """Whether a token mask beyond a grammar's applies (``allowed_token_ids``, ``bad_words_ids``)."""
        return bool(self.allowed_token_ids or self.bad_words_ids)

    @staticmethod
    def bias_from_mapping(bias: Mapping[str, float] | Mapping[int, float] | None) -> tuple[tuple[int, float], ...]:
        """OpenAI's ``{"token id": bias}`` mapping as sorted pairs (JSON object keys are strings)."""
        if not bias:
            return ()
        try:
            return tuple(sorted((int(k), float(v)) for k, v in bias.items()))
        except (TypeError, ValueError):
            raise InvalidParams("logit_bias", "logit_bias keys must be token ids and values numbers") from None

    @property
    def greedy(self) -> bool:
        """Temperature 0: argmax of the processed logits."""
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        """Whether the sampler needs this sequence's token history (penalty state on device)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
