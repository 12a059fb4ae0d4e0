"""An embeddings response: each input's vector, as floats or base64, in OpenAI's list shape.

Every input is one engine request whose single output carries the vector as little-endian
float32 bytes (``RequestOutput.embedding``): ``encoding_format: base64`` sends those bytes
base64-encoded as they are, ``float`` as JSON numbers. Waiting, the client's disconnect, the
deadline, engine errors and the request's metrics are ``CompletionResponse``'s.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from myserve.frontend.responses import CompletionResponse
from myserve.wire.outputs import RequestOutput, Usage


class EmbeddingResponse(CompletionResponse):
    """The answer to one embeddings request (``ResponseContext(kind="embedding")``)."""

    def __init__(self, *args: Any, encoding_format: str = "float") -> None:
        """``CompletionResponse``'s arguments; ``encoding_format``: ``float`` or ``base64``."""
        super().__init__(*args)
        self.encoding_format = encoding_format

    def _body(self, outputs: list[tuple[int, RequestOutput]], usage: Usage) -> dict[str, Any]:
        vectors = {i: out.embedding for i, out in outputs if out.embedding is not None}
        data = [
            {"object": "embedding", "index": i, "embedding": self._encode(vectors[i])}
            for i in range(len(self.ctx.prompts))
        ]
        return {
            "object": "list",
            "data": data,
            "model": self.ctx.model,
            "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens},
        }

    def _encode(self, vector: bytes) -> list[float] | str:
        if self.encoding_format == "base64":
            return base64.b64encode(vector).decode("ascii")
        return np.frombuffer(vector, "<f4").tolist()
