"""The app's OpenAPI schema: FastAPI's, with the range of token ids (the models' vocabulary: the
largest, with several models; each request is checked against its own model's)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI

from myserve.frontend.engine import Engine

TOKEN_ID_FIELDS = (
    ("CompletionRequest", "prompt"),
    ("CompletionRequest", "stop_token_ids"),
    ("ChatCompletionRequest", "stop_token_ids"),
    ("DetokenizeRequest", "tokens"),
)
"""The request fields whose integers are token ids (checked by ``AppContext.check_token_ids``)."""


def install_openapi(app: FastAPI, engines: Sequence[Engine]) -> None:
    """Serve ``app``'s schema with token ids bounded by the ``engines``' vocabulary once it is known."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = FastAPI.openapi(app)
        if not all(e.ready.is_set() for e in engines):  # a core's vocabulary is not known yet: ask again later
            app.openapi_schema = None
            return schema
        token_id = {"type": "integer", "minimum": 0, "maximum": max(e.vocab_size for e in engines) - 1}
        bodies = schema.get("components", {}).get("schemas", {})
        for model, field in TOKEN_ID_FIELDS:
            if field in bodies.get(model, {}).get("properties", {}):
                _bound_integers(bodies[model]["properties"][field], token_id)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _bound_integers(node: Any, bound: dict[str, Any]) -> None:
    """Every ``{"type": "integer"}`` schema inside ``node`` gets ``bound``'s range."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            node.update(bound)
        for child in node.values():
            _bound_integers(child, bound)
    elif isinstance(node, list):
        for child in node:
            _bound_integers(child, bound)
