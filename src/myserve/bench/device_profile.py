"""What a ``jax.profiler`` trace of a few engine steps says about the device and the host.

Reads the perfetto trace (``*.trace.json.gz``: ``traceEvents``, complete events ``ph == "X"`` in
microseconds) that ``jax.profiler.trace(..., create_perfetto_trace=True)`` writes. Processes are
named by metadata events: ``/device:GPU:0`` (one thread per stream, kernels and copies) and
``/host:CPU`` (PjRt's and XLA's host-side calls). A CPU backend records no device process, so
there is nothing to say about a device there (``available: False``).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

STEP_MODULES = ("jit_forward_step", "jit_head_step", "jit_decode_loop", "jit_score_step")
"""The HLO modules of the engine's step executables (``runtime/model_step.py``'s jitted functions:
``forward_step``, ``head_step``, ``decode_loop``, ``score_step``)."""

STEP_CALLS = ("jit_forward_step", "jit_decode_loop")
"""The modules of which each call is one engine step (a head or a scorer runs within a forward's)."""


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals: streams overlap, so durations do not add."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        busy += stop - max(start, end)
        end = stop
    return busy


def _module_of_call(name: str) -> str | None:
    """The step module of a host event ``... Execute (jit_...)`` (PjRt's executable launch), if one."""
    return next((m for m in STEP_MODULES if name.endswith(f"Execute ({m})")), None)


def summarize_trace(path: Path, wall_s: float) -> dict[str, Any]:
    """Device busy share over ``wall_s`` (the traced section's wall time, measured by the caller),
    calls of each step module, and per step (a forward or decode-loop call): kernels and host
    milliseconds inside the step executables' calls."""
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    devices = {pid for pid, name in names.items() if name.startswith("/device:") and "CPU" not in name}
    spans = [e for e in events if e.get("ph") == "X"]
    on_device = [e for e in spans if e["pid"] in devices]
    # One host event per step executable launch, whatever the backend (PjRt's common executable).
    calls = [(e, m) for e in spans if e["pid"] not in devices and (m := _module_of_call(e["name"])) is not None]
    modules: dict[str, dict[str, float]] = {
        m: {"calls": 0, "kernels": 0, "host_ms_in_execute": 0.0} for m in STEP_MODULES
    }
    for e, m in calls:
        modules[m]["calls"] += 1
        modules[m]["host_ms_in_execute"] += e.get("dur", 0.0) / 1e3
    steps = sum(int(modules[m]["calls"]) for m in STEP_CALLS)
    if not on_device:
        return {"available": False, "reason": "the trace has no device events", "steps": steps, "modules": modules}
    for e in on_device:
        m = e.get("args", {}).get("hlo_module")
        if m in modules and "Memcpy" not in e["name"]:
            modules[m]["kernels"] += 1
    # On GPU the host's share of the call is XLA running its thunks (CUDA graphs recorded and
    # launched, conditionals' predicates copied back): time the host is not planning the next step.
    thunks = [e for e in spans if e["pid"] not in devices and e["name"].endswith("ExecuteThunks")]
    per_step = max(steps, 1)
    busy_s = _busy_us([(e["ts"], e["ts"] + e.get("dur", 0.0)) for e in on_device]) / 1e6
    return {
        "available": True,
        "steps": steps,
        "modules": modules,
        "wall_s": wall_s,
        "device_busy_s": busy_s,
        "device_busy_share": busy_s / wall_s,
        "kernels_per_step": sum(v["kernels"] for v in modules.values()) / per_step,
        "host_ms_in_execute_per_step": sum(e.get("dur", 0.0) for e, _ in calls) / per_step / 1e3,
        "host_ms_in_thunks_per_step": sum(e.get("dur", 0.0) for e in thunks) / per_step / 1e3 if thunks else None,
    }
