"""``python -m myserve.bench.host``: the host's cost per generated token, by phase, against the
device-only ceiling of the same step executables.

Serves the host-bound yardstick (a random Llama with SmolLM2's tokenizer: ``--shape tiny-llama``, 2
layers of hidden 64; ``tiny-llama-16`` for 16) in process, for each K of ``--decode-steps`` (tokens
per decode call) and each concurrency of ``--concurrency``: that many greedy requests of
``--max-tokens`` tokens at once, consumed by asyncio tasks in one event loop as the HTTP server's
are. Every level is timed in the steady state (``steady.py``: background builds done, every
executable run once; nothing may compile while timed).

For each level: tokens/s; microseconds per generated token in each phase of the engine thread
(``core/step_timer.py``: schedule, plan, dispatch, read, postprocess, deliver) and in the output
thread (detokenizing, stop strings, delivery to the streams); and the **device-only ceiling**:
each step executable the level called, timed alone (calls dispatched back to back on an empty batch
of its shape, no host work between them: ``runtime/priming.py``), times the number of calls the
level made. ``of_ceiling`` is tokens/s over the ceiling's; ``host_us_per_token`` the wall time
outside those executable calls per token: what the host adds (on two cores the host and XLA's
threads share the machine, so part of it is the device's work slowed by the host's, not only
Python).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from myserve.bench import steady
from myserve.wire.params import SamplingParams


async def _consume(service: Any, prompts: list[list[int]], params: SamplingParams) -> tuple[int, list[float]]:
    """Submit every prompt at once and read every stream in this event loop: (tokens, TTFTs)."""
    t0 = time.perf_counter()
    streams = [service.submit(p, params) for p in prompts]

    async def drain(stream: Any) -> tuple[int, float]:
        n, first = 0, float("nan")
        async for out in stream:
            if out.token_ids and n == 0:
                first = time.perf_counter() - t0
            n += len(out.token_ids)
        return n, first

    got = await asyncio.gather(*(drain(s) for s in streams))
    return sum(n for n, _ in got), sorted(f for _, f in got)


def _wait_idle(service: Any, timeout: float = 60.0) -> None:
    """Until the engine has nothing in flight (its last step read) and the output thread is done."""
    until = time.monotonic() + timeout
    while service.has_work() and time.monotonic() < until:
        time.sleep(0.001)


class Ceiling:
    """Device seconds per call of each step executable of a service's one replica, measured once."""

    def __init__(self, service: Any, calls: int):
        self.executor = service.replicas[0].runner.device
        self.calls = calls
        self.per_call: dict[tuple, float] = {}

    def seconds(self, ran: collections.Counter) -> float:
        """Device-only seconds of ``ran`` (key -> calls): each key's time alone, times its calls."""
        from myserve.runtime.priming import seconds_per_call

        for key in ran:
            if key not in self.per_call:
                self.per_call[key] = seconds_per_call(self.executor, key, self.calls)
        return sum(n * self.per_call[key] for key, n in ran.items())


