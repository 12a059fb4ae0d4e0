"""The child processes of ``python -m myserve.bench.device``: the only part of it that imports JAX.

``python -m myserve.bench.device_worker ceilings OUT.json`` measures the device's copy bandwidth
and matmul rate; ``python -m myserve.bench.device_worker engine JOB.json OUT.json`` loads one
deployment (a config plus overrides), warms it up and runs each of the job's runs through a
``GenerationService``, rewriting OUT.json after every run so that a later run that dies (memory,
time limit) does not take the earlier ones with it. Runs are timed in the engine's steady state
only (``steady.py``): after its background builds and the priming of every executable (else it
fails, saying what was missing); each run records which executables ran and the tokens per call,
and a run that contradicts the steady state (something compiled while timed, K > 1 and no decode
loop ran) is kept with an ``error`` and fails the process. Each runs in its own process because a
process that has touched an accelerator keeps its memory until it exits, and so that one failing
deployment does not stop the others.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

PROFILE_TOKENS = 16
"""Tokens per request in a profiled section: a few decode steps, a trace that stays small."""


def median_s(fn: Callable[..., Any], *args: Any, n: int = 7) -> float:
    """Median wall seconds of ``fn(*args)`` to completion, after one warm-up call (the compile)."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return sorted(times)[n // 2]


