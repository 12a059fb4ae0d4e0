"""Score and rerank answers: the cosine similarity of embeddings, in vLLM's shapes.

The route submits every text as one embedding request (``ResponseContext(kind="score"|"rerank")``);
the answer reads the vectors and scores the pairs it was given. The model is a bi-encoder here (its
pooled embeddings), so a score is the cosine of two vectors, whatever ``model.normalize`` says.
Waiting, disconnects, deadlines, errors and metrics are ``CompletionResponse``'s.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from myserve.frontend.responses import CompletionResponse
from myserve.wire.outputs import RequestOutput, Usage


def cosines(outputs: list[tuple[int, RequestOutput]], pairs: list[tuple[int, int]]) -> list[float]:
    """The cosine similarity of each pair of prompts' vectors."""
    vectors = {i: np.frombuffer(out.embedding, "<f4") for i, out in outputs if out.embedding is not None}
    unit = {i: v / max(float(np.linalg.norm(v)), 1e-12) for i, v in vectors.items()}
    return [float(np.dot(unit[a], unit[b])) for a, b in pairs]


class ScoreResponse(CompletionResponse):
    """``/v1/score``: one score per pair of texts (``pairs`` index the prompts)."""

    def __init__(self, *args: Any, pairs: list[tuple[int, int]]) -> None:
        """``CompletionResponse``'s arguments; ``pairs``: which prompts each score compares."""
        super().__init__(*args)
        self.pairs = pairs

    def _body(self, outputs: list[tuple[int, RequestOutput]], usage: Usage) -> dict[str, Any]:
        data = [{"index": k, "object": "score", "score": s} for k, s in enumerate(cosines(outputs, self.pairs))]
        return {
            "id": self.ctx.request_id,
            "object": "list",
            "created": self.ctx.created,
            "model": self.ctx.model,
            "data": data,
            "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens},
        }


class RerankResponse(CompletionResponse):
    """``/v1/rerank``: the documents (prompts 1..n; prompt 0 is the query) by relevance, best first."""

    def __init__(self, *args: Any, documents: list[str], top_n: int, return_documents: bool) -> None:
        """``CompletionResponse``'s arguments; the documents' texts, how many to return (0: all),
        and whether each result carries its text."""
        super().__init__(*args)
        self.documents, self.top_n, self.return_documents = documents, top_n, return_documents

    def _body(self, outputs: list[tuple[int, RequestOutput]], usage: Usage) -> dict[str, Any]:
        scores = cosines(outputs, [(0, i + 1) for i in range(len(self.documents))])
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: self.top_n or None]
        results = []
        for i in order:
            result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if self.return_documents:
                result["document"] = {"text": self.documents[i]}
            results.append(result)
        return {
            "id": self.ctx.request_id,
            "model": self.ctx.model,
            "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens},
            "results": results,
        }
