"""A deployment's ``Pooler``: the config's embedding settings, filled in from the checkpoint's files.

sentence-transformers saves how a model embeds beside its weights: ``modules.json`` lists the
modules (``Transformer``, then ``Pooling`` in a folder such as ``1_Pooling``, then ``Normalize``
when vectors are unit length), and the pooling folder's ``config.json`` names the mode
(``pooling_mode_lasttoken``, ``pooling_mode_mean_tokens``, ``pooling_mode_cls_token``).
Matryoshka widths come from the model's ``config.json`` (``matryoshka_dimensions``, or
``is_matryoshka`` for any width). What the config sets explicitly wins over the files.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from myserve.config import ModelConfig
from myserve.errors import ConfigError
from myserve.wire.pooling import Pooler

logger = logging.getLogger(__name__)

_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
"""sentence-transformers' pooling flags we serve, and our names for them."""


def resolve_pooler(config: ModelConfig, directory: Path | None, hidden_size: int) -> Pooler | None:
    """How the deployment makes embeddings, given its checkpoint's directory (None: a single file,
    such as a GGUF) and hidden size; None when ``model.task`` is ``generate``. Raises
    ``ConfigError`` for a sentence-transformers pooling mode that is not served."""
    if config.task == "generate":
        return None
    st_type, st_normalize = _sentence_transformers(directory) if directory is not None else (None, None)
    pooling = config.pooling if config.pooling != "auto" else st_type or "last"
    normalize = config.normalize if config.normalize is not None else st_normalize is not False
    dimensions: tuple[int, ...] | None = tuple(config.matryoshka_dimensions) or None
    if dimensions is None and directory is not None:
        dimensions = _matryoshka(_read_json(directory / "config.json") or {})
    pooler = Pooler(pooling, normalize, hidden_size, dimensions, generate=config.task != "embed")
    logger.info(
        "embeddings: %s pooling%s, %d dimensions%s",
        pooler.type,
        ", normalized" if pooler.normalize else "",
        pooler.hidden_size,
        "" if pooler.dimensions is None else f" (matryoshka: {list(pooler.dimensions) or 'any width'})",
    )
    return pooler


def _sentence_transformers(directory: Path) -> tuple[str | None, bool | None]:
    """(pooling, normalize) as the checkpoint's sentence-transformers modules say; (None, None)
    without ``modules.json``."""
    modules = _read_json(directory / "modules.json")
    if not isinstance(modules, list):
        return None, None
    pooling = None
    normalize = False
    for module in modules:
        kind = str(module.get("type", "")) if isinstance(module, dict) else ""
        if kind.endswith(".Normalize"):
            normalize = True
        elif kind.endswith(".Pooling"):
            settings = _read_json(directory / str(module.get("path", "")) / "config.json") or {}
            chosen = [name for flag, name in _MODES.items() if settings.get(flag)]
            others = [k for k, v in settings.items() if k.startswith("pooling_mode_") and v and k not in _MODES]
            if others or len(chosen) > 1:
                raise ConfigError(
                    f"{directory}: sentence-transformers pooling {', '.join(others + chosen)} is not served; "
                    "set model.pooling to last, mean or cls"
                )
            pooling = chosen[0] if chosen else None
    return pooling, normalize


def _matryoshka(hf_config: dict[str, Any]) -> tuple[int, ...] | None:
    """Matryoshka widths from a model's config.json: listed ones, () for any, None for none."""
    listed = hf_config.get("matryoshka_dimensions")
    if isinstance(listed, list) and listed:
        return tuple(int(d) for d in listed)
    return () if hf_config.get("is_matryoshka") else None


def _read_json(path: Path) -> Any:
    """A JSON file's value, or None when it is absent; a broken one is a ``ConfigError``."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: {e}") from None
