"""The models one app serves, found by any of their names: the one way a route gets the
``AppContext`` of the model a request names.

A route that takes a ``model`` field declares ``models: Models`` and calls
``models.resolve(req.model)``: the named model's context, the first model's when the field is
absent (where OpenAI allows that), 404 ``model_not_found`` for a name no model answers to. One
dictionary lookup, so serving one model costs what it did before there could be several.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

from fastapi import Depends, Request

from myserve.frontend.app_context import AppContext, ServerState, model_not_found
from myserve.frontend.engine import Engine


class ServedModels:
    """The app's models in order (the first is the default), by every name they answer to."""

    def __init__(self, contexts: Sequence[AppContext]):
        if not contexts:
            raise ValueError("an app serves at least one model")
        self.contexts = tuple(contexts)
        self.default = self.contexts[0]
        self._by_name: dict[str, AppContext] = {}
        for context in self.contexts:
            if context.state is not self.default.state:
                raise ValueError("the models of one app share one ServerState (one drain)")
            for name in context.names:
                if name in self._by_name:
                    raise ValueError(f"two served models answer to {name!r}")
                self._by_name[name] = context

    @property
    def state(self) -> ServerState:
        """The server-wide draining flag and requests in flight (all models')."""
        return self.default.state

    @property
    def engines(self) -> tuple[Engine, ...]:
        """Every model's engine, in order."""
        return tuple(context.engine for context in self.contexts)

    def resolve(self, model: str | None) -> AppContext:
        """The context of the model named ``model`` (None: the first model); 404 for an unknown name."""
        if model is None:
            return self.default
        context = self._by_name.get(model)
        if context is None:  # a LoRA adapter of one of the models (loaded by the engine, so looked up late)
            context = next((c for c in self.contexts if model in c.engine.adapter_paths), None)
        if context is None:
            raise model_not_found(model)
        return context

    def cards(self) -> list[dict[str, Any]]:
        """``/v1/models``: one card per name (aliases too) of each model that serves (loaded), models
        in order, each followed by its LoRA adapters'."""
        return [
            card
            for context in self.contexts
            if context.engine.ready.is_set()
            for card in [*(context.model_card(name) for name in context.names), *context.adapter_cards()]
        ]


def served_models(request: Request) -> ServedModels:
    """The FastAPI dependency behind ``Models``: the registry the app stored in ``app.state.models``."""
    models: ServedModels = request.app.state.models
    return models


Models = Annotated[ServedModels, Depends(served_models)]
"""A route parameter of this type receives the app's ``ServedModels``."""
