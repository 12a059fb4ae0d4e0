"""How many iterations a several-token decode call runs (``model_step.decode_loop``).

A decode call is compiled for K iterations (``engine.decode_steps``); the host may ask a call for
fewer tokens per row (``core/decode_pacing.py``: a long call delays every request that arrives
while it runs). Where the platform reads a loop's trip count where the loop runs (CPU), the call
then runs only as many iterations as its longest row asks for, so one executable serves every
count from 1 to K and a one-token decode-only step stays one call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def loop_trips_follow_rows() -> bool:
    """Whether ``decode_loop`` runs as many iterations as its longest row decodes (at most its
    static ``steps``) rather than always ``steps``: on CPU, where a loop's trip count is read where
    it runs, so a call the host asked for fewer tokens (``DecodePacer``) costs only those. On an
    accelerator a data-dependent trip count puts a device-to-host read in every iteration (GPU) or
    keeps XLA from unrolling and pipelining the loop, so the count stays static there."""
    return jax.default_backend() == "cpu"


def rows_long_loop(
    body: Callable[[Any, jax.Array], tuple[Any, Any]], carry: Any, steps: int, trips: jax.Array
) -> tuple[Any, Any]:
    """``jax.lax.scan(body, carry, jnp.arange(steps))`` stopped after ``trips`` (<= ``steps``)
    iterations: the outputs of the iterations not run are zeros (no row reads them: each row's
    tokens are its first ``ints[r, STEPS]``)."""
    out_shape = jax.eval_shape(body, carry, jnp.int32(0))[1]
    outs = jax.tree.map(lambda s: jnp.zeros((steps, *s.shape), s.dtype), out_shape)

    def step(state: tuple[jax.Array, Any, Any]) -> tuple[jax.Array, Any, Any]:
        i, carry, outs = state
        carry, out = body(carry, i)
        outs = jax.tree.map(lambda buf, o: jax.lax.dynamic_update_index_in_dim(buf, o, i, 0), outs, out)
        return i + 1, carry, outs

    bound = jnp.minimum(trips, steps)
    _, carry, outs = jax.lax.while_loop(lambda state: state[0] < bound, step, (jnp.int32(0), carry, outs))
    return carry, outs
