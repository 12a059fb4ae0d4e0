"""Typed objects the engine hands to its callers: per-choice deltas, usage, stats, errors."""

from __future__ import annotations

import dataclasses

from myserve.errors import MyserveError


class Overloaded(MyserveError):
    """The waiting queue is full; the caller should retry later (HTTP 429)."""


class ContextLengthExceeded(MyserveError):
    """Prompt plus requested completion does not fit in the model's context (HTTP 400)."""


class EngineSleeping(MyserveError):
    """The engine sleeps, or is about to (sleep mode): the caller should wake it first (HTTP 503)."""


class EngineDead(MyserveError):
    """The engine thread has stopped; no request can be served."""


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log probability and the most likely alternatives at that position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    """(token id, logprob) pairs, most likely first; as many as the request asked for."""
    rank: int | None = None
    """The token's rank in the vocabulary by logprob (1: the most likely); prompt tokens only."""


@dataclasses.dataclass(frozen=True)
class Usage:
    """Token counts of a whole request (all choices)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""

    @property
    def total_tokens(self) -> int:
        """Prompt plus completion tokens."""
        return self.prompt_tokens + self.completion_tokens


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """A delta of one choice: new tokens and the text they completed; the last one has ``finish_reason``.

    When every choice of the request has finished, one more output with ``choice == -1`` carries
    ``usage`` and ends the stream.
    """

    request_id: str
    choice: int
    token_ids: tuple[int, ...] = ()
    text: str = ""
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: str | None = None
    """"stop" (EOS, stop token or stop string), "length", "abort" or "error"."""
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended the choice, if any (vLLM's field)."""
    usage: Usage | None = None
    error: str | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    """Per prompt token (the first is None), once, before the choice's first token; only when asked."""
    embedding: bytes | None = None
    """An embedding request's vector, little-endian float32 (its one delta, finish reason "stop")."""
    weights_version: str | None = None
    """The version of the weights that produced the delta's tokens (``core/engine_weights.py``)."""

    @property
    def final(self) -> bool:
        """Whether this output ends the request's stream."""
        return self.choice == -1


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot for the metrics endpoint and tests."""

    waiting: int
    running: int
    pages_used: int
    pages_free: int
    pages_total: int
    prefix_cache_hit_rate: float
    prefix_cache_hit_tokens: int
    prompt_tokens_computed: int
    compile_count: int
    """Executables built in this process: compiled, or loaded from the persistent cache."""
    cache_load_count: int
    """Of those, loaded from the persistent compilation cache."""
    num_preemptions: int
    steps: int
    max_decode_batch: int
    """Largest number of sequences one decode call has carried."""
    generated_tokens: int
    host_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    """Engine-thread seconds so far by phase: plan, dispatch, read, postprocess (``StepTimer``)."""
    step_gap_seconds: float = 0.0
    """Mean host-measured gap between consecutive steps over the last 100 (device idle, at most)."""
    grammar_matchers: int = 0
    """Grammar matchers alive in the engine (one per unfinished constrained sequence)."""
    penalty_slots_used: int = 0
    """Penalty slots owned by running sequences."""
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache so far (``prefix_cache_hit_tokens`` of them found)."""
    spec_drafts: int = 0
    """Speculating decodes verified (drafts)."""
    spec_draft_tokens: int = 0
    """Draft tokens proposed in them."""
    spec_accepted_tokens: int = 0
    """Draft tokens that held (the samples agreed)."""
    spec_accepted_per_pos: tuple[int, ...] = ()
    """Draft tokens that held, by position in their draft."""
    weight_swaps: int = 0
    """Versions of the weights switched to by live updates since start."""
    weights_version: str = "0"
    """The label of the version of the weights new requests run on."""
    weights_loaded_at: float = 0.0
    """Unix time that version began serving."""
    host_tier_hit_tokens: int = 0
    """Prompt tokens whose K/V came back from the host tier of the prefix cache (not counted in
    ``prefix_cache_hit_tokens``, the device's hits)."""
    host_tier_pages_used: int = 0
    """Pages the host tier holds."""
    host_tier_pages_total: int = 0
    """Pages it can hold (0: no host tier)."""
    host_tier_saved_pages: int = 0
    """Pages copied to it so far (evicted from the device)."""
    images_encoded: int = 0
    """Images run through the vision tower since start (a vision-language model's)."""
    image_cache_hits: int = 0
    """Images whose embeddings came from the encoder cache instead."""
    primed: bool = False
    """Whether every step executable has run once (``ModelRunner.primed``); until then the idle engine
    runs them one at a time, and a request that arrives waits for the one in progress."""
