"""The executor's small ops, each jitted and built once at warmup (``SmallOps``): a page copy,
penalty-slot writes, a LoRA adapter's write into its device slot, and the host tier's page
gather and scatter."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from myserve.ops.paged_cache import KernelKVCache
from myserve.runtime.compile_counter import count_loaded, thread_cache_hits
from myserve.runtime.kv_cache import Cache, constrain_cache
from myserve.runtime.step_cache import StepCache


class SmallOps:
    """The small ops' executables of one executor, each built on its first call (warmup's), then
    called directly: a jitted call would compile again whenever its inputs' sharding objects change
    (a loaded step returns equivalent but other ones than a compiled one), and nothing may compile
    after warmup. Built like a step: loaded from the step cache, else compiled and stored, so that
    a warm start compiles nothing."""

    def __init__(self, step_cache: StepCache | None, devices: Sequence[jax.Device]):
        self._step_cache = step_cache
        self._devices = tuple(devices)
        self._built: dict[Any, Any] = {}

    def __call__(self, fn: Any, args: tuple[Any, ...], static: tuple[Any, ...] = ()) -> Any:
        """``fn`` (one of this module's jitted ops) on ``args``, its ``static`` arguments after them."""
        compiled = self._built.get(fn)
        if compiled is None:
            compiled = self._built[fn] = self._build(fn, args, static)
        return compiled(*args)

    def _build(self, fn: Any, args: tuple[Any, ...], static: tuple[Any, ...]) -> Any:
        # Tracing first is cheap (milliseconds) and gives the output tree a load needs.
        lowered = fn.lower(*args, *static)
        cache = self._step_cache
        if cache is None:
            return lowered.compile()
        entry = StepCache.key(("small", fn.__name__, *static), args)
        if cache.has(entry):
            loaded = cache.load(entry, args, lowered.out_tree, self._devices)
            if loaded is not None:
                count_loaded()
                return loaded
        hits = thread_cache_hits()
        compiled = lowered.compile()
        if thread_cache_hits() == hits:  # never store what JAX's own cache handed back (executables.py)
            cache.store(entry, compiled, args, lowered.out_tree)
        return compiled


@functools.partial(jax.jit, donate_argnums=0, static_argnums=3)
def copy_page(kv_cache: Cache, src: jax.Array, dst: jax.Array, sharding: NamedSharding) -> Cache:
    """Page ``dst`` of every layer's K and V becomes a copy of page ``src`` (copy-on-write)."""
    if isinstance(kv_cache, KernelKVCache):  # [layers, pages, ...]
        copied: Cache = KernelKVCache(kv_cache.kv.at[:, dst].set(kv_cache.kv[:, src]))
    else:  # [layers, kv_heads, pages, ...]: K, V and (quantized) their scales
        copied = jax.tree.map(lambda a: a.at[:, :, dst].set(a[:, :, src]), kv_cache)
    return constrain_cache(copied, sharding)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def write_slot(
    counts: jax.Array, prompt_mask: jax.Array, slot: jax.Array, ids: jax.Array, n: jax.Array, to_prompt: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Penalty slot ``slot``: the first ``n`` of ``ids`` into its prompt mask, or its counts."""
    valid = jnp.arange(ids.shape[0]) < n
    prompt_mask = prompt_mask.at[slot, ids].max(valid & to_prompt)
    counts = counts.at[slot, ids].add((valid & ~to_prompt).astype(counts.dtype))
    return counts, prompt_mask


@functools.partial(jax.jit, donate_argnums=0)
def write_adapter(
    stacks: tuple[jax.Array, ...], slot: jax.Array, arrays: tuple[jax.Array, ...]
) -> tuple[jax.Array, ...]:
    """Each LoRA stack with an adapter's array in slot ``slot``."""
    return tuple(s.at[slot].set(a.astype(s.dtype)) for s, a in zip(stacks, arrays, strict=True))


@functools.partial(jax.jit, donate_argnums=(0, 1))
def clear_slot(counts: jax.Array, prompt_mask: jax.Array, slot: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Penalty slot ``slot`` emptied for a new sequence."""
    return counts.at[slot].set(0), prompt_mask.at[slot].set(False)


@functools.partial(jax.jit, static_argnums=(2, 3))
def gather_pages(kv_cache: Cache, pages: jax.Array, axis: int, sharding: NamedSharding) -> tuple[jax.Array, ...]:
    """Every cache array's ``pages`` (their K/V in every layer and head, scales included), in the
    cache's order and sharding: what the host tier saves (``runtime/host_kv.py``)."""
    leaves = jax.tree.leaves(kv_cache)
    return tuple(jax.lax.with_sharding_constraint(jnp.take(a, pages, axis=axis), sharding) for a in leaves)


@functools.partial(jax.jit, donate_argnums=0, static_argnums=(3, 4))
def scatter_pages(
    kv_cache: Cache, pages: jax.Array, values: tuple[jax.Array, ...], axis: int, sharding: NamedSharding
) -> Cache:
    """The cache with ``values`` (``gather_pages``' arrays) written into ``pages``; a page listed
    twice takes the same values twice (padding repeats the last)."""
    leaves, treedef = jax.tree.flatten(kv_cache)
    index = (slice(None),) * axis + (pages,)
    written = [a.at[index].set(v.astype(a.dtype)) for a, v in zip(leaves, values, strict=True)]
    return constrain_cache(jax.tree.unflatten(treedef, written), sharding)
