"""The app's routes, one ``APIRouter`` per endpoint family. Each route gets the app's models as the
``Models`` dependency and the named model's ``AppContext`` (engine, names, options) from
``models.resolve(req.model)`` (``frontend/served_models.py``).

Route functions carry a comment, not a docstring: FastAPI would publish a docstring as the
operation's description, and the OpenAPI schema is part of the contract the HTTP tests hold."""

from __future__ import annotations

from fastapi import APIRouter

from myserve.frontend.routes import (
    chat,
    completions,
    embeddings,
    health,
    models,
    page,
    responses_api,
    routers,
    score,
    server_info,
    tokenize,
)

ROUTERS: tuple[APIRouter, ...] = (
    health.router,
    models.router,
    tokenize.router,
    completions.router,
    chat.router,
    responses_api.router,
    embeddings.router,
    score.router,
    server_info.router,
    routers.router,
    page.router,
)
"""In the order the app includes them (the order of the OpenAPI schema's paths)."""
