"""Typed config sections from YAML values: each value checked against its field's annotation,
unknown keys answered with the closest known one (or with what replaced a removed key), dotted
``section.key`` overrides, and the docstrings written under the fields. Every error is a one-line
``ConfigError`` naming the dotted key. ``schema.py`` and its sibling modules hold the sections themselves.
"""

import ast
import contextlib
import dataclasses
import difflib
import inspect
import textwrap
import types
import typing
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import yaml

from myserve.errors import ConfigError

_NONE: Mapping[str, str] = {}


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> docstring (the string literal under the field) of a dataclass, in order.

    Returns ``{}`` when the source is unavailable (e.g. a build that strips ``.py`` files).
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    class_def = tree.body[0]
    assert isinstance(class_def, ast.ClassDef)
    docs = {}
    for stmt, after in zip(class_def.body, class_def.body[1:], strict=False):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(after.value.value.split())  # one paragraph for --help
    return docs


def key_docs(cls: type, prefix: str = "") -> dict[str, str]:
    """Dotted key (``engine.page_size``) -> docstring for every leaf field, recursing into sections."""
    hints, docs, out = typing.get_type_hints(cls), field_docs(cls), {}
    for field in dataclasses.fields(cls):
        if is_section(hints[field.name]):
            out.update(key_docs(hints[field.name], f"{prefix}{field.name}."))
        else:
            out[f"{prefix}{field.name}"] = docs.get(field.name, "")
    return out


def check(ok: bool, message: str) -> None:
    """A section's own check: ``ConfigError(message)`` unless ``ok``."""
    if not ok:
        raise ConfigError(message)


def check_choice(key: str, value: str, choices: Sequence[str]) -> None:
    """``key``'s value must be one of ``choices``."""
    check(value in choices, f"{key} must be one of {', '.join(choices)}, got {show(value)}")


def check_not_empty(key: str, value: str | None) -> None:
    """A path, id or key given as a string must not be empty."""
    # An empty string is never a usable path, id or key; catching it here beats a confusing
    # "file not found: ''" (or an API key that accepts an empty bearer token) later.
    check(value is None or value.strip() != "", f"{key} must not be empty (use null for the default)")


def check_names(key: str, names: str | tuple[str, ...] | None) -> None:
    """A model's name, or its list of names: none empty, the list not empty."""
    for name in (names,) if names is None or isinstance(names, str) else names:
        check_not_empty(key, name)
    check(names != (), f"{key} must name at least one model (use null for the default)")


def show(value: object) -> str:
    """A value as an error message quotes it: one line, at most 60 characters."""
    text = repr(value)  # repr escapes newlines, which keeps every message on one line
    return text if len(text) <= 60 else text[:57] + "..."


def wrong_type(key: str, expected: str, value: object) -> ConfigError:
    """``key: expected <expected>, got <value> (<type>)``."""
    return ConfigError(f"{key}: expected {expected}, got {show(value)} ({type(value).__name__})")


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(arg) for arg in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


def is_section(tp: Any) -> bool:
    """Whether an annotation is a nested section (a dataclass)."""
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _is_section_list(tp: Any) -> bool:
    """Whether an annotation is a list of sections (``tuple[Section, ...]``, as ``models``)."""
    return typing.get_origin(tp) is tuple and any(is_section(arg) for arg in typing.get_args(tp))


