"""The configuration schema: a deployment's sections, how they are loaded (YAML, dotted overrides)
and checked. Plain data, no JAX: every process reads it (the launcher, the front end, the engine
core, each Ray replica).

- ``schema.py``: the deployment (``Config``), its ``model`` and ``mesh`` sections, several models,
  loading a YAML file with overrides;
- ``engine.py``, ``server.py``, ``ray.py``: the ``engine``, ``server`` and ``ray`` sections;
- ``fields.py``: how a section is built from YAML values (types, unknown keys, dotted overrides,
  one-line errors), and the field docstrings ``--help`` shows.
"""

from myserve.config.engine import EngineConfig
from myserve.config.fields import parse_overrides
from myserve.config.ray import RayConfig
from myserve.config.schema import (
    DTYPES,
    GENERATION_DEFAULTS,
    MESH_ENV,
    MODEL_SECTIONS,
    QUANTIZATIONS,
    Config,
    MeshConfig,
    ModelConfig,
    ModelEntry,
    check_generation_overrides,
    config_from_dict,
    default_config_path,
    from_mapping,
    load_config,
    too_few_devices,
    with_overrides,
)
from myserve.config.server import REASONING_PARSERS, TOOL_CALL_PARSERS, ServerConfig

__all__ = [
    "DTYPES",
    "GENERATION_DEFAULTS",
    "MESH_ENV",
    "MODEL_SECTIONS",
    "QUANTIZATIONS",
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "Config",
    "EngineConfig",
    "MeshConfig",
    "ModelConfig",
    "ModelEntry",
    "RayConfig",
    "ServerConfig",
    "check_generation_overrides",
    "config_from_dict",
    "default_config_path",
    "from_mapping",
    "load_config",
    "parse_overrides",
    "too_few_devices",
    "with_overrides",
]
