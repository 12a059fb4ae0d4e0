"""Reading a new version of the served weights while serving (``core/engine_weights.py``'s loader).

The version is read from any checkpoint the server reads (an HF directory or hub id, a GGUF file,
an Orbax or Levanter checkpoint: ``models/native_checkpoint.py``)
onto each replica's devices, with the deployment's dtype, narrow-weight format, attention backend
and sharding rules: the same shapes, dtypes and shardings as the served weights, so every step
executable built at warmup runs it and nothing compiles. Anything else is refused before it is
installed, naming what differs: another architecture (the first differing field of the model's
configuration), a missing or unreadable file, an array of another shape or dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import jax

from myserve.errors import MyserveError
from myserve.models.checkpoint import resolve_checkpoint
from myserve.models.llama import LlamaModel
from myserve.models.loading import load_model, open_source
from myserve.models.native_checkpoint import NativeSource, is_native_checkpoint
from myserve.models.placer import TensorSource
from myserve.runtime.deployment import Deployment, lora_stacks
from myserve.runtime.executor import Executor


class WeightsMismatch(MyserveError):
    """A new version of the weights is not the served model's shape: another architecture, or an
    array of another shape or dtype."""


class WeightUpdater:
    """``core.engine_weights.WeightLoader`` for a loaded deployment and its replicas' executors."""

    def __init__(self, dep: Deployment, executors: Sequence[Executor]):
        self.dep = dep
        self.executors = list(executors)

    def load(self, path: str) -> list[LlamaModel]:
        """The weights at ``path`` on every replica's devices (any thread); raises
        ``MyserveError`` naming what is wrong."""
        if is_native_checkpoint(Path(path).expanduser()):  # a trainer's: the served model's configuration
            source: TensorSource = NativeSource(Path(path).expanduser(), self.dep.spec)
        else:
            source = open_source(resolve_checkpoint(path))
            _check_spec(source.spec, self.dep.spec, path)
        cfg, served = self.dep.config, self.dep.model
        models = [
            load_model(
                source,
                mesh,
                self.dep.mapping,
                self.dep.dtype,
                served.attention_backend,
                cfg.model.quantization,
                group_size=cfg.model.quantization_group_size,
                lora=lora_stacks(cfg),
                moe_backend=cfg.engine.moe_backend,
                quantized_matmul=cfg.engine.quantized_matmul,
            )
            for mesh in self.dep.meshes
        ]
        for model, executor in zip(models, self.executors, strict=True):
            _check_arrays(model, executor.model, path)
        return models

    def install(self, staged: object, slot: int) -> None:
        """Every replica's weight slot ``slot`` holds ``staged`` (``load``'s models)."""
        models = staged
        assert isinstance(models, list)
        for model, executor in zip(models, self.executors, strict=True):
            executor.install_weights(slot, model)

    def drop(self, slot: int) -> None:
        """Every replica lets weight slot ``slot`` go."""
        for executor in self.executors:
            executor.drop_weights(slot)


def _check_spec(new: object, served: object, path: str) -> None:
    """Refuse another architecture, naming the first field of the model's configuration that differs."""
    assert dataclasses.is_dataclass(new) and dataclasses.is_dataclass(served)
    for field in dataclasses.fields(served):
        mine, theirs = getattr(served, field.name), getattr(new, field.name)
        if mine != theirs:
            raise WeightsMismatch(f"{path}: not the served model: its {field.name} is {theirs!r}, the served {mine!r}")


def _check_arrays(new: LlamaModel, served: LlamaModel, path: str) -> None:
    """Refuse an array of another shape, dtype or sharding than the served one (it would compile)."""
    theirs = jax.tree_util.tree_leaves_with_path(new)
    mine = jax.tree_util.tree_leaves_with_path(served)
    if len(theirs) != len(mine):
        raise WeightsMismatch(f"{path}: {len(theirs)} arrays, the served model has {len(mine)}")
    for (key, a), (_, b) in zip(theirs, mine, strict=True):
        if (a.shape, a.dtype) != (b.shape, b.dtype) or a.sharding != b.sharding:
            name = jax.tree_util.keystr(key)
            raise WeightsMismatch(
                f"{path}: array {name} is {a.dtype}{list(a.shape)}, the served one {b.dtype}{list(b.shape)}"
            )