def coerce(value: object, tp: Any, key: str, removed: Mapping[str, str] = _NONE) -> Any:
    """Check ``value`` (as YAML produced it) against the annotation ``tp``; return it converted."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    # YAML reads `api_key: 12345` as an int; say how to get the string that was probably meant.
    quote = "; quote it to make it a string" if str in (tp, *args) and isinstance(value, int | float) else ""
    wrong = ConfigError(f"{wrong_type(key, _type_name(tp), value)}{quote}")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            with contextlib.suppress(ConfigError):
                return coerce(value, arg, key, removed)
        raise wrong
    if is_section(tp):
        # A section whose keys are all commented out parses as null; treat it as empty.
        if value is None:
            value = {}
        if not isinstance(value, Mapping):
            raise wrong_type(key, "a mapping of keys", value)
        return build(tp, value, f"{key}.", removed)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise wrong
        types_ = [args[0]] * len(value) if len(args) == 2 and args[1] is Ellipsis else list(args)
        if len(types_) != len(value):
            raise wrong
        return tuple(coerce(v, t, f"{key}[{i}]", removed) for i, (v, t) in enumerate(zip(value, types_, strict=True)))
    # bool is a subclass of int: without the explicit exclusion `page_size: true` would read as 1.
    if tp in (bool, str) and isinstance(value, tp):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        if tp is float:
            return float(value)
        if tp is int and (isinstance(value, int) or value.is_integer()):
            return int(value)
    if tp in (bool, str, int, float):
        raise wrong
    raise TypeError(f"config field {key} has unsupported type {tp!r}")


def unknown_key(cls: type, name: str, prefix: str, removed: Mapping[str, str] = _NONE) -> ConfigError:
    """The error for ``name`` in section ``cls``: what replaced it (``removed``: dotted key -> how
    it was removed), or the closest known key."""
    if f"{prefix}{name}" in removed:
        return ConfigError(f"'{prefix}{name}' was {removed[prefix + name]}")
    hints = typing.get_type_hints(cls)
    known = [field.name for field in dataclasses.fields(cls)]
    word = "section" if all(is_section(hints[k]) or _is_section_list(hints[k]) for k in known) else "key"
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
    return ConfigError(f"unknown {word} '{prefix}{name}'{hint}; known {word}s: {', '.join(known)}")


def build[T](cls: type[T], data: Mapping[Any, object], prefix: str, removed: Mapping[str, str] = _NONE) -> T:
    """Section ``cls`` from a mapping of its keys (``prefix`` dots the keys in errors)."""
    assert dataclasses.is_dataclass(cls)
    hints = typing.get_type_hints(cls)
    names = {field.name for field in dataclasses.fields(cls) if field.init}
    kwargs = {}
    for raw_name, value in data.items():
        name = str(raw_name)
        if name not in names:
            raise unknown_key(cls, name, prefix, removed)
        kwargs[name] = coerce(value, hints[name], f"{prefix}{name}", removed)
    return cls(**kwargs)


@contextlib.contextmanager
def errors_from(source: str) -> Iterator[None]:
    """Prefix every ConfigError raised inside with where the offending value came from."""
    try:
        yield
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def set_dotted(data: dict[str, Any], cls: type, key: str, value: object, removed: Mapping[str, str] = _NONE) -> None:
    """Set dotted ``key`` in ``data`` (``dataclasses.asdict`` of a ``cls``), checking each part."""
    parts = key.split(".")
    for i, part in enumerate(parts):
        prefix = "".join(f"{p}." for p in parts[:i])
        if part not in {field.name for field in dataclasses.fields(cls)}:
            raise unknown_key(cls, part, prefix, removed)
        tp = typing.get_type_hints(cls)[part]
        if i == len(parts) - 1:
            if is_section(tp):
                raise ConfigError(f"'{key}' is a section; override its keys as {key}.<key>")
            data[part] = value
        elif not is_section(tp):
            raise ConfigError(f"'{prefix}{part}' is not a section, so '{key}' is not a key")
        else:
            data, cls = data[part], tp


def inherit(top: Mapping[str, Any], entry: object, sections: Sequence[str]) -> object:
    """A list entry (YAML mapping) with the keys of the top level's ``sections`` that it does not set."""
    if not isinstance(entry, Mapping):
        return entry  # build() names it as the wrong type
    merged = dict(entry)
    for section in sections:
        below, own = top.get(section) or {}, entry.get(section) or {}
        if isinstance(below, Mapping) and isinstance(own, Mapping):
            merged[section] = {**below, **own}
    return merged


def parse_overrides(overrides: Iterable[str]) -> dict[str, object]:
    """Parse ``section.field=value`` strings; each value is read as YAML (``2048``, ``null``, ``[1, 2]``)."""
    if isinstance(overrides, str):
        raise TypeError("overrides must be a sequence of 'section.field=value' strings, not one str")
    parsed: dict[str, object] = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"overrides: invalid override {item!r}; expected section.field=value")
        try:
            parsed[key.strip()] = yaml.safe_load(text)
        except yaml.YAMLError:
            # Not valid YAML (e.g. a template fragment like '{{ x'): the literal text is what was meant.
            parsed[key.strip()] = text
    return parsed
