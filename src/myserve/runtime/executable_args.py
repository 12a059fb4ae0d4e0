"""What each step executable is traced with: its jitted function, static arguments and dynamic
arguments, for an executor's weights and state (``runtime/executor.py``).

Everything a step replaces (the KV cache, penalty tables, ``fed``) is given as stand-ins in the
shardings those arrays were made with, not as the arrays: a step's outputs carry equivalent but
otherwise written shardings (``P()`` for ``P(None, 'model', ...)`` on one device), which would give
an executable built in the background another step-cache key on every start. Priming passes the
live arrays instead (``priming.py``).
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding

from myserve.models.llama import LlamaModel
from myserve.runtime.executables import BuildKey
from myserve.runtime.model_step import decode_loop, forward_step, head_step, score_step
from myserve.runtime.sampling_rows import SamplingRows
from myserve.runtime.step_arrays import pack_step
from myserve.runtime.step_layout import StepShape, layout


class ArgSource(Protocol):
    """The executor's attributes an executable's arguments are made of."""

    @property
    def outer(self) -> LlamaModel: ...  # the weights of the slot steps run on
    @property
    def layers(self) -> tuple[tuple[jax.Array, ...], ...]: ...

    treedef: Any
    cache_sharding: NamedSharding
    replicated: NamedSharding
    pool: bool
    page_size: int
    scratch_slot: int
    mask_words: int
    hidden_dtype: Any


def executable_args(
    ex: ArgSource, key: BuildKey, state: tuple[Any, Any, Any, Any]
) -> tuple[Any, tuple[object, ...], tuple[object, ...]]:
    """(jitted function, static arguments, dynamic arguments) of the executable of ``key``, with
    ``state`` = (KV cache, counts, prompt mask, fed), arrays or stand-ins."""
    rep = ex.replicated
    kv_cache, counts, prompt_mask, fed = state
    embed = ex.outer.spec.hidden_size
    if key[0] in ("forward", "forward_images"):
        shape = key[1]
        assert isinstance(shape, StepShape)
        host = layout([], shape, ex.page_size)
        static: tuple[object, ...] = (shape, ex.treedef, ex.cache_sharding, rep, ex.pool)
        rows = SamplingRows.empty(shape.singles, ex.scratch_slot)
        packed = pack_step(host.pack(), rows.ints, rows.floats)
        if key[0] == "forward":
            return forward_step, static, (ex.outer, ex.layers, kv_cache, fed, packed)
        # (Host arrays, as ``packed``: a prime runs the executable on them, an empty batch's.)
        t = shape.tokens
        images = (np.zeros((t, embed), ex.hidden_dtype), np.zeros(t, np.int32), np.zeros((3, t), np.int32))
        return forward_step, static, (ex.outer, ex.layers, kv_cache, fed, packed, images)
    if key[0] == "head":
        _, n_rows, mode = key
        assert isinstance(n_rows, int)
        sampling = SamplingRows.empty(n_rows, ex.scratch_slot)
        last = jax.ShapeDtypeStruct((n_rows, embed), ex.hidden_dtype, sharding=rep)
        bitmask = jax.ShapeDtypeStruct((n_rows, ex.mask_words), np.int32, sharding=rep)
        rows_args = (sampling.ints, sampling.floats)
        ints, floats = (jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep) for a in rows_args)
        args = (ex.outer, last, counts, prompt_mask, fed, ints, floats, bitmask)
        return head_step, (mode, rep), args
    if key[0] == "loop":
        _, shape, steps, mode = key
        sampling = SamplingRows.empty(shape.singles, ex.scratch_slot)
        bitmask = jax.ShapeDtypeStruct((shape.singles, ex.mask_words), np.int32, sharding=rep)
        static = (shape, steps, mode, ex.treedef, ex.cache_sharding, rep)
        packed = pack_step(layout([], shape, ex.page_size).pack(), sampling.ints, sampling.floats)
        return decode_loop, static, (ex.outer, ex.layers, kv_cache, counts, prompt_mask, fed, packed, bitmask)
    (_, tokens) = key
    assert isinstance(tokens, int)
    hidden = jax.ShapeDtypeStruct((tokens, embed), ex.hidden_dtype, sharding=rep)
    following = jax.ShapeDtypeStruct((tokens,), np.int32, sharding=rep)
    return score_step, (), (ex.outer, hidden, following)


def stand_ins(
    state: tuple[Any, Any, Any, Any], cache_sharding: NamedSharding, rep: NamedSharding
) -> tuple[Any, Any, Any, Any]:
    """Abstract arrays of ``state``'s shapes and dtypes: the cache's in ``cache_sharding``, the
    rest replicated (the shardings they were made with)."""

    def like(a: Any, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

    kv_cache, counts, prompt_mask, fed = state
    cache = jax.tree.map(lambda a: like(a, cache_sharding), kv_cache)
    return cache, like(counts, rep), like(prompt_mask, rep), like(fed, rep)
