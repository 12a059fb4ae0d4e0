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

STEP_MODULE = "jit_model_step"
"""The HLO module of the engine's step (``runtime/model_step.py``'s jitted function)."""


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals: streams overlap, so durations do not add."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        busy += stop - max(start, end)
        end = stop
    return busy


def summarize_trace(path: Path, wall_s: float) -> dict[str, Any]:
    """Device busy share over ``wall_s`` (the traced section's wall time, measured by the caller),
    kernels per step and host milliseconds per step inside the step's executable call."""
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    devices = {pid for pid, name in names.items() if name.startswith("/device:") and "CPU" not in name}
    spans = [e for e in events if e.get("ph") == "X"]
    on_device = [e for e in spans if e["pid"] in devices]
    # One host event per step executable launch, whatever the backend (PjRt's common executable).
    calls = [e for e in spans if e["pid"] not in devices and e["name"].endswith(f"Execute ({STEP_MODULE})")]
    steps = len(calls)
    if not on_device:
        return {"available": False, "reason": "the trace has no device events", "steps": steps}
    kernels = [e for e in on_device if e.get("args", {}).get("hlo_module") == STEP_MODULE and "Memcpy" not in e["name"]]
    # On GPU the host's share of the call is XLA running its thunks (CUDA graphs recorded and
    # launched, conditionals' predicates copied back): time the host is not planning the next step.
    thunks = [e for e in spans if e["pid"] not in devices and e["name"].endswith("ExecuteThunks")]
    per_step = max(steps, 1)
    busy_s = _busy_us([(e["ts"], e["ts"] + e.get("dur", 0.0)) for e in on_device]) / 1e6
    return {
        "available": True,
        "steps": steps,
        "wall_s": wall_s,
        "device_busy_s": busy_s,
        "device_busy_share": busy_s / wall_s,
        "kernels_per_step": len(kernels) / per_step,
        "host_ms_in_execute_per_step": sum(e.get("dur", 0.0) for e in calls) / per_step / 1e3,
        "host_ms_in_thunks_per_step": sum(e.get("dur", 0.0) for e in thunks) / per_step / 1e3 if thunks else None,
    }
