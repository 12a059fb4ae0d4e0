"""What the engine checks of a request before queueing it: token ids in range, the context length,
and a constraint it can compile. Each failure is an ``InvalidParams`` (or ``ContextLengthExceeded``)
that the HTTP layer turns into an OpenAI-shaped 400.

Shared by the process roles (top level for that): the engine core checks every request it queues,
and the front end runs the same checks first so that a bad request never crosses the wire."""

from __future__ import annotations

from collections.abc import Callable

from myserve.grammar import Grammars, InvalidGrammar
from myserve.wire.outputs import ContextLengthExceeded
from myserve.wire.params import InvalidParams, SamplingParams
from myserve.wire.pooling import Pooler


def validate_request(
    prompt: list[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    grammars: Callable[[], Grammars],
    pooler: Pooler | None = None,
) -> None:
    """Raise if the request cannot be served; ``grammars()`` gives the engine's grammar compiler
    (built on first use, so only constrained requests pay for it); ``pooler``: how the model makes
    embeddings (None: it makes none)."""
    if params.pooling is not None or (pooler is not None and not pooler.generate):
        _validate_task(prompt, params, pooler, max_model_len)
    if not prompt:
        raise InvalidParams("prompt", "the prompt must contain at least one token")
    if any(t < 0 or t >= vocab_size for t in prompt):
        raise InvalidParams("prompt", f"prompt token ids must be in [0, {vocab_size})")
    for name, ids in (
        ("logit_bias", [t for t, _ in params.logit_bias]),
        ("stop_token_ids", params.stop_token_ids),
        ("allowed_token_ids", params.allowed_token_ids),
        ("bad_words", [t for word in params.bad_words_ids for t in word]),
    ):
        if any(t < 0 or t >= vocab_size for t in ids):
            raise InvalidParams(name, f"{name} token ids must be in [0, {vocab_size})")
    if len(params.stop_token_ids) > 16:
        raise InvalidParams("stop_token_ids", "at most 16 stop_token_ids")
    if params.grammar is not None:
        if params.ignore_eos:  # once the grammar is complete only EOS is allowed
            raise InvalidParams("ignore_eos", "ignore_eos cannot be combined with a grammar")
        try:
            grammars().validate(params.grammar)  # compiled once per grammar, then cached
        except InvalidGrammar as e:
            raise InvalidParams("grammar", str(e)) from None
    if params.pooling is not None:
        return  # no completion: the context was checked in _validate_task
    wanted = len(prompt) + (params.max_tokens or 1)
    if wanted > max_model_len:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{wanted} tokens ({len(prompt)} in the messages, {params.max_tokens or 1} in the completion). "
            "Please reduce the length of the messages or completion."
        )


def _validate_task(prompt: list[int], params: SamplingParams, pooler: Pooler | None, max_model_len: int) -> None:
    """An embedding request needs a model that pools, and fits the context without a completion;
    an embedding-only model takes nothing else."""
    if params.pooling is None:
        raise InvalidParams("model", "this model serves embeddings only (use /v1/embeddings)")
    if pooler is None:
        raise InvalidParams("model", "this model does not serve embeddings (model.task: generate)")
    if params.pooling.dimensions is not None and (why := pooler.check_dimensions(params.pooling.dimensions)):
        raise InvalidParams("dimensions", why)
    if len(prompt) > max_model_len:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, your input has "
            f"{len(prompt)} tokens. Please reduce the length of the input, or set truncate_prompt_tokens."
        )
