"""An engine core for a loaded deployment: its executors, devices and replicas.

The one module of the core that touches JAX: it reads the deployment's mesh and executors and
wraps them as the runtime ``Device`` each replica's runner plans for. The engine core itself
(``core/engine_core.py``) only sees that contract, so its tests run on a fake device.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from myserve.core.adapters import AdapterRegistry
from myserve.core.pooler import resolve_pooler
from myserve.core.replica import Replica, make_replica
from myserve.errors import ConfigError
from myserve.runtime.compile_counter import compile_counts
from myserve.runtime.deployment import Deployment, executor_for, step_buckets
from myserve.runtime.device import Device
from myserve.runtime.device_sleep import DeviceSleep
from myserve.runtime.executor import Executor
from myserve.runtime.generation_config import generation_defaults
from myserve.runtime.image_encoder import ImageEncoder
from myserve.runtime.lora_files import LoraAdapter, empty_adapter, read_adapter
from myserve.runtime.multihost import BroadcastingDevice, stop_followers
from myserve.runtime.weight_update import WeightUpdater
from myserve.wire.images import ImageModel

logger = logging.getLogger(__name__)


def make_executors(dep: Deployment) -> list[Executor]:
    """One executor per replica: its weights, KV cache and penalty state on its slice of the mesh
    (with the step executables the deployment started building early, if it did)."""
    return [
        executor_for(dep.config, model, mesh, dep.mapping, prebuilt=dep.prebuilt[i] if dep.prebuilt else None)
        for i, (model, mesh) in enumerate(zip(dep.models, dep.meshes, strict=True))
    ]


def core_arguments(
    dep: Deployment, executors: Sequence[Executor] | None = None
) -> tuple[list[Replica], dict[str, Any]]:
    """What ``EngineCore`` is built from for a loaded deployment: its replicas, and its keyword
    arguments sized by the engine config. On a multi-host mesh these are the leader's: every
    replica's ops are broadcast to the other processes first (which run ``multihost.follow`` on
    their own executors)."""
    cfg = dep.config.engine
    buckets = step_buckets(dep.config, dep.max_model_len)
    executors = make_executors(dep) if executors is None else executors
    leader = jax.process_count() > 1
    devices: list[Device] = [BroadcastingDevice(e, i) if leader else e for i, e in enumerate(executors)]
    logger.info(
        "engine: %d replica(s) of %d pages x %d tokens, max_num_seqs=%d, token buckets %s, context buckets %s",
        len(executors),
        cfg.num_pages,
        cfg.page_size,
        cfg.max_num_seqs,
        buckets.tokens,
        tuple(w * cfg.page_size for w in buckets.widths),
    )
    registry: AdapterRegistry | None = None
    zeros: tuple[np.ndarray, ...] = ()
    if cfg.enable_lora:
        spec = dep.spec

        def read(name: str, path: str) -> LoraAdapter:
            return read_adapter(name, path, spec, cfg.max_lora_rank)

        registry = AdapterRegistry(cfg.max_cpu_loras or cfg.max_loras, read)
        for module in cfg.lora_modules:
            name, path = module.split("=", 1)
            registry.register(name, path)
        zeros = empty_adapter(spec, cfg.max_lora_rank).flat()
    eos = dep.tokenizer.eos_token_ids
    # A draft model's executor per replica: its weights and its own cache of the same page ids.
    drafts: list[Device | None] = [None] * len(devices)
    if dep.draft is not None:
        pairs = zip(dep.draft.models, dep.meshes, strict=True)
        drafts = [executor_for(dep.config, model, mesh, dep.draft.mapping, host_tier=False) for model, mesh in pairs]
    replicas = [
        make_replica(cfg, device, buckets, eos, registry, zeros, d, _host_pages(e), images=dep.vision is not None)
        for device, d, e in zip(devices, drafts, executors, strict=True)
    ]
    return replicas, dict(
        vocab_size=dep.spec.vocab_size,
        num_pages=cfg.num_pages,
        max_model_len=dep.max_model_len,
        max_waiting=cfg.max_waiting,
        on_shutdown=stop_followers if leader else None,
        # A speculating decode needs its sequence's tokens known: its steps are read before the next is planned.
        async_scheduling=cfg.async_scheduling and cfg.speculative_method == "none",
        compile_counts=compile_counts,
        pooler=resolve_pooler(dep.config.model, dep.checkpoint_dir, dep.spec.hidden_size),
        seed=cfg.seed,
        generation_defaults=generation_defaults(dep.config.model, dep.checkpoint_dir),
        adapters=registry,
        memory_utilization=cfg.gpu_memory_utilization,
        weight_loader=_weight_loader(dep, executors),
        sleeper=_sleeper(dep, executors),
        image_encoder=_image_encoder(dep),
        max_images=dep.config.model.images_per_prompt,
        image_model=_image_model(dep),
    )


def _image_model(dep: Deployment) -> ImageModel | None:
    """What the front end needs to prepare a vision-language model's images (None: text only)."""
    if dep.vision is None or dep.checkpoint_dir is None:
        return None
    spec = dep.vision[0]
    hf = dep.tokenizer.hf
    text = spec.prompt_text(lambda token: str(hf.convert_ids_to_tokens(token)))
    return ImageModel(str(dep.checkpoint_dir), spec.image_token_id, spec.tokens_per_image, *text, spec.merge_size)


def _image_encoder(dep: Deployment) -> ImageEncoder | None:
    """A vision-language model's tower on the first replica's devices (its embeddings go to the host:
    every replica's steps take them from there), its executable built."""
    if dep.vision is None:
        return None
    encoder = ImageEncoder(*dep.vision, dep.meshes[0], checkpoint_dir=dep.checkpoint_dir)
    encoder.warm_up()
    return encoder


def _host_pages(executor: Executor) -> int:
    """The pages of ``executor``'s host tier (0: none): the core's index of it has as many slots."""
    return 0 if executor.host_kv is None else executor.host_kv.num_slots


def _sleeper(dep: Deployment, executors: Sequence[Executor]) -> DeviceSleep | None:
    """What frees and refills the devices (``engine.enable_sleep_mode``); one host only, and not
    beside a draft model (whose executor would keep its arrays)."""
    engine = dep.config.engine
    if not engine.enable_sleep_mode:
        return None
    if jax.process_count() > 1:
        raise ConfigError("engine.enable_sleep_mode: sleep mode runs on one host")
    if engine.speculative_method == "draft_model":
        raise ConfigError("engine.enable_sleep_mode: not with a draft model (speculative_method draft_model)")
    return DeviceSleep(executors, WeightUpdater(dep, executors))


def _weight_loader(dep: Deployment, executors: Sequence[Executor]) -> WeightUpdater | None:
    """What reads new versions of the weights while serving (``engine.enable_weight_updates``);
    refused on a multi-host mesh, whose followers would need the new weights too."""
    if not dep.config.engine.enable_weight_updates:
        return None
    if jax.process_count() > 1:
        raise ConfigError("engine.enable_weight_updates: live weight updates run on one host")
    return WeightUpdater(dep, executors)
