"""The steady state an engine benchmark measures, and what a timed section of serving ran.

An engine that has just reported ``ready`` is not yet the engine that serves: its narrower context
buckets and its decode calls (``decode_loop``, K = ``engine.decode_steps`` tokens per call) are
still being built in the background, and no executable has run yet (the idle engine primes each
once, ``ModelRunner.prime_next``). Measured then, a benchmark times one token per call and the
compiler sharing the machine (the H200 runs of 2026-11-28 did: no loop executable ran).

``wait_steady`` waits, before anything is timed, until every replica's background builds are done
and every executable has run once, and fails naming what was not built or primed when that takes
longer than its limit. ``Section`` takes the executors' call counts (``Executor.calls``) and the
process's build count (``compile_counter``) at the start of a timed section and, at its end, says
which executables ran and how many tokens each step call produced, and what contradicts the
steady state the run claims (something compiled meanwhile; K > 1 and no decode loop ran).
"""

from __future__ import annotations

import collections
import time
from typing import Any

from myserve.runtime import compile_counter

Calls = collections.Counter
"""Step-executable calls by ``BuildKey`` (``Executor.calls``)."""

STEP_KINDS = ("forward", "loop")
"""The kinds of executable that each make one step (a head or a scorer runs inside a forward's step)."""


class NotSteadyError(RuntimeError):
    """The engine did not reach, or did not stay in, the steady state a benchmark measures."""


def _runners(service: Any) -> list[Any]:
    """The ``ModelRunner`` of each in-process replica of ``service``."""
    return [replica.runner for replica in getattr(service, "replicas", ())]


def decode_steps(service: Any) -> int:
    """K: the tokens per decode call of ``service``'s engine (the largest over its replicas; 1 if none)."""
    return max((int(getattr(r, "decode_steps", None) or 1) for r in _runners(service)), default=1)


def _rows(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"


def name(key: tuple[Any, ...]) -> str:
    """A step executable's ``BuildKey`` in a few words, for results: ``forward 32 tokens x 16 pages,
    32 rows``, ``head argmax 16 rows``, ``loop argmax 16 rows x 4 tokens, 32 pages``, ``score 32 tokens``."""
    kind = key[0]
    if kind == "forward":
        s = key[1]
        return f"forward {s.tokens} tokens x {s.width} pages, {_rows(s.singles)}"
    if kind == "head":
        return f"head {key[2]} {_rows(key[1])}"
    if kind == "loop":
        s = key[1]
        return f"loop {key[3]} {_rows(s.singles)} x {key[2]} tokens, {s.width} pages"
    return f"{kind} {' '.join(map(str, key[1:]))} tokens"


def _not_built(runner: Any) -> list[str]:
    """What ``runner``'s background builds have not yet built (their keys, in words)."""
    device = runner.device
    if not (hasattr(runner, "compile_ops") and hasattr(device, "keys") and hasattr(device, "executables")):
        return []
    built = device.executables()
    return [name(key) for key in device.keys(runner.compile_ops()[1]) if key not in built]


def _not_primed(runner: Any) -> list[str]:
    """Built executables of ``runner`` that have never run."""
    device = runner.device
    if not (hasattr(device, "executables") and hasattr(device, "ran")):
        return []
    return [name(key) for key in device.executables() if key not in device.ran]


def wait_steady(service: Any, timeout_s: float) -> float:
    """Wait until every replica of ``service`` has built its background executables and run every
    executable once (``ModelRunner.primed``); the seconds waited. Raises ``NotSteadyError`` naming
    what was not built or not primed when that takes more than ``timeout_s``."""
    t0 = time.perf_counter()
    until = time.monotonic() + timeout_s
    runners = _runners(service)
    built = all(r.device.background_builds_done(max(0.0, until - time.monotonic())) for r in runners)
    while built and not all(r.primed for r in runners) and time.monotonic() < until:
        time.sleep(0.05)
    if built and all(r.primed for r in runners):
        return time.perf_counter() - t0
    missing = [k for r in runners for k in _not_built(r)]
    unprimed = [k for r in runners for k in _not_primed(r)]
    parts = []
    if not built:
        parts.append(f"{len(missing)} still building in the background ({', '.join(missing[:6]) or '?'})")
    if unprimed or built:
        parts.append(f"{len(unprimed)} built but never run ({', '.join(unprimed[:6]) or 'priming under way'})")
    raise NotSteadyError(
        f"the engine did not reach its steady state in {timeout_s:g} s: {'; '.join(parts)}; "
        "not measuring a half-warm engine (raise the limit: device --steady-timeout)"
    )


def calls(service: Any) -> Calls:
    """Every replica's step-executable calls so far, added up."""
    total: Calls = collections.Counter()
    for runner in _runners(service):
        total.update(getattr(runner.device, "calls", {}))
    return total


class Section:
    """A timed section of serving: the call counts and the build count at its start."""

    def __init__(self, service: Any):
        self.service = service
        self.k = decode_steps(service)
        self._calls = calls(service)
        self._builds = compile_counter.compile_count()

    def finish(self, tokens: int, *, one_stream: bool, decode: bool = True) -> tuple[dict[str, Any], list[str]]:
        """The section's figures and the problems found in it. ``tokens``: for ``one_stream`` (a
        lone request: its calls counted over the whole request) the tokens after its first, else
        every token generated. ``decode``: the section has decode steps (max_tokens > 1).

        Figures: ``decode_steps`` (K), ``executables`` (name -> calls in the section),
        ``step_calls`` (forward and loop calls: one per step), ``loop_calls``, and
        ``tokens_per_call``: for one stream, its decode tokens over its loop calls (every
        decode-only step is one loop call; None when none ran), else every token over the step
        calls."""
        ran = calls(self.service) - self._calls
        built = compile_counter.compile_count() - self._builds
        steps = sum(n for key, n in ran.items() if key[0] in STEP_KINDS)
        loops = sum(n for key, n in ran.items() if key[0] == "loop")
        if one_stream:
            per_call = tokens / loops if loops else None
        else:
            per_call = tokens / steps if steps else None
        fields = {
            "decode_steps": self.k,
            "executables": {name(key): n for key, n in sorted(ran.items(), key=lambda kv: name(kv[0]))},
            "step_calls": steps,
            "loop_calls": loops,
            "tokens_per_call": per_call,
        }
        problems = []
        if built:
            recent = ", ".join(f for f, _ in compile_counter.recent_builds(min(built, 4)))
            problems.append(f"{built} executable(s) built during the timed section ({recent})")
        if decode and self.k > 1 and not loops:
            problems.append(f"the engine decodes K = {self.k} tokens per call but no decode loop ran")
        return fields, problems
