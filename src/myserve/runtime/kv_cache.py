"""Allocation of the paged KV cache on the mesh."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from myserve.models.spec import ModelSpec
from myserve.runtime.mesh import kv_cache_sharding


def kv_cache_shape(spec: ModelSpec, num_pages: int, page_size: int) -> tuple[int, int, int, int, int]:
    """[layers, pages, page_size, 2 * kv_heads, head_dim] (K and V interleaved per head)."""
    return (spec.num_layers, num_pages, page_size, 2 * spec.num_kv_heads, spec.head_dim)


def init_kv_cache(
    spec: ModelSpec, num_pages: int, page_size: int, dtype: jnp.dtype, mesh: Mesh, mapping: Mapping[str, str]
) -> jax.Array:
    """A zeroed KV cache, created directly with its sharding (never whole on one device first)."""
    shape = kv_cache_shape(spec, num_pages, page_size)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=kv_cache_sharding(mapping, mesh))()


def kv_cache_bytes(spec: ModelSpec, num_pages: int, page_size: int, dtype: jnp.dtype) -> int:
    """Size of the whole cache in bytes, for logs and memory planning."""
    n = 1
    for d in kv_cache_shape(spec, num_pages, page_size):
        n *= d
    return n * jnp.dtype(dtype).itemsize
