"""A process-wide count of XLA executables built (compiled, or loaded from the persistent cache).

Registered once on import through ``jax.monitoring``; the engine reports it as a metric and tests
assert it stays flat after warmup.
"""

from __future__ import annotations

import threading

import jax

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"

_lock = threading.Lock()
_count = 0


def _on_duration(event: str, duration_secs: float, **kwargs: str | int) -> None:
    global _count
    if event == _BACKEND_COMPILE:
        with _lock:
            _count += 1


def _on_event(event: str, **kwargs: str | int) -> None:
    global _count
    if event == _CACHE_HIT:
        with _lock:
            _count += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_event_listener(_on_event)


def compile_count() -> int:
    """Executables built in this process so far."""
    return _count