def measure_ceilings() -> dict[str, Any]:
    """The first device's copy bandwidth (bytes read + written per second of an elementwise pass
    over a large array) and square-matmul FLOP/s, in bfloat16 on an accelerator and float32 on a
    CPU (XLA:CPU's bfloat16 dots are emulated, not what the engine runs there)."""
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    cpu = device.platform == "cpu"
    limit = (device.memory_stats() or {}).get("bytes_limit")
    dtype = jnp.float32 if cpu else jnp.bfloat16
    # Large enough to leave the caches (4 GiB on an accelerator, an eighth of its memory at most);
    # tens of MiB on a CPU, whose last-level cache is a few MiB.
    copy_bytes = 32 << 20 if cpu else min(4 << 30, (limit or 32 << 30) // 8)
    x = jnp.ones((copy_bytes // jnp.dtype(dtype).itemsize,), dtype)
    copy_s = median_s(jax.jit(lambda a: a * 1.0001), x)
    del x
    m = 1024 if cpu else 8192
    a = jax.random.normal(jax.random.key(1), (m, m), dtype)
    b = jax.random.normal(jax.random.key(2), (m, m), dtype)
    matmul_s = median_s(jax.jit(jnp.matmul), a, b)
    return {
        "platform": device.platform,
        "device": str(device.device_kind),
        "device_count": jax.device_count(),
        "jax": jax.__version__,
        "memory_bytes": limit,
        "copy_bytes_per_s": 2 * copy_bytes / copy_s,
        "matmul_flops_per_s": 2 * m**3 / matmul_s,
        "copy_bytes": copy_bytes,
        "matmul_size": m,
        "dtype": jnp.dtype(dtype).name,
    }


def _nbytes(tree: Any) -> int:
    """Device bytes of every array in ``tree`` (narrow weights' codes, scales and offsets included)."""
    import jax

    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "dtype"))


def decode_read_bytes(model: Any) -> int:
    """Bytes of weights one decode step must read, in their served form: every weight, except that a
    MoE layer's routed experts count at top-k / experts of their bytes (what one token uses) and an
    untied embedding table not at all (a step gathers only its tokens' rows)."""
    spec = model.spec
    total = _nbytes(model)
    if model.lm_head is not None:
        total -= _nbytes(model.embed)
    for layer in model.layers:
        if layer.moe is not None:
            routed = _nbytes(layer.moe.gate_up) + _nbytes(layer.moe.down)
            total -= int(routed * (1 - spec.experts_per_token / spec.num_experts))
    return total


def _profile(service: Any, prompts: list[list[int]], trace: Path) -> dict[str, Any]:
    """A ``jax.profiler`` trace of a few steps of ``prompts`` (all at once), copied to ``trace``,
    and what it says (``device_profile.summarize_trace``)."""
    import jax

    from myserve.bench.device_profile import summarize_trace
    from myserve.bench.engine import bench_myserve

    if jax.default_backend() == "cpu":
        return {"available": False, "reason": "not available on CPU (no device events in its traces)"}
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            t0 = time.perf_counter()
            bench_myserve(service, prompts, PROFILE_TOKENS)
            wall_s = time.perf_counter() - t0
        found = sorted(Path(tmp).glob("**/*.trace.json.gz"))
        if not found:
            return {"available": False, "reason": "jax.profiler wrote no perfetto trace"}
        trace.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(found[0], trace)
    return {"trace": str(trace), **summarize_trace(trace, wall_s)}


def run_engine(job: dict[str, Any], out: Path) -> None:
    """Load ``job``'s deployment and run its runs (``device.py`` builds the job)."""
    import jax

    from myserve.bench.engine import bench_myserve, bench_single_decode, chat_prompts, random_prompts
    from myserve.bench.steady import NotSteadyError, Section, wait_steady
    from myserve.config import load_config
    from myserve.entrypoints.service import GenerationService
    from myserve.runtime.deployment import Deployment
    from myserve.runtime.host_memory import keep_freed_memory

    if jax.default_backend() == "cpu":
        keep_freed_memory()  # as `serve` does on CPU
    t0 = time.perf_counter()
    # Loaded, then warmed up, one after the other (not `serve`'s prebuild): on a CPU of two cores
    # the two would only share them, and load_s and warmup_s stay separate figures.
    dep = Deployment.load(load_config(job["config"], job["overrides"]))
    load_s = time.perf_counter() - t0
    spec = dep.spec
    common = {
        "dtype": dep.dtype.name,
        "weight_read_bytes": decode_read_bytes(dep.model),
        "kv_bytes_per_token": spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * dep.dtype.itemsize,
        "load_s": load_s,
    }
    service = GenerationService.from_deployment(dep)
    t0 = time.perf_counter()
    service.start()
    common["warmup_s"] = time.perf_counter() - t0
    max_tokens = job["max_tokens"]
    runs: list[dict[str, Any]] = []
    problems: list[str] = []
    try:
        # Nothing is timed before the background builds are done and every executable has run once
        # (a NotSteadyError, naming what is missing, fails the deployment's runs instead).
        t0 = time.perf_counter()
        wait_steady(service, job.get("steady_timeout_s") or 300.0)
        common["steady_s"] = time.perf_counter() - t0
        for run in job["runs"]:
            c, length = run["concurrency"], run["prompt_tokens"]
            # Two extra prompts warm first-request effects without putting the measured prompts in
            # the prefix cache.
            if length:
                prompts = random_prompts(min(dep.tokenizer.vocab_size, spec.vocab_size), c + 2, length)
            else:
                prompts = chat_prompts(dep.tokenizer, c + 2)
            prompts, warm = prompts[:c], prompts[c:]
            bench_myserve(service, warm, 4)
            entry = {**run, **common, "prompt_tokens": round(sum(map(len, prompts)) / c)}
            section = Section(service)
            if c == 1:  # one stream: its decode rate after the first token
                single = bench_single_decode(service, prompts[0], max_tokens)
                entry |= {"tokens_per_s": single["decode_tokens_per_s"], "ttft_s": single["ttft_s"]}
                figures, found = section.finish(single["tokens"] - 1, one_stream=True, decode=max_tokens > 1)
            else:
                many = bench_myserve(service, prompts, max_tokens)
                keys = ("tokens_per_s", "ttft_p50_s", "seconds", "generated_tokens", "prefill_s")
                entry |= {k: many[k] for k in (*keys, "prefill_tokens_per_s", "decode_tokens_per_s")}
                figures, found = section.finish(many["generated_tokens"], one_stream=False, decode=max_tokens > 1)
            entry |= figures
            if found:  # measured, but not in the steady state it claims: kept, marked, and failed below
                entry["error"] = "not the steady state: " + "; ".join(found)
                problems += [f"{run['name']}: {p}" for p in found]
            if job.get("trace_dir"):
                entry["profile"] = _profile(service, prompts, Path(job["trace_dir"]) / f"{run['name']}.trace.json.gz")
            runs.append(entry)
            out.write_text(json.dumps({"common": common, "runs": runs}))
    finally:
        service.shutdown()
    out.write_text(json.dumps({"common": common, "runs": runs}))
    if problems:
        raise NotSteadyError("not the steady state: " + " | ".join(problems))


def main(argv: Sequence[str] | None = None) -> int:
    """``ceilings OUT`` or ``engine JOB OUT``."""
    args = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args[:1] == ["ceilings"] and len(args) == 2:
        Path(args[1]).write_text(json.dumps(measure_ceilings()))
        return 0
    if args[:1] == ["engine"] and len(args) == 3:
        run_engine(json.loads(Path(args[1]).read_text()), Path(args[2]))
        return 0
    print("usage: python -m myserve.bench.device_worker ceilings OUT | engine JOB OUT", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
