"""Allocation of the paged KV cache on the mesh, and keeping its sharding through the jitted steps.

Two layouts, picked by the attention backend (``ops/paged_cache.py``): the reference path's
head-major K and V arrays (with per-token scales when quantized) and the TPU kernel's one array
with K and V interleaved per head. Both hold the same bytes per page, less the scales.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from myserve.models.sharding import MeshAxes, kv_cache_sharding
from myserve.models.spec import ModelSpec
from myserve.ops.paged_cache import KernelKVCache, KVCache, is_quantized, stored_dtype

Cache = KVCache | KernelKVCache
"""The paged KV cache in either layout."""


ArraySpec = tuple[tuple[int, ...], jnp.dtype]
"""One cache array's shape and dtype."""


def cache_layout(
    spec: ModelSpec, num_pages: int, page_size: int, dtype: jnp.dtype, backend: str = "reference"
) -> tuple[ArraySpec, ...]:
    """Shape and dtype of each cache array for a pool of ``num_pages`` in ``dtype`` (the model's, or
    a quantized ``engine.kv_cache_dtype``): the reference's K and V [layers, kv_heads, pages + 1,
    page_size, head_dim] (with its spare page, ``KVCache.spare_page``), quantized with their scales
    [..., page_size, 1] bf16; or the kernel's one array [layers, pages, page_size, 2 * kv_heads,
    head_dim] (no scales: the TPU kernel takes one per cache)."""
    dtype = jnp.dtype(dtype)
    if backend == "pallas":
        return (((spec.num_layers, num_pages, page_size, 2 * spec.num_kv_heads, spec.head_dim), dtype),)
    shape = (spec.num_layers, spec.num_kv_heads, num_pages + 1, page_size, spec.head_dim)
    stored = stored_dtype(dtype, backend)  # fp8 on CPU: its bits (ops/paged_cache.py says why)
    arrays: list[ArraySpec] = [(shape, stored), (shape, stored)]
    if is_quantized(dtype):
        arrays += [((*shape[:-1], 1), jnp.dtype(jnp.bfloat16))] * 2
    return tuple(arrays)


def make_cache(arrays: list[jax.Array], backend: str = "reference", dtype: jnp.dtype | None = None) -> Cache:
    """The cache of ``backend``'s layout around its arrays (``cache_layout``'s order) for a pool
    in ``dtype`` (default: the arrays'; an fp8 one held as bits names it)."""
    if backend == "pallas":
        return KernelKVCache(arrays[0])
    held_as_bits = dtype is not None and jnp.dtype(dtype) != arrays[0].dtype
    return KVCache.of(arrays, jnp.dtype(dtype).name if held_as_bits else None)


def init_kv_cache(
    spec: ModelSpec,
    num_pages: int,
    page_size: int,
    dtype: jnp.dtype,
    mesh: Mesh,
    mapping: Mapping[str, MeshAxes],
    backend: str = "reference",
    build: Callable[..., Any] | None = None,
) -> Cache:
    """A zeroed KV cache in ``dtype`` (``cache_layout``), created directly with its sharding (never
    whole on one device first). ``build``: how to run ``zero_arrays`` (an executor's ``SmallOps``,
    which loads it from the step cache: a warm start compiles nothing); by default it is jitted here."""
    layout = cache_layout(spec, num_pages, page_size, dtype, backend)
    static = (layout, kv_cache_sharding(mapping, mesh, backend))
    arrays = build(zero_arrays, (), static) if build is not None else zero_arrays(*static)
    return make_cache(list(arrays), backend, dtype)


@functools.partial(jax.jit, static_argnums=(0, 1))
def zero_arrays(layout: tuple[ArraySpec, ...], sharding: NamedSharding) -> list[jax.Array]:
    """Zeroed arrays of ``layout``'s shapes and dtypes made on the devices in ``sharding``, each its own shards."""
    return [jax.lax.with_sharding_constraint(jnp.zeros(shape, dtype), sharding) for shape, dtype in layout]


def constrain_cache(cache: Cache, sharding: NamedSharding | None) -> Cache:
    """Inside a jit: the updated cache leaves with the sharding it came in with (no step reshards it)."""
    if sharding is None:
        return cache
    return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, sharding), cache)  # type: ignore[no-any-return]
