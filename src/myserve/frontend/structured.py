"""A request's output constraint: OpenAI's ``response_format`` and vLLM's ``structured_outputs``
turned into the engine's ``GrammarSpec``.

- ``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}`` (any JSON object),
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``. With ``strict: true`` a
  schema keyword the grammar library cannot enforce is a 400; without it such keywords are ignored.
- ``structured_outputs`` (vLLM's extra): exactly one of ``json`` (a schema, as an object or JSON
  text), ``json_object`` (true), ``regex``, ``choice`` (a list of strings) or ``grammar`` (Lark, the
  dialect of llguidance, or GBNF as llama.cpp writes it).

Whether the grammar compiles is checked by the engine when the request is submitted
(``validation.py``), which compiles it once and caches it.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from myserve.frontend.errors import APIError
from myserve.grammar import GrammarSpec

_STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def schema_text(schema: Any, param: str) -> str:
    """A JSON schema given as an object (or as JSON text) as JSON text (the cache key). Its keys keep
    their order: the order of `properties` is the order the fields are generated in."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise _bad(param, f"{param} is not valid JSON") from None
    if not isinstance(schema, dict):
        raise _bad(param, f"{param} must be a JSON schema object")
    return json.dumps(schema)


def from_response_format(value: dict[str, Any] | None) -> GrammarSpec | None:
    """The constraint OpenAI's ``response_format`` asks for (None for text or absent)."""
    if value is None:
        return None
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", "")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise _bad("response_format.json_schema", "response_format json_schema needs json_schema.schema")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _bad("response_format.json_schema.strict", "strict must be a boolean")
        source = schema_text(spec["schema"], "response_format.json_schema.schema")
        return GrammarSpec("json_schema", source, lenient=not strict)
    raise _bad("response_format.type", f"response_format type must be text, json_object or json_schema, got {kind!r}")


def from_structured_outputs(value: dict[str, Any] | None) -> GrammarSpec | None:
    """The constraint vLLM's ``structured_outputs`` asks for."""
    if value is None:
        return None
    given = [k for k in _STRUCTURED_KINDS if value.get(k) not in (None, False)]
    unknown = sorted(k for k in value if k not in _STRUCTURED_KINDS and value[k] is not None)
    if unknown:
        raise _bad("structured_outputs", f"structured_outputs does not support {', '.join(unknown)}")
    if len(given) != 1:
        raise _bad("structured_outputs", f"structured_outputs needs exactly one of {', '.join(_STRUCTURED_KINDS)}")
    kind = given[0]
    item = value[kind]
    param = f"structured_outputs.{kind}"
    if kind == "json":
        return GrammarSpec("json_schema", schema_text(item, param))
    if kind == "json_object":
        return GrammarSpec("json_object", "")
    if kind == "choice":
        if not (isinstance(item, list) and item and all(isinstance(c, str) for c in item)):
            raise _bad(param, "choice must be a non-empty list of strings")
        return GrammarSpec("choice", json.dumps(item))
    if not isinstance(item, str) or not item:
        raise _bad(param, f"{kind} must be a non-empty string")
    return GrammarSpec("regex" if kind == "regex" else "grammar", item)


class Constrained(Protocol):
    """The fields of a request body that may constrain its output."""

    response_format: dict[str, Any] | None
    structured_outputs: dict[str, Any] | None
    grammar: str | None
    json_schema: dict[str, Any] | None


def request_grammar(req: Constrained) -> GrammarSpec | None:
    """The one constraint a request asks for (OpenAI's ``response_format``, vLLM's
    ``structured_outputs``, or llama-server's ``grammar`` or ``json_schema``); two is a 400."""
    asked = {
        "response_format": from_response_format(req.response_format),
        "structured_outputs": from_structured_outputs(req.structured_outputs),
        # llama-server's: an empty grammar is none; GBNF compiles as structured_outputs.grammar does.
        "grammar": GrammarSpec("grammar", req.grammar) if req.grammar else None,
        "json_schema": None
        if req.json_schema is None
        else GrammarSpec("json_schema", schema_text(req.json_schema, "json_schema")),
    }
    given = [field for field, spec in asked.items() if spec is not None]
    if len(given) > 1:
        raise _bad(given[-1], f"give one of {', '.join(given)}, not several")
    return asked[given[0]] if given else None
