"""Inside the jitted step: the host's packed arrays cut back into the device arrays they stand for.

The host packs a step's layout into one int32 vector (``runtime/step_layout.py``) and its sampling
rows into two matrices (``runtime/sampling_rows.py``), one transfer each; these functions undo the
packing on the device, where the shapes are static (``StepShape``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from myserve.ops.ragged_batch import AttentionView, RaggedBatch
from myserve.runtime.sampler import SamplingArrays
from myserve.runtime.sampling_rows import (
    BAN_STEPS,
    CHOICE,
    CONSTRAINED,
    FLOAT_PARAMS,
    LOGPROBS,
    MAX_BANNED,
    MAX_BIAS,
    NUM_FLOATS,
    NUM_INTS,
    POSITION,
    SEED,
    SLOT,
    TOP_K,
    WEIGHT,
)
from myserve.runtime.step_layout import StepShape


def unpack_step(
    flat: jax.Array, shape: StepShape
) -> tuple[jax.Array, RaggedBatch, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Inside the jit: (tokens [T], RaggedBatch, sample_idx [N1], following [T], feed [T],
    pool_rows [T]) from ``HostStep.pack``."""
    parts, at = [], 0
    for dims in shape.array_shapes():
        size = math.prod(dims)
        parts.append(flat[at : at + size].reshape(dims))
        at += size
    tokens, positions, q_lens, write_pages, *views, sample_idx, following, feed, pool_rows, adapters, rope = parts
    batch = RaggedBatch(
        positions,
        q_lens,
        write_pages,
        AttentionView(*views[:4]),
        AttentionView(*views[4:]),
        chunk_pages=shape.chunk_pages,
        adapters=adapters,
        rope_offsets=rope,
    )
    return tokens, batch, sample_idx, following, feed, pool_rows


def unpack_rows(ints: jax.Array, floats: jax.Array) -> tuple[SamplingArrays, jax.Array, jax.Array, jax.Array]:
    """Inside the jit: (SamplingArrays, penalty slot [B], sampled-row weight [B], wants logprobs [B])
    from the two matrices (``SamplingArrays.constrained`` marks the rows a grammar masks)."""
    f = {name: floats[:, i] for i, name in enumerate(FLOAT_PARAMS)}
    arrays = SamplingArrays(
        **f,
        top_k=ints[:, TOP_K],
        seed=jax.lax.bitcast_convert_type(ints[:, SEED], jnp.uint32),
        choice=ints[:, CHOICE],
        position=ints[:, POSITION],
        bias_ids=ints[:, NUM_INTS : NUM_INTS + MAX_BIAS],
        bias_values=floats[:, NUM_FLOATS:],
        banned_ids=ints[:, NUM_INTS + MAX_BIAS :],
        constrained=ints[:, CONSTRAINED] > 0,
        ban_steps=ints[:, BAN_STEPS],
    )
    return arrays, ints[:, SLOT], ints[:, WEIGHT], ints[:, LOGPROBS] > 0


def pack_step(flat: np.ndarray, ints: np.ndarray, floats: np.ndarray) -> np.ndarray:
    """On the host: a step's layout vector and its sampling rows as the one int32 vector that
    travels to the device (the floats' bits reinterpreted), so a step is one transfer."""
    return np.concatenate([flat, ints.ravel(), floats.view(np.int32).ravel()])


def split_step(packed: jax.Array, shape: StepShape) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Inside the jit: ``pack_step``'s vector back into (layout vector, ints [N1, ...], floats [N1, ...])."""
    n1 = shape.singles
    flat_size = sum(math.prod(dims) for dims in shape.array_shapes())
    ni, nf = NUM_INTS + MAX_BIAS + MAX_BANNED, NUM_FLOATS + MAX_BIAS
    flat = packed[:flat_size]
    ints = packed[flat_size : flat_size + n1 * ni].reshape(n1, ni)
    floats = jax.lax.bitcast_convert_type(packed[flat_size + n1 * ni : flat_size + n1 * (ni + nf)], jnp.float32)
    return flat, ints, floats.reshape(n1, nf)
