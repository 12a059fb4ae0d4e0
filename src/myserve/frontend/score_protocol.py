"""The bodies of ``/v1/score`` and ``/v1/rerank`` (vLLM's shapes; rerank as Jina's and Cohere's)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from myserve.frontend.protocol import INT32_MAX, _Request


class ScoreRequest(_Request):
    """``POST /v1/score``: the similarity of ``text_1`` to each of ``text_2`` (one to many), or of
    each pair (two lists of the same length)."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    """Keep only each text's last this many tokens; -1: the model's context length."""


class RerankRequest(_Request):
    """``POST /v1/rerank``: ``documents`` ordered by their relevance to ``query``."""

    model: str | None = None
    query: str
    documents: list[str]
    top_n: Annotated[int, Field(ge=0, le=INT32_MAX)] = 0
    """Return the best this many; 0: all of them."""
    return_documents: bool = True
    """Put each document's text in its result (Cohere's field)."""
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    """Keep only each text's last this many tokens; -1: the model's context length."""
