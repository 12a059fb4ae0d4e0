"""Embeddings on the wire: how a model pools (``Pooler``) and what a request asks of it (``PoolingParams``).

An embedding request is a prompt whose hidden states are pooled into one vector instead of
generating: it travels as ``SamplingParams(pooling=PoolingParams(...))`` and comes back as one
``RequestOutput`` whose ``embedding`` holds the vector as little-endian float32 bytes (what
OpenAI's ``encoding_format: base64`` sends as it is).
"""

from __future__ import annotations

import dataclasses

POOLING_TYPES = ("last", "mean", "cls")
"""``last``: the last prompt token's hidden state (Qwen3-Embedding, e5-mistral, gte-Qwen2);
``mean``: the mean over the prompt's tokens; ``cls``: the first token's."""


@dataclasses.dataclass(frozen=True)
class Pooler:
    """How a deployment turns a prompt's final hidden states (after the final norm) into an embedding."""

    type: str
    """One of ``POOLING_TYPES``."""
    normalize: bool
    """Scale each vector to unit L2 norm (a request may override it)."""
    hidden_size: int
    """The vector's full width."""
    dimensions: tuple[int, ...] | None = None
    """Matryoshka widths a request may truncate to (then renormalized): None = the model was not
    trained for it (a ``dimensions`` request is refused); () = any width up to ``hidden_size``."""
    generate: bool = True
    """The deployment also serves generation (False: embeddings only, no sampler in its steps)."""

    def check_dimensions(self, dimensions: int) -> str | None:
        """Why a request's ``dimensions`` cannot be served (None: it can)."""
        if self.dimensions is None:
            return "this model does not support matryoshka representation (dimensions)"
        if not 1 <= dimensions <= self.hidden_size:
            return f"dimensions must be between 1 and the model's {self.hidden_size}"
        if self.dimensions and dimensions not in self.dimensions:
            return f"dimensions must be one of {', '.join(map(str, self.dimensions))}"
        return None


@dataclasses.dataclass(frozen=True)
class PoolingParams:
    """What one embedding request asks for."""

    dimensions: int | None = None
    """Keep the first ``dimensions`` values (Matryoshka), renormalized; None = the full vector."""
    normalize: bool | None = None
    """Unit-normalize the vector; None = the model's default (``Pooler.normalize``)."""
