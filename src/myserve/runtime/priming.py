"""Priming: each step executable run once on an empty batch before a request needs it.

An executable's first run costs far more than its next ones, compiled or loaded from the step
cache alike (on XLA:CPU its kernels are linked then: 0.1-0.3 s for a step of the 16-layer
yardstick), and warmup builds without running; the idle engine so runs each once
(``PrimeSteps``, ``ModelRunner.prime_next``) and no request pays for it.
"""

from __future__ import annotations

import time
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
    jax.block_until_ready(_run_empty(ex, key, 1))
    ex.ran.add(key)


def seconds_per_call(ex: Executor, key: BuildKey, calls: int) -> float:
    """Device time of one call of ``ex``'s built executable of ``key``: ``calls`` calls on an empty
    batch of its shape dispatched back to back with no host work between them, waited for once at
    the end (the benchmarks' device-only ceiling: ``bench/host.py``). Only while nothing else runs
    on ``ex`` (the engine idle): the calls donate its cache and counts as a step does."""
    jax.block_until_ready(_run_empty(ex, key, 1))  # (a first run links; not timed)
    t0 = time.perf_counter()
    jax.block_until_ready(_run_empty(ex, key, calls))
    return (time.perf_counter() - t0) / calls


def _run_empty(ex: Executor, key: BuildKey, calls: int) -> Any:
    """Call the executable of ``key`` ``calls`` times on an empty batch (``prime``), each call on the
    cache and counts the one before returned; the last call's outputs."""
    args = list(ex.call_args(key, live=True)[2])
    if key[0] == "head":  # (outer, last, counts, mask, fed, ints, floats, bitmask)
        rows = SamplingRows.empty(cast(int, key[1]), ex.scratch_slot)
        args[5], args[6] = (jax.device_put(a, ex.replicated) for a in (rows.ints, rows.floats))
        args[7] = ex.no_mask(rows.ints.shape[0])
    if key[0] == "loop":  # (..., packed, bitmask)
        args[-1] = ex.no_mask(cast(StepShape, key[1]).singles)
    fed = jax.device_put(np.zeros(ex.fed.shape, ex.fed.dtype), ex.replicated)
    args = [fed if a is ex.fed else _zeros_of(a) for a in args]
    step = ex.compiled.get(key)
    out = None
    for _ in range(calls):
        out = step(*args)
        # The donated state comes back from the call: the next call (and the executor) takes it.
        if key[0] in ("forward", "forward_images"):  # (outer, layers, cache, fed, packed[, images])
            ex.kv_cache = args[2] = out[1]
        elif key[0] == "head":  # (outer, last, counts, mask, fed, ...): counts and fed donated
            ex.counts = args[2] = out[1]
            args[4] = out[2]
        elif key[0] == "loop":  # (outer, layers, cache, counts, mask, fed, ...): cache, counts, fed
            ex.kv_cache, ex.counts = args[2], args[3] = out[1], out[2]
            args[5] = out[3]
    return out


def _zeros_of(arg: Any) -> Any:
    """``arg``, or zeros of its shape, dtype and sharding where it is a stand-in (``call_args``)."""
    if isinstance(arg, jax.ShapeDtypeStruct):
        return jax.device_put(np.zeros(arg.shape, arg.dtype), arg.sharding)
    return arg
