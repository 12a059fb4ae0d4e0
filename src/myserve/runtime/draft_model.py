"""The draft model of speculative decoding (``engine.speculative_method=draft_model``): read onto
each replica's devices beside the target, in the target's dtype, sharded by its own rules.

Its executor (``core/build.py``) holds its own KV cache of as many pages as the target's, indexed
by the same page ids (``core/draft.py``): the pool's memory plan counts both models' bytes per page
and both models' weights (``runtime/kv_sizing.py``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from myserve.config import Config
from myserve.errors import ConfigError
from myserve.models.checkpoint import resolve_checkpoint
from myserve.models.llama import LlamaModel
from myserve.models.loading import load_model, open_source
from myserve.models.sharding import MeshAxes, axis_mapping
from myserve.models.spec import ModelSpec
from myserve.ops.attention import resolve_backend
from myserve.runtime.mesh import replica_meshes

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DraftModels:
    """The draft model once per data-parallel replica, as ``Deployment.models``."""

    spec: ModelSpec
    models: tuple[LlamaModel, ...]
    mapping: Mapping[str, MeshAxes]


def check_draft(draft: ModelSpec, target: ModelSpec) -> None:
    """Refuse a draft whose tokens the target could not verify: a larger vocabulary (its ids would
    not be the target's), an embedding model, or a multi-host mesh (whose followers replay only the
    target's ops)."""
    if draft.vocab_size > target.vocab_size:
        raise ConfigError(
            f"engine.speculative_model: the draft's vocabulary ({draft.vocab_size} tokens) is larger than the "
            f"target's ({target.vocab_size}): a draft must share the target's tokenizer"
        )
    if jax.process_count() > 1:
        raise ConfigError("engine.speculative_method=draft_model runs on one host (a multi-host mesh: use ngram)")


def load_drafts(config: Config, mesh: Mesh, dtype: jnp.dtype, target: ModelSpec) -> DraftModels | None:
    """The draft model on every replica's slice of ``mesh`` in ``dtype``; None without one."""
    engine = config.engine
    if engine.speculative_method != "draft_model":
        return None
    resolved = resolve_checkpoint(engine.speculative_model)
    source = open_source(resolved)
    spec = source.spec
    check_draft(spec, target)
    mapping = axis_mapping(spec, mesh)
    backend = resolve_backend(
        engine.attention_backend,  # type: ignore[arg-type]
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        page_size=engine.page_size,
        sliding_window="sliding" in spec.layer_types,
        soft_cap=spec.attn_softcap is not None,
    )
    models = tuple(
        load_model(source, m, mapping, dtype, backend, moe_backend=engine.moe_backend) for m in replica_meshes(mesh)
    )
    logger.info(
        "draft model %s (%s, %d layers): %d tokens per draft",
        resolved.path,
        spec.model_type,
        spec.num_layers,
        engine.num_speculative_tokens,
    )
    return DraftModels(spec, models, mapping)
