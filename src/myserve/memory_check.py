"""Whether the models of a several-model server fit in memory together, checked by ``serve`` before
any engine core starts, so that the last one to load is not killed for memory halfway through.

Each model's footprint is estimated from its checkpoint's header and its config, without JAX (the
front-end process never imports it): weights = parameters x the bytes of its dtype (1 with int8
matmuls), KV pool = pages x page size x layers x K and V x KV heads x head dim x the dtype's
bytes, both once per data-parallel replica. The models go into the memory in config order; the
first that does not fit is named in a one-line ``ConfigError`` (``serve`` exits 2). Where the
models live decides what "memory" is: host RAM (``MemAvailable``) on CPU, the first GPU's free
memory (``nvidia-smi``) on GPU, each model's share being its footprint over its mesh's devices.
Several models on TPU are refused: each core is a process, and TPU chips are not shared between
processes.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import math
import os
import shutil
import struct
import subprocess
from collections.abc import Sequence
from pathlib import Path

from myserve.config import Config
from myserve.errors import CheckpointError, ConfigError
from myserve.models.checkpoint import resolve_checkpoint
from myserve.models.gguf import GGUFSource, resolve_quantization
from myserve.models.gguf_file import read_gguf
from myserve.models.spec import ModelSpec, spec_from_hf_config

logger = logging.getLogger("myserve.serve")

USABLE_FRACTION = 0.9
"""Of the memory available at start, what the models' weights and KV pools may take together: the
rest is for the steps' activations, XLA's buffers and the processes themselves."""

GIB = 1 << 30
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class Footprint:
    """A model's estimated memory, in bytes: weights and KV pool (all its replicas')."""

    name: str
    weights: int
    kv_cache: int
    devices: int
    """Devices of its mesh (data x expert x model), over which the bytes spread on an accelerator."""

    @property
    def total(self) -> int:
        """Weights plus KV pool."""
        return self.weights + self.kv_cache


def platform() -> str:
    """The JAX platform the cores will run on, known without importing JAX: ``JAX_PLATFORMS``' first
    entry if set, else ``tpu`` or ``gpu`` when that plugin is installed (as JAX prefers them), else ``cpu``."""
    chosen = os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if chosen:
        return "gpu" if chosen in ("cuda", "rocm") else chosen
    if importlib.util.find_spec("libtpu") is not None:
        return "tpu"
    if any(importlib.util.find_spec(m) is not None for m in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
        return "gpu"
    return "cpu"


def footprint(config: Config, name: str, where: str) -> Footprint:
    """The estimated footprint of the one model of ``config`` on platform ``where``."""
    from myserve.runtime.kv_sizing import page_bytes, plan_pages

    spec, _ = _spec_and_parameters(config.model.checkpoint)
    itemsize = _itemsize(config, where)
    engine = config.engine
    pages = engine.num_pages
    if pages is None:
        if where != "cpu" and engine.kv_cache_memory_bytes is None:
            raise ConfigError(
                f"model {name!r}: several models on one {where} need each model's engine.num_pages or "
                "engine.kv_cache_memory_bytes (gpu_memory_utilization sizes the pool of a model alone on its devices)"
            )
        max_len = config.model.max_model_len or spec.max_position_embeddings
        plan = plan_pages(
            engine,
            spec,
            platform="cpu",
            itemsize=itemsize,
            max_model_len=max_len,
            token_budget=engine.token_budget(where),
            host_available=host_available(),
        )
        pages = plan.pages
    kv = pages * page_bytes(spec, engine.page_size, itemsize)
    mesh = config.mesh
    weights = weight_bytes(config, where)
    return Footprint(name, weights * mesh.data, kv * mesh.data, mesh.data * mesh.expert * mesh.model)


def weight_bytes(config: Config, where: str) -> int:
    """One replica's weights of ``config``'s model on platform ``where``, in bytes, from the
    checkpoint's headers: parameters x the bytes of the dtype (or of its narrow weights)."""
    _, parameters = _spec_and_parameters(config.model.checkpoint)
    return int(parameters * _PARAMETER_BYTES.get(_quantization(config, where), _itemsize(config, where)))


