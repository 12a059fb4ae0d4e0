"""Allocation of the paged KV cache on the mesh, and keeping its sharding through the jitted steps."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from myserve.models.spec import ModelSpec
from myserve.ops.paged_attention import KVCache
from myserve.runtime.mesh import kv_cache_sharding


def kv_cache_shape(spec: ModelSpec, num_pages: int, page_size: int) -> tuple[int, int, int, int, int]:
    """Shape of the K (and of the V) array: [layers, kv_heads, pages, page_size, head_dim]."""
    return (spec.num_layers, spec.num_kv_heads, num_pages, page_size, spec.head_dim)


def init_kv_cache(
    spec: ModelSpec, num_pages: int, page_size: int, dtype: jnp.dtype, mesh: Mesh, mapping: Mapping[str, str]
) -> KVCache:
    """A zeroed KV cache, created directly with its sharding (never whole on one device first)."""
    shape = kv_cache_shape(spec, num_pages, page_size)
    sharding = kv_cache_sharding(mapping, mesh)
    zeros = jax.jit(lambda: (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)), out_shardings=(sharding, sharding))
    return KVCache(*zeros())


def kv_cache_bytes(spec: ModelSpec, num_pages: int, page_size: int, dtype: jnp.dtype) -> int:
    """Size of the whole cache (K and V) in bytes, for logs and memory planning."""
    n = 2
    for d in kv_cache_shape(spec, num_pages, page_size):
        n *= d
    return n * jnp.dtype(dtype).itemsize


def constrain_cache(cache: KVCache, sharding: NamedSharding | None) -> KVCache:
    """Inside a jit: the updated cache leaves with the sharding it came in with (no step reshards it)."""
    if sharding is None:
        return cache
    return KVCache(*(jax.lax.with_sharding_constraint(a, sharding) for a in (cache.k, cache.v)))