def measure_level(service: Any, ceiling: Ceiling, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """One timed level: every prompt at once; its figures (see the module's docstring)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    asyncio.run(_consume(service, prompts[: max(1, len(prompts) // 4)], params))  # this level's shapes, once
    _wait_idle(service)
    outputs = getattr(service, "outputs", None)  # (a tree whose engine thread detokenizes has none)
    phases0, out0 = dict(service.timer.seconds), outputs.seconds if outputs else 0.0
    section = steady.Section(service)
    calls0 = steady.calls(service)
    t0 = time.perf_counter()
    tokens, ttfts = asyncio.run(_consume(service, prompts, params))
    elapsed = time.perf_counter() - t0
    _wait_idle(service)
    ran = steady.calls(service) - calls0
    fields, problems = section.finish(tokens, one_stream=False)
    phases = {p: service.timer.seconds[p] - phases0[p] for p in phases0}
    device_s = ceiling.seconds(ran)
    per_token = 1e6 / tokens
    return {
        "concurrency": len(prompts),
        "generated_tokens": tokens,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
        "ttft_p50_s": ttfts[len(ttfts) // 2],
        "ceiling_tokens_per_s": tokens / device_s,
        "of_ceiling": device_s / elapsed,
        "device_us_per_token": device_s * per_token,
        "host_us_per_token": (elapsed - device_s) * per_token,
        "engine_us_per_token": {p: s * per_token for p, s in phases.items()},
        "output_thread_us_per_token": (outputs.seconds - out0) * per_token if outputs else 0.0,
        **fields,
        "error": "; ".join(problems) or None,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every K and concurrency of ``args``; the results (JSON-ready)."""
    import jax

    from myserve.bench.engine import random_prompts
    from myserve.bench.random_checkpoint import make_random_llama
    from myserve.config import load_config
    from myserve.entrypoints.service import GenerationService
    from myserve.runtime.cpu_threads import single_threaded_dots_on_small_hosts
    from myserve.runtime.deployment import Deployment
    from myserve.runtime.host_memory import keep_freed_memory

    single_threaded_dots_on_small_hosts()  # as `serve` does (before JAX starts)
    tmp = tempfile.TemporaryDirectory()
    checkpoint = args.checkpoint or make_random_llama(args.shape, Path(tmp.name) / args.shape, dtype="float32")
    if jax.default_backend() == "cpu":
        keep_freed_memory()  # as `serve` does
    results: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "jax": jax.__version__},
        "checkpoint": str(args.checkpoint or args.shape),
        "max_tokens": args.max_tokens,
        "prompt_tokens": args.prompt_tokens,
        "set": args.set,
        "runs": [],
    }
    for k in args.decode_steps:
        config = load_config(None, [f"model.checkpoint={checkpoint}", f"engine.decode_steps={k}", *args.set])
        dep = Deployment.load(config)
        service = GenerationService.from_deployment(dep)
        service.start()
        try:
            steady.wait_steady(service, args.steady_timeout)
            ceiling = Ceiling(service, args.ceiling_calls)
            vocab = min(dep.tokenizer.vocab_size, dep.model.spec.vocab_size)
            for c in args.concurrency:
                prompts = random_prompts(vocab, c, args.prompt_tokens)
                level = measure_level(service, ceiling, prompts, args.max_tokens)
                results["runs"].append({"decode_steps": k, **level})
                print(_line(results["runs"][-1]), file=sys.stderr, flush=True)
        finally:
            service.shutdown()
    tmp.cleanup()
    return results


def _line(r: dict[str, Any]) -> str:
    phases = " ".join(f"{p} {us:.1f}" for p, us in r["engine_us_per_token"].items())
    return (
        f"K={r['decode_steps']} c={r['concurrency']}: {r['tokens_per_s']:.0f} tok/s, ceiling "
        f"{r['ceiling_tokens_per_s']:.0f} ({100 * r['of_ceiling']:.0f} %), host {r['host_us_per_token']:.1f} us/token "
        f"[engine: {phases}; output thread {r['output_thread_us_per_token']:.1f}]"
        + (f" ERROR {r['error']}" if r["error"] else "")
    )


def table(results: dict[str, Any]) -> str:
    """The results as a Markdown table: one row per K and concurrency."""
    runs = results["runs"]
    phases = list(runs[0]["engine_us_per_token"]) if runs else []
    head = ["K", "c", "tok/s", "ceiling tok/s", "of ceiling", "host us/token", *phases, "output thread"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        cells = [
            str(r["decode_steps"]),
            str(r["concurrency"]),
            f"{r['tokens_per_s']:,.0f}",
            f"{r['ceiling_tokens_per_s']:,.0f}",
            f"{100 * r['of_ceiling']:.0f} %",
            f"{r['host_us_per_token']:.1f}",
            *(f"{r['engine_us_per_token'][p]:.1f}" for p in phases),
            f"{r['output_thread_us_per_token']:.1f}",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: Sequence[str] | None = None) -> int:
    """Run, print the table (and write the JSON to ``--output``); 1 if a level was not steady."""
    p = argparse.ArgumentParser(prog="python -m myserve.bench.host", description=__doc__)
    p.add_argument("--shape", default="tiny-llama", help="random checkpoint shape (random_checkpoint.SHAPES)")
    p.add_argument("--checkpoint", default=None, help="serve this checkpoint instead of a random one")
    p.add_argument("--concurrency", type=_ints, default=[1, 64, 256], help="comma-separated levels")
    p.add_argument("--decode-steps", type=_ints, default=[1, 8], help="comma-separated K (engine.decode_steps)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--ceiling-calls", type=int, default=20, help="back-to-back calls timing each executable")
    p.add_argument("--steady-timeout", type=float, default=600.0)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="a config override")
    p.add_argument("--output", type=Path)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    results = run(args)
    if args.output is not None:
        args.output.write_text(json.dumps(results, indent=1))
    print(table(results))
    return 1 if any(r["error"] for r in results["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
