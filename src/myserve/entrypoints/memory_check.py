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
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Sequence

from myserve.config import Config, too_few_devices
from myserve.errors import ConfigError
from myserve.runtime.footprint import host_available, itemsize_of, spec_and_parameters, weight_bytes

logger = logging.getLogger("myserve.serve")

USABLE_FRACTION = 0.9
"""Of the memory available at start, what the models' weights and KV pools may take together: the
rest is for the steps' activations, XLA's buffers and the processes themselves."""

GIB = 1 << 30


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

    spec, _ = spec_and_parameters(config.model.checkpoint)
    itemsize = itemsize_of(config, where)
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
    kv = pages * page_bytes(spec, engine.page_size, itemsize, kv_cache_dtype=engine.kv_cache_dtype)
    mesh = config.mesh
    weights = weight_bytes(config, where)
    return Footprint(name, weights * mesh.data, kv * mesh.data, mesh.data * mesh.expert * mesh.model)


def visible_devices(where: str) -> int | None:
    """The devices JAX will see on platform ``where``, known without importing it: on CPU the
    count ``XLA_FLAGS`` forces (else ``JAX_NUM_CPU_DEVICES``, else 1); on GPU the entries of
    ``CUDA_VISIBLE_DEVICES``, else the GPUs ``nvidia-smi`` lists; None where it cannot tell (TPU)."""
    if where == "cpu":
        forced = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
        return int(forced.group(1)) if forced else int(os.environ.get("JAX_NUM_CPU_DEVICES", "1") or 1)
    if where == "gpu":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            return len([d for d in visible.split(",") if d.strip()])
        smi = shutil.which("nvidia-smi")
        if smi is None:
            return None
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        return sum(1 for line in out.splitlines() if line.startswith("GPU "))
    return None


def check_mesh_fits(config: Config) -> None:
    """Before anything is downloaded or started: a one-host mesh that needs more devices than the
    platform shows is refused in the words the engine would use (``too_few_devices``)."""
    where = platform()
    have = visible_devices(where)
    for one in config.per_model():
        mesh = one.mesh
        if have is None or mesh.role() != "single":
            continue
        if mesh.data * mesh.expert * mesh.model > have:
            raise ConfigError(too_few_devices(mesh.data, mesh.expert, mesh.model, have, where))


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
