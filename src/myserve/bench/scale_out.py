"""``python -m myserve.bench.scale_out``: replicas behind one address against one server, same run.

Setups, each started fresh and stopped after its load (rounds alternate their order):

- ``direct``: one ``python -m myserve.serve``;
- ``vllm-router x1`` / ``vllm-router x2``: ``vllm-router --policy round_robin`` in front of one or
  two servers (x1 against ``direct`` is the router's added latency);
- ``ray x1`` / ``ray x2``: ``python -m myserve.serve --ray-replicas N`` (Ray Serve's proxy, the
  ingress and N engine replicas on a local Ray cluster).

Each gets the same streamed completions: ``--requests-c1`` one at a time, then ``--requests-c64``
with 64 in flight. Prints a table (output tokens per second, TTFT and end-to-end latency) and the
ratios against ``direct``; ``--output`` writes it as JSON. Example (the yardstick, host-bound)::

    python -m myserve.bench.random_checkpoint tiny-llama /tmp/tiny-llama
    python -m myserve.bench.scale_out --serve-args "--hf-checkpoint /tmp/tiny-llama" --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from myserve.bench.launch import LaunchedServer, free_port
from myserve.bench.loadgen import Target, first_model_id, import_httpx, make_client, run_level
from myserve.bench.metrics import LevelSummary, summarize

SETUPS = ("direct", "vllm-router x1", "vllm-router x2", "ray x1", "ray x2")


@contextlib.contextmanager
def started(setup: str, serve_args: Sequence[str], ready_timeout_s: float) -> Iterator[str]:
    """Start ``setup``; its base URL until the block ends (then everything is stopped)."""
    kind, _, count = setup.partition(" x")
    replicas = int(count or 1)
    if kind == "ray":
        with LaunchedServer([*serve_args, "--ray-replicas", str(replicas)], ready_timeout_s, 60.0) as server:
            yield server.url
        return
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(LaunchedServer(list(serve_args), ready_timeout_s)) for _ in range(replicas)]
        if kind == "direct":
            yield servers[0].url
            return
        yield stack.enter_context(_router([s.url for s in servers]))


@contextlib.contextmanager
def _router(workers: list[str]) -> Iterator[str]:
    binary = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
    port, metrics = free_port(), free_port()
    cmd = [binary, "--port", str(port), "--policy", "round_robin", "--worker-urls", *workers]
    cmd += ["--worker-startup-check-interval", "1", "--prometheus-port", str(metrics), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    httpx = import_httpx()
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited with code {proc.returncode}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("vllm-router was not ready in 120 s")
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def measure(url: str, args: argparse.Namespace) -> dict[str, LevelSummary]:
    """The c=1 and c=64 levels against ``url`` (after a few discarded requests)."""
    model = first_model_id(url, {})
    target = Target(f"{url}/v1/completions", {}, 600.0)

    def bodies(n: int, tag: str) -> list[dict[str, Any]]:
        return [
            {
                "model": model,
                "prompt": f"{tag} request {i}: write a short story about a lighthouse keeper.",
                "max_tokens": args.max_tokens,
                "ignore_eos": True,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            for i in range(n)
        ]

    async with make_client(64 + 8, 600.0) as client:
        await run_level(client, target, bodies(8, "warmup"), 8)
        one = await run_level(client, target, bodies(args.requests_c1, "c1"), 1)
        many = await run_level(client, target, bodies(args.requests_c64, "c64"), 64)
    return {"c1": summarize(one), "c64": summarize(many)}


def row(setup: str, levels: dict[str, LevelSummary]) -> dict[str, Any]:
    """One setup's figures (medians of TTFT and end-to-end latency)."""
    one, many = levels["c1"], levels["c64"]
    return {
        "setup": setup,
        "c1_e2e_ms": (one.e2e_s.p50 or 0.0) * 1000,
        "c1_ttft_ms": one.ttft_ms.p50 or 0.0,
        "c1_tok_s": one.output_tokens_per_s,
        "c64_tok_s": many.output_tokens_per_s,
        "c64_ttft_ms": many.ttft_ms.p50 or 0.0,
        "failed": one.requests_failed + many.requests_failed,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run every setup ``--rounds`` times (alternating order); print and optionally save the table."""
    p = argparse.ArgumentParser(prog="python -m myserve.bench.scale_out", description=__doc__)
    p.add_argument("--serve-args", default="", help='the servers\' arguments, e.g. "--hf-checkpoint /tmp/tiny-llama"')
    p.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, of: {', '.join(SETUPS)}")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests-c1", type=int, default=16)
    p.add_argument("--requests-c64", type=int, default=192)
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--output", help="write the rows as JSON here")
    args = p.parse_args(argv)
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    unknown = [s for s in setups if s not in SETUPS]
    if unknown:
        p.error(f"unknown setups {unknown}; known: {', '.join(SETUPS)}")
    serve_args = shlex.split(args.serve_args)
    rows = []
    for r in range(args.rounds):
        for setup in setups if r % 2 == 0 else list(reversed(setups)):
            with started(setup, serve_args, args.ready_timeout) as url:
                rows.append({"round": r, **row(setup, asyncio.run(measure(url, args)))})
            print(json.dumps(rows[-1]), file=sys.stderr)
    print(table(rows))
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=2))
    return 0


def table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of every row, then each setup's mean ratios against ``direct`` in its round."""
    lines = [
        "| round | setup | c=1 e2e ms | c=1 TTFT ms | c=1 tok/s | c=64 tok/s | c=64 TTFT ms | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for x in rows:
        lines.append(
            f"| {x['round']} | {x['setup']} | {x['c1_e2e_ms']:.0f} | {x['c1_ttft_ms']:.1f} | {x['c1_tok_s']:.0f} "
            f"| {x['c64_tok_s']:.0f} | {x['c64_ttft_ms']:.0f} | {x['failed']} |"
        )
    base = {x["round"]: x for x in rows if x["setup"] == "direct"}
    if base:
        lines += ["", "| setup | c=1 e2e vs direct | c=64 tok/s vs direct |", "|---|---|---|"]
        for setup in dict.fromkeys(x["setup"] for x in rows):
            pairs = [(x, base[x["round"]]) for x in rows if x["setup"] == setup and x["round"] in base]
            e2e = sum(x["c1_e2e_ms"] / b["c1_e2e_ms"] for x, b in pairs) / len(pairs)
            tput = sum(x["c64_tok_s"] / b["c64_tok_s"] for x, b in pairs) / len(pairs)
            lines.append(f"| {setup} | {e2e:.2f}x | {tput:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
