"""A checkpoint's ``generation_config.json`` as request defaults, as vLLM applies it
(``--generation-config auto``): the sampling fields its author set become the defaults of the
requests that leave them out; ``vllm`` applies none; a directory names another file's. Fields equal
to transformers' own defaults (temperature 1, top_p 1, top_k 50, repetition_penalty 1) say nothing
and are skipped, as vLLM skips them. ``--override-generation-config`` goes over the result.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from myserve.config import GENERATION_DEFAULTS, ModelConfig, check_generation_overrides
from myserve.errors import ConfigError

logger = logging.getLogger(__name__)

_TRANSFORMERS_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}
"""transformers' GenerationConfig defaults: a file that states them asks for nothing."""


def generation_defaults(model: ModelConfig, checkpoint_dir: Path | None) -> dict[str, float]:
    """The request defaults ``model`` asks for: of ``GENERATION_DEFAULTS``' fields, those the
    generation config sets (``max_new_tokens`` as given, the others unless transformers' default),
    then ``override_generation_config``. Raises ``ConfigError`` for an unreadable named file."""
    mode = model.generation_config
    found: dict[str, float] = {}
    if mode == "auto":
        path = None if checkpoint_dir is None else checkpoint_dir / "generation_config.json"
        if path is not None and path.is_file():
            found = _read(path)
    elif mode != "vllm":
        path = Path(mode).expanduser() / "generation_config.json"
        if not path.is_file():
            raise ConfigError(f"model.generation_config: {path} does not exist (auto, vllm or a directory holding one)")
        found = _read(path)
    defaults = {k: v for k, v in found.items() if _TRANSFORMERS_DEFAULTS.get(k) != v}
    if model.override_generation_config:
        defaults.update(check_generation_overrides(model.override_generation_config))
    if defaults:
        logger.info("request defaults from the generation config: %s", defaults)
    return defaults


def _read(path: Path) -> dict[str, float]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not a readable generation config: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a generation config is a JSON object")
    return {
        k: data[k]
        for k in GENERATION_DEFAULTS
        if isinstance(data.get(k), int | float) and not isinstance(data.get(k), bool)
    }
