"""Process-wide counts of XLA executables built: compiled here, or loaded from the persistent cache.

Registered once on import through ``jax.monitoring``; the engine logs both at warmup and reports
them as metrics, and tests assert their sum stays flat after warmup. They are told apart because a
cold start pays for compiles while a warm one only loads: the two costs differ by orders of magnitude.
"""

from __future__ import annotations

import collections
import threading

import jax

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"

_lock = threading.Lock()
_this_thread = threading.local()  # cache hits of the compiles run on each thread
_built = 0  # JAX reports a backend compile for every executable, loaded from the cache or not
_loaded = 0
_recent: collections.deque[tuple[str, str]] = collections.deque(maxlen=64)  # (function, thread) built last


def _on_duration(event: str, duration_secs: float, **kwargs: str | int) -> None:
    global _built
    if event == _BACKEND_COMPILE:
        with _lock:
            _built += 1
            _recent.append((str(kwargs.get("fun_name", "?")), threading.current_thread().name))


def _on_event(event: str, **kwargs: str | int) -> None:
    global _loaded
    if event == _CACHE_HIT:
        with _lock:
            _loaded += 1
        _this_thread.hits = getattr(_this_thread, "hits", 0) + 1  # JAX records it on the compiling thread


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_event_listener(_on_event)


def count_loaded() -> None:
    """Count an executable loaded outside JAX's compile path (the step cache, ``runtime/step_cache.py``)."""
    global _built, _loaded
    with _lock:
        _built += 1
        _loaded += 1


def thread_cache_hits() -> int:
    """Executables the calling thread has loaded from JAX's persistent cache so far: a compile that
    moved it was a load, not a compile."""
    return getattr(_this_thread, "hits", 0)


def compile_count() -> int:
    """Executables built in this process so far, compiled or loaded from the persistent cache."""
    return _built


def recent_builds(n: int) -> list[tuple[str, str]]:
    """The last ``n`` executables built through JAX's compile path (at most 64), oldest first, as
    (jitted function's name, thread that built it): what a test that saw the count move reports."""
    with _lock:
        return list(_recent)[-n:] if n > 0 else []


def compile_counts() -> tuple[int, int]:
    """(compiled by XLA, loaded from the persistent compilation cache) in this process so far."""
    with _lock:
        return _built - _loaded, _loaded
