"""``python -m myserve.bench.weight_updates``: live weight updates under load, engine level.

One engine (``engine.enable_weight_updates``) serves ``--streams`` concurrent greedy streams of
chat prompts, first for ``--window`` seconds without updates, then through ``--updates`` updates
alternating ``--checkpoint`` and ``--other`` (the same file by default: the cost of reading and
switching is the same), ``--interval`` seconds apart. Reports each update's time from the call to
the switch (the answer comes when the new version serves), the longest gap between two tokens of
any stream and the tokens/s in each window, requests that failed, and executables compiled during
the updates (none is the design).
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from myserve.bench.engine import builtin_chat_prompts, report, wait_built


def _window(arrivals: list[float], start: float, stop: float) -> dict[str, float]:
    """Tokens/s and the longest gap between consecutive token arrivals (any stream) in [start, stop)."""
    inside = sorted(t for t in arrivals if start <= t < stop)
    gaps = [b - a for a, b in zip(inside, inside[1:], strict=False)]
    return {
        "seconds": stop - start,
        "tokens_per_s": len(inside) / (stop - start) if stop > start else 0.0,
        "longest_gap_s": max(gaps, default=0.0),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m myserve.bench.weight_updates", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--checkpoint", help="the served checkpoint (default: the bundled SmolLM2 GGUF)")
    parser.add_argument("--other", help="the checkpoint alternated with it (default: the same)")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--window", type=float, default=20.0, help="seconds of load before the updates")
    parser.add_argument("--interval", type=float, default=4.0, help="seconds between updates")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--policy", choices=["finish", "cut"], default="finish")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="engine config overrides")
    parser.add_argument("--output", help="write the JSON report here too")
    args = parser.parse_args(argv)

    from myserve.bundled import bundled_gguf_path
    from myserve.testing import start_service
    from myserve.wire.params import SamplingParams

    first = str(args.checkpoint or bundled_gguf_path())
    other = str(args.other or first)
    checkpoint = None if args.checkpoint is None else Path(args.checkpoint)
    service = start_service(checkpoint, *args.set, "engine.enable_weight_updates=true")
    arrivals: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()
    try:
        wait_built(service)
        prompts = builtin_chat_prompts(service.tokenizer, args.streams)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

        def stream(i: int) -> None:
            while not stop.is_set():
                for out in service.submit(prompts[i % len(prompts)], params):
                    if out.error or out.finish_reason in ("error", "abort"):
                        with lock:
                            failures.append(out.error or str(out.finish_reason))
                    if out.token_ids:
                        with lock:
                            arrivals.append(time.perf_counter())
                i += 1

        workers = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(args.streams)]
        for w in workers:
            w.start()
        time.sleep(2.0)  # the streams ramp up
        t0 = time.perf_counter()
        time.sleep(args.window)
        t1 = time.perf_counter()
        compiled = service.stats().compile_count
        switches = []
        for n in range(args.updates):
            path = other if n % 2 == 0 else first
            started = time.perf_counter()
            error, info = asyncio.run(service.update_weights(path, f"v{n + 1}", args.policy))
            switches.append(time.perf_counter() - started)
            if error is not None:
                failures.append(f"update {n + 1}: {error}")
            time.sleep(max(0.0, args.interval - switches[-1]))
        t2 = time.perf_counter()
        compiled_during = service.stats().compile_count - compiled
        stop.set()
        for w in workers:
            w.join(timeout=300)
    finally:
        stop.set()
        service.shutdown()
    result = {
        "checkpoint": first,
        "other": other,
        "streams": args.streams,
        "policy": args.policy,
        "switch_seconds": [round(s, 3) for s in switches],
        "without_updates": _window(arrivals, t0, t1),
        "with_updates": _window(arrivals, t1, t2),
        "failed": len(failures),
        "failures": failures[:5],
        "compiled_during_updates": compiled_during,
    }
    report(result, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
