"""Allocation of the paged KV cache on the mesh, and keeping its sharding through the jitted steps.

Two layouts, picked by the attention backend (``ops/paged_cache.py``): the reference path's
head-major K and V arrays and the TPU kernel's one array with K and V interleaved per head. Both
hold the same bytes per page.
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
from myserve.ops.paged_cache import KernelKVCache, KVCache

Cache = KVCache | KernelKVCache
"""The paged KV cache in either layout."""


def kv_cache_shape(spec: ModelSpec, num_pages: int, page_size: int, backend: str = "reference") -> tuple[int, ...]:
    """Shape of each cache array for a pool of ``num_pages``: the reference's K (and V) [layers,
    kv_heads, pages + 1, page_size, head_dim] (with its spare page, ``KVCache.spare_page``), or the
    kernel's [layers, pages, page_size, 2 * kv_heads, head_dim]."""
    if backend == "pallas":
        return (spec.num_layers, num_pages, page_size, 2 * spec.num_kv_heads, spec.head_dim)
    return (spec.num_layers, spec.num_kv_heads, num_pages + 1, page_size, spec.head_dim)


def make_cache(arrays: list[jax.Array], backend: str = "reference") -> Cache:
    """The cache of ``backend``'s layout around its arrays (one for the kernel, K and V otherwise)."""
    return KernelKVCache(arrays[0]) if backend == "pallas" else KVCache(arrays[0], arrays[1])


def cache_arrays(backend: str = "reference") -> int:
    """How many arrays the cache of ``backend`` has."""
    return 1 if backend == "pallas" else 2


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
    """A zeroed KV cache, created directly with its sharding (never whole on one device first).
    ``build``: how to run ``zero_arrays`` (an executor's ``SmallOps``, which loads it from the step
    cache: a warm start compiles nothing); by default it is jitted here."""
    shape = kv_cache_shape(spec, num_pages, page_size, backend)
    static = (shape, jnp.dtype(dtype), cache_arrays(backend), kv_cache_sharding(mapping, mesh, backend))
    arrays = build(zero_arrays, (), static) if build is not None else zero_arrays(*static)
    return make_cache(list(arrays), backend)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def zero_arrays(shape: tuple[int, ...], dtype: jnp.dtype, n: int, sharding: NamedSharding) -> list[jax.Array]:
    """``n`` zeroed arrays of ``shape`` made on the devices in ``sharding``, each its own shards."""
    return [jax.lax.with_sharding_constraint(jnp.zeros(shape, dtype), sharding) for _ in range(n)]


def constrain_cache(cache: Cache, sharding: NamedSharding | None) -> Cache:
    """Inside a jit: the updated cache leaves with the sharding it came in with (no step reshards it)."""
    if sharding is None:
        return cache
    return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, sharding), cache)  # type: ignore[no-any-return]
