"""How many KV cache pages a deployment gets when ``engine.num_pages`` is null: sized from memory,
as vLLM sizes its KV cache, before any weight is read (the step executables are built for the
pool's shape while the weights load, so the size must be known first).

- ``engine.kv_cache_memory_bytes``: the pool's bytes per device, on any platform.
- GPU/TPU: ``engine.gpu_memory_utilization`` of each device's memory holds the weights, the KV
  pool and the steps' activations; the pool takes what the weights' bytes (from the checkpoint's
  headers) and an estimate of the activations (``activation_bytes``) leave. On a GPU the core
  process asks XLA's allocator for that fraction of the device (``XLA_PYTHON_CLIENT_MEM_FRACTION``,
  unless set) instead of its default 75 %. After warmup the engine logs the peak the devices'
  allocators measured against that share, with a warning when it went over (``peak_report``).
- CPU: ``VLLM_CPU_KVCACHE_SPACE`` GiB when set (vLLM's CPU variable), else 4 GiB or a quarter of
  the available memory, whichever is less, and never more pages than ``max_num_seqs`` sequences
  of ``max_model_len`` tokens can hold (host memory is shared with everything else).

A ``max_model_len`` longer than the pool holds is refused in one line naming both and the flags
that change them. Everything here is arithmetic on numbers the caller measured (tests need no
device).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence

from myserve.config import EngineConfig
from myserve.errors import ConfigError
from myserve.models.spec import ModelSpec

GIB = 1 << 30
CPU_DEFAULT_BYTES = 4 * GIB
"""The CPU pool's budget when nothing sets it (vLLM's CPU default), at most a quarter of what is available."""
XLA_GPU_DEFAULT_FRACTION = 0.75
"""The share of a GPU XLA's allocator takes when ``XLA_PYTHON_CLIENT_MEM_FRACTION`` is unset."""


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What sized the pool, for the start-up log line."""

    pages: int
    page_bytes: int
    """Bytes of one page on one device (K and V of every layer)."""
    budget: int
    """Bytes the pool was given per device."""
    source: str
    """Where the budget came from, in words."""


def page_bytes(
    spec: ModelSpec, page_size: int, itemsize: int, model_shards: int = 1, kv_cache_dtype: str = "auto"
) -> int:
    """One page's K and V over every layer, on one device: the KV heads split over the mesh's model
    axis (replicated when there are fewer heads than devices). ``itemsize``: the model dtype's bytes,
    which the cache holds unless ``kv_cache_dtype`` quantizes it: then a byte per value and a 2-byte
    scale per token and head (``ops/paged_cache.py``)."""
    heads = -(-spec.num_kv_heads // model_shards)
    per_head = spec.head_dim * itemsize if kv_cache_dtype == "auto" else spec.head_dim + 2
    return 2 * spec.num_layers * heads * page_size * per_head


def host_tier_pages(engine: EngineConfig, spec: ModelSpec, itemsize: int, replicas: int = 1) -> int:
    """Pages of one replica's host tier: ``engine.kv_offloading_size`` GiB split over the
    data-parallel replicas, at a whole page's bytes (every KV head: the host holds them all)."""
    size = int(engine.kv_offloading_size * 2**30) // max(replicas, 1)
    return size // page_bytes(spec, engine.page_size, itemsize, 1, engine.kv_cache_dtype)


def activation_bytes(spec: ModelSpec, tokens: int, rows: int, itemsize: int, model_shards: int = 1) -> int:
    """An estimate of the largest step's live temporaries on one device: a few hidden-state-sized
    buffers, the MLP's gate and up projections and the attention's queries for ``tokens`` tokens,
    float32 logits of ``rows`` sampling rows (and their sorted copy and probabilities), and the
    float32 logits of every token when a step scores its prompt (echo, prompt logprobs)."""
    per_token = 6 * spec.hidden_size + (3 * spec.intermediate_size + 2 * spec.num_heads * spec.head_dim) // model_shards
    layers = tokens * per_token * max(itemsize, 4)
    logits = 4 * (3 * rows + tokens) * spec.vocab_size
    return layers + logits


def gpu_allocator_fraction(engine: EngineConfig, env: Mapping[str, str] | None = None) -> str | None:
    """The ``XLA_PYTHON_CLIENT_MEM_FRACTION`` a GPU core process should start JAX with: the
    utilization asked for, when the pool is sized from it and the variable is not set; else None."""
    env = os.environ if env is None else env
    if engine.num_pages is not None or engine.kv_cache_memory_bytes is not None:
        return None
    if "XLA_PYTHON_CLIENT_MEM_FRACTION" in env:
        return None
    return f"{engine.gpu_memory_utilization:.4f}"


def use_gpu_share(engine: EngineConfig) -> None:
    """Before JAX starts (a core process, or the one process): let XLA's GPU allocator take the
    share of the card the pool is sized from (``gpu_allocator_fraction``; no effect elsewhere)."""
    fraction = gpu_allocator_fraction(engine)
    if fraction is not None:
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = fraction