def _itemsize(config: Config, where: str) -> int:
    dtype = config.model.dtype
    return _DTYPE_BYTES["float32" if where == "cpu" else "bfloat16"] if dtype == "auto" else _DTYPE_BYTES[dtype]


# Bytes per parameter of narrow weights, scales included (int8 per channel; int4 and GGUF's Q4_1 in
# groups of 32 with float16 scale and offset: 20 bytes per 32; W8A8 per channel).
_PARAMETER_BYTES = {"int8": 1.07, "int4": 0.63, "w8a8": 1.0}


def _quantization(config: Config, where: str) -> str:
    """``model.quantization`` as the deployment will resolve it."""
    resolved = resolve_checkpoint(config.model.checkpoint)
    source = GGUFSource(resolved.path) if resolved.kind == "gguf" else None
    return resolve_quantization(config.model.quantization, source, where)


def available_memory(where: str) -> tuple[int, str] | None:
    """Bytes the models may use on platform ``where``, and what that memory is; None when unknown."""
    if where == "cpu":
        return host_available(), "host memory"
    if where == "gpu":
        free = _gpu_free()
        return None if free is None else (free, "free memory of GPU 0")
    return None


def check_memory(
    configs: Sequence[Config], names: Sequence[str], available: tuple[int, str] | None | bool = True
) -> list[Footprint]:
    """Raise ``ConfigError`` naming the first model (in order) that does not fit beside the ones
    before it; returns the footprints. ``available``: (bytes, what) to check against instead of the
    platform's (tests), True = the platform's. Refuses several models on TPU."""
    where = platform()
    if where == "tpu":
        raise ConfigError(
            "several models need a platform whose devices several processes can share (CPU, GPU); "
            "each model's engine core is a process of its own, and TPU chips are not shared between processes"
        )
    prints = [footprint(config, name, where) for config, name in zip(configs, names, strict=True)]
    found = available_memory(where) if available is True else available
    if not found:
        logger.warning("memory check skipped: the memory available on %s is unknown", where)
        return prints
    limit, what = found
    usable = int(limit * USABLE_FRACTION)
    used = 0
    for fp in prints:
        need = fp.total if where == "cpu" else -(-fp.total // fp.devices)
        if used + need > usable:
            left = max(usable - used, 0)
            raise ConfigError(
                f"model {fp.name!r} does not fit in memory: it needs {_gib(need)} (weights {_gib(fp.weights)} + "
                f"KV cache {_gib(fp.kv_cache)}) but {_gib(left)} of the {_gib(usable)} usable "
                f"({USABLE_FRACTION:.0%} of {_gib(limit)} {what}) are left after the models before it; "
                f"lower its engine.num_pages or serve fewer models"
            )
        used += need
    logger.info("memory: the %d models need about %s of %s usable %s", len(prints), _gib(used), _gib(usable), what)
    return prints


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _spec_and_parameters(checkpoint: str | None) -> tuple[ModelSpec, int]:
    """A checkpoint's architecture and parameter count, read from its headers (no tensor is read)."""
    resolved = resolve_checkpoint(checkpoint)
    if resolved.kind == "gguf":
        tensors = read_gguf(resolved.path).tensors.values()
        return GGUFSource(resolved.path).spec, sum(math.prod(t.shape) for t in tensors)
    config_path = resolved.path / "config.json"
    try:
        spec = spec_from_hf_config(json.loads(config_path.read_text()), str(config_path))
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{config_path}: cannot read: {e}") from None
    return spec, sum(_safetensors_parameters(f) for f in sorted(resolved.path.glob("*.safetensors")))


def _safetensors_parameters(path: Path) -> int:
    """Elements of every tensor in a safetensors file, from its JSON header."""
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file: {e}") from None
    return sum(math.prod(t["shape"]) for key, t in header.items() if key != "__metadata__")


def host_available() -> int:
    """``MemAvailable`` (what can be allocated without swapping), or free pages where there is no /proc."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _gpu_free() -> int | None:
    """Free memory of the first visible GPU, from ``nvidia-smi``; None without it."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    try:
        out = subprocess.run(
            [smi, "--query-gpu=memory.free", "--format=csv,noheader,nounits", "-i", visible],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
        return int(out.split()[0]) * (1 << 20)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
