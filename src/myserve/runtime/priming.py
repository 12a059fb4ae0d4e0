"""Priming: each step executable run once on an empty batch before a request needs it.

An executable's first run costs far more than its next ones, compiled or loaded from the step
cache alike (on XLA:CPU its kernels are linked then: 0.1-0.3 s for a step of the 16-layer
yardstick), and warmup builds without running; the idle engine so runs each once
(``PrimeSteps``, ``ModelRunner.prime_next``) and no request pays for it.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import jax
import numpy as np

from myserve.runtime.executables import BuildKey, Executables
from myserve.runtime.sampling_rows import SamplingRows
from myserve.runtime.step_layout import StepShape
from myserve.runtime.step_ops import CompileSteps, PrimeSteps


class Executor(Protocol):
    """What priming uses of ``runtime.executor.Executor`` (which imports this module)."""

    kv_cache: Any
    counts: Any
    fed: Any
    replicated: Any
    scratch_slot: int
    ran: set[BuildKey]
    compiled: Executables

    def keys(self, op: CompileSteps) -> list[BuildKey]: ...
    def call_args(self, key: BuildKey, live: bool = False) -> tuple[Any, tuple[object, ...], tuple[object, ...]]: ...
    def no_mask(self, rows: int) -> Any: ...


def prime_built(ex: Executor, op: PrimeSteps) -> None:
    """Prime each executable of ``op`` that has not yet run. The runner sends only built ones; a
    multi-host follower whose own background build lags waits for it (as for a step), so that
    every process runs the same executables (their collectives) in the same order."""
    for key in ex.keys(op.steps):
        if key not in ex.ran:
            prime(ex, key)


def prime(ex: Executor, key: BuildKey) -> None:
    """Run ``ex``'s built executable of ``key`` once, and wait for it (the engine primes one at a
    time between requests: a request's step must not queue behind every prime dispatched so far).
    The arguments are those warmup traced it with, stand-ins made zeros: an empty batch writes no
    KV (padding writes are dropped), its sampling rows count in the scratch penalty slot, and
    ``fed`` is a throwaway copy, so a step in flight still feeds the next one its tokens. The
    donated cache and counts come back as they were but for the scratch slot."""
    args = list(ex.call_args(key, live=True)[2])
    if key[0] == "head":  # (outer, last, counts, mask, fed, ints, floats, bitmask)
        rows = SamplingRows.empty(cast(int, key[1]), ex.scratch_slot)
        args[5], args[6] = (jax.device_put(a, ex.replicated) for a in (rows.ints, rows.floats))
        args[7] = ex.no_mask(rows.ints.shape[0])
    if key[0] == "loop":  # (..., packed, bitmask)
        args[-1] = ex.no_mask(cast(StepShape, key[1]).singles)
    fed = jax.device_put(np.zeros(ex.fed.shape, ex.fed.dtype), ex.replicated)
    out = ex.compiled.get(key)(*(fed if a is ex.fed else _zeros_of(a) for a in args))
    if key[0] == "forward":
        ex.kv_cache = out[1]
    elif key[0] == "head":
        ex.counts = out[1]
    elif key[0] == "loop":
        ex.kv_cache, ex.counts = out[1], out[2]
    jax.block_until_ready(out)
    ex.ran.add(key)


def _zeros_of(arg: Any) -> Any:
    """``arg``, or zeros of its shape, dtype and sharding where it is a stand-in (``call_args``)."""
    if isinstance(arg, jax.ShapeDtypeStruct):
        return jax.device_put(np.zeros(arg.shape, arg.dtype), arg.sharding)
    return arg
