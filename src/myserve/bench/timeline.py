"""``python -m myserve.bench.timeline``: the engine loop's own timestamps, as a trace of the overlap.

Starts an in-process engine (the bundled model, or ``--hf-checkpoint``), runs ``--concurrency``
greedy requests of ``--max-tokens`` tokens, and prints the last ``--steps`` loop iterations from
``StepTimer.timeline``, in milliseconds from the first printed event::

    iter  plan    dispatched  wait(prev)  read(prev)  planned while prev ran
       k  a       b           c           d           yes: [a, b] inside [dispatched(k-1), d]

With overlapped steps, iteration ``k`` is scheduled and dispatched while step ``k-1`` runs: the
host then waits ``d - c`` for step ``k-1``'s results, so the device was still busy with ``k-1``
after ``k`` was planned (``b < d``). One step at a time (``--set engine.async_scheduling=false``)
each iteration reads its own step before the next is planned.
"""

from __future__ import annotations

import argparse
import collections
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m myserve.bench.timeline", description=__doc__)
    parser.add_argument("--hf-checkpoint", default=None, help="checkpoint (default: the bundled SmolLM2)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer source (default: the checkpoint's)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=12, help="iterations to print")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    args = parser.parse_args(argv)

    from myserve.config import load_config
    from myserve.entrypoints.service import GenerationService
    from myserve.runtime.deployment import Deployment
    from myserve.wire.params import SamplingParams

    overrides = list(args.set)
    if args.hf_checkpoint:
        overrides.append(f"model.checkpoint={args.hf_checkpoint}")
    if args.tokenizer:
        overrides.append(f"model.tokenizer={args.tokenizer}")
    service = GenerationService.from_deployment(Deployment.load(load_config(None, overrides)))
    service.start(progress=lambda done, total: None)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        streams = [service.submit([10 + i, 20 + i, 30 + i], params) for i in range(args.concurrency)]
        for stream in streams:
            for _ in stream:
                pass
    finally:
        service.shutdown()
    events: dict[int, dict[str, float]] = collections.defaultdict(dict)
    for iteration, event, t in service.timer.timeline:
        events[iteration].setdefault(event, t)
    # Steady state: iterations that planned, dispatched and whose step was read, well before the end.
    full = [k for k in sorted(events) if {"plan", "dispatched", "wait", "read"} <= set(events[k])]
    chosen = full[len(full) // 2 : len(full) // 2 + args.steps]
    if not chosen:
        print("no complete iterations recorded", file=sys.stderr)
        return 1
    t0 = events[chosen[0]]["plan"]
    ms = lambda t: f"{1000 * (t - t0):9.2f}"  # noqa: E731
    print(f"async_scheduling={service.async_scheduling}; ms from iteration {chosen[0]}'s planning")
    print("iter      plan dispatched  wait(k-1)  read(k-1)  planned while k-1 ran")
    for k in chosen:
        e, prev = events[k], events.get(k - 1, {})
        overlap = (
            "dispatched" in prev
            and "read" in prev
            and prev["dispatched"] <= e["plan"]
            and e["dispatched"] <= prev["read"]
        )
        wait, read = prev.get("wait"), prev.get("read")
        cells = [ms(e["plan"]), ms(e["dispatched"])] + [ms(x) if x is not None else " " * 9 for x in (wait, read)]
        print(f"{k:4d} {' '.join(cells)}  {'yes' if overlap else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
