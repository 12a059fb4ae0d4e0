"""Started engines for tests: the in-process service, the core in a child process, and helpers
to drain their streams."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any


def start_service(checkpoint: Path | None, *overrides: str, prebuild: bool = False):
    """A started GenerationService (float32, warmed up) for ``checkpoint`` (None = bundled SmolLM2).
    ``prebuild``: the deployment builds its steps before reading the weights, as ``serve`` does.

    Tiny random checkpoints carry no tokenizer, so they borrow the bundled SmolLM2 one (their
    token ids are all inside its vocabulary). ``overrides`` are config ``section.key=value`` strings.
    """
    from myserve.bundled import bundled_gguf_path
    from myserve.config import load_config
    from myserve.entrypoints.service import GenerationService
    from myserve.runtime.deployment import Deployment

    base = ["model.dtype=float32"]
    if checkpoint is not None:
        base += [f"model.checkpoint={checkpoint}", f"model.tokenizer={bundled_gguf_path()}"]
    config = load_config(None, [*base, *overrides])
    service = GenerationService.from_deployment(Deployment.load(config, prebuild=prebuild))
    service.start()
    return service


def start_client(checkpoint: Path | None, *overrides: str):
    """A started ``EngineClient`` (float32, warmed up): the engine core in a child process, as
    ``python -m myserve.serve`` runs it; arguments as ``start_service``."""
    from myserve.bundled import bundled_gguf_path
    from myserve.config import load_config
    from myserve.core.process import run_core
    from myserve.entrypoints.serve import front_tokenizer
    from myserve.frontend.core_client import EngineClient

    base = ["model.dtype=float32"]
    if checkpoint is not None:
        base += [f"model.checkpoint={checkpoint}", f"model.tokenizer={bundled_gguf_path()}"]
    config = load_config(None, [*base, *overrides])
    client = EngineClient(config, lambda: front_tokenizer(config), core_main=run_core)
    client.wait_loaded()
    client.start()
    return client


def streamed_and_not[T](one: Callable[[int, bool], Awaitable[T]], n: int) -> tuple[list[T], list[T]]:
    """``one(seed, stream)`` for seeds 0..n-1, all at once without streaming, then all at once
    streaming: (non-streamed results, streamed results)."""

    async def both() -> tuple[list[T], list[T]]:
        full = await asyncio.gather(*(one(seed, False) for seed in range(n)))
        parts = await asyncio.gather(*(one(seed, True) for seed in range(n)))
        return list(full), list(parts)

    return asyncio.run(both())


def collect(stream: Any) -> tuple[list[int], str, str | None]:
    """Drain a single-choice request stream: (token ids, text, finish reason)."""
    tokens: list[int] = []
    text, finish = "", None
    for out in stream:
        tokens.extend(out.token_ids)
        text += out.text
        finish = out.finish_reason or finish
    return tokens, text, finish


def wait_primed(service: Any, timeout_s: float = 300.0) -> None:
    """Wait until ``service``'s engine has run each step executable once: every replica of an
    in-process service, or an engine core in its own process (as its stats report it).

    The idle engine thread primes them one at a time (``ModelRunner.prime_next``), and a prime
    donates the KV cache and the penalty counts: a test that drives the runner from its own thread
    (``runner.warmup()``) must wait, or both threads donate the same arrays; a test that times a
    request must wait, or the request queues behind the prime in progress."""
    replicas = getattr(service, "replicas", None)
    if replicas is not None:
        primed = lambda: all(r.runner.primed for r in replicas)  # noqa: E731
    else:
        primed = lambda: service.stats().primed  # noqa: E731  (refreshed by the core's heartbeats)
    until = time.monotonic() + timeout_s
    while not primed() and time.monotonic() < until:
        time.sleep(0.05)
    assert primed(), f"the engine did not prime its executables in {timeout_s:.0f} s"