def device_budget(
    engine: EngineConfig, platform: str, bytes_limit: int, env: Mapping[str, str] | None = None
) -> tuple[int, str]:
    """Bytes per device for weights, KV and activations, and how that was decided. ``bytes_limit``:
    what the device's allocator may hand out (``Device.memory_stats()['bytes_limit']``); on a GPU
    that is ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the card, so the card is that over the fraction."""
    env = os.environ if env is None else env
    util = engine.gpu_memory_utilization
    if platform == "gpu":
        fraction = float(env.get("XLA_PYTHON_CLIENT_MEM_FRACTION", XLA_GPU_DEFAULT_FRACTION))
        total = int(bytes_limit / fraction) if 0 < fraction <= 1 else bytes_limit
        budget = min(int(util * total), bytes_limit)
        return budget, f"gpu_memory_utilization {util} of {total / GIB:.1f} GiB"
    return int(util * bytes_limit), f"gpu_memory_utilization {util} of {bytes_limit / GIB:.1f} GiB"


def plan_pages(
    engine: EngineConfig,
    spec: ModelSpec,
    *,
    platform: str,
    itemsize: int,
    max_model_len: int,
    token_budget: int,
    model_shards: int = 1,
    weight_bytes: int = 0,
    bytes_limit: int | None = None,
    host_available: int | None = None,
    env: Mapping[str, str] | None = None,
    extra_page_bytes: int = 0,
) -> MemoryPlan:
    """The pool for ``engine`` (whose ``num_pages`` is null) on ``platform``. ``weight_bytes``: the
    weights' bytes per device; ``bytes_limit``: the device allocator's limit (GPU/TPU);
    ``host_available``: the host's available memory (CPU); ``extra_page_bytes``: what each page
    costs beyond the model's K/V (a draft model's cache of the same page ids). Raises ``ConfigError`` when the pool
    would not hold one sequence of ``max_model_len`` tokens."""
    env = os.environ if env is None else env
    one_page = page_bytes(spec, engine.page_size, itemsize, model_shards, engine.kv_cache_dtype) + extra_page_bytes
    cap = None
    if engine.kv_cache_memory_bytes is not None:
        budget, source = engine.kv_cache_memory_bytes, "kv_cache_memory_bytes"
        flag = "--kv-cache-memory-bytes"
    elif platform == "cpu":
        flag = "--kv-cache-memory-bytes"
        if env.get("VLLM_CPU_KVCACHE_SPACE"):
            budget, source = int(float(env["VLLM_CPU_KVCACHE_SPACE"]) * GIB), "VLLM_CPU_KVCACHE_SPACE"
        else:
            available = host_available if host_available is not None else CPU_DEFAULT_BYTES * 4
            budget = min(CPU_DEFAULT_BYTES, available // 4)
            source = "the CPU default (4 GiB or a quarter of the available memory)"
            per_sequence = -(-max_model_len // engine.page_size)
            cap = engine.max_num_seqs * per_sequence + 1
    else:
        if bytes_limit is None:
            raise ConfigError(
                f"the {platform} device does not report its memory: set engine.num_pages or --kv-cache-memory-bytes"
            )
        flag = "--gpu-memory-utilization"
        usable, source = device_budget(engine, platform, bytes_limit, env)
        rows = engine.max_num_seqs + 1
        taken = weight_bytes + activation_bytes(spec, token_budget, rows, itemsize, model_shards)
        budget = usable - taken
        activations = (taken - weight_bytes) / GIB
        source += f", less {weight_bytes / GIB:.2f} GiB of weights and {activations:.2f} GiB for activations"
    pages = max(budget, 0) // one_page
    if cap is not None:
        pages = min(pages, cap)
    if pages * engine.page_size < max_model_len:
        fits = pages * engine.page_size
        raise ConfigError(
            f"max_model_len ({max_model_len} tokens) is longer than the KV cache holds ({fits} tokens in "
            f"{max(budget, 0) / GIB:.2f} GiB, from {source}): raise {flag} or lower --max-model-len"
        )
    return MemoryPlan(pages, one_page, budget, source)


def peak_report(stats: Sequence[Mapping[str, int]], utilization: float) -> tuple[str, bool] | None:
    """The post-warmup line on device memory: the largest ``peak_bytes_in_use`` of ``stats`` (each
    device's allocator figures) against ``utilization`` of the device (the allocator's
    ``bytes_limit`` is that share when the core set ``XLA_PYTHON_CLIENT_MEM_FRACTION``), and whether
    the peak went over; None where no device reports a peak (the CPU)."""
    reported = [s for s in stats if s.get("peak_bytes_in_use")]
    if not reported:
        return None
    peak = max(s["peak_bytes_in_use"] for s in reported)
    limits = [s["bytes_limit"] for s in reported if s.get("bytes_limit")]
    if not limits:
        return f"device memory after warmup: peak {peak / GIB:.2f} GiB", False
    allowed = min(limits)
    over = peak > allowed
    line = (
        f"device memory after warmup: peak {peak / GIB:.2f} GiB of the {allowed / GIB:.2f} GiB "
        f"gpu_memory_utilization {utilization} allows"
    )
    if over:
        line += (
            ": over it (raise --gpu-memory-utilization, or lower --kv-cache-memory-bytes or --max-num-batched-tokens)"
        )
    return line, over
