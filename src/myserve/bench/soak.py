"""``python -m myserve.bench.soak --minutes N``: a soak test of ``python -m myserve.serve``.

Launches the server (bundled model, the Hermes tool template and parser, a small waiting queue;
serve arguments after ``--`` are appended), then for N minutes ``--clients`` concurrent clients on
127.0.0.1 send a mix of requests: chat and completions, streamed and not, n > 1, presence /
frequency / repetition penalties, logprobs and top_logprobs, grammars (``response_format``
json_schema, ``structured_outputs`` regex and choice), a forced tool call, prompts near the context
limit; ``--disconnect-fraction`` of them hang up at a random point (before the answer, or mid-stream),
and every ``--burst-every-s`` a burst of ``--burst-size`` requests at once goes over the queue limit
(429 with Retry-After is an expected answer). Constrained outputs that finish are checked against
their grammar. Then it goes idle and checks: no request running or waiting, no KV page held by a
sequence, no grammar matcher alive, no penalty slot owned, no 5xx (or other failure) at any time,
``/health`` still 200, and the resident memory of the front end and of the engine core no more
than ``--rss-tolerance`` above its value ``--baseline-after-s`` into the run. Prints a summary and
exits 1 when a check fails (2 for a usage or start-up error).

Example (a short trial; the real soak is ``--minutes 20`` with the default one-minute baseline)::

    python -m myserve.bench.soak --minutes 2 --baseline-after-s 30
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from myserve.bench.launch import LaunchedServer, LaunchError
from myserve.bench.loadgen import first_model_id, import_httpx, make_client
from myserve.bench.prompts import BUILTIN_PROMPTS
from myserve.bench.soak_checks import (
    DISCONNECTED,
    IDLE_GAUGES,
    OK,
    OVERLOADED,
    Check,
    Tally,
    core_pid,
    evaluate,
    format_summary,
    parse_metrics,
    rss_kb,
)
from myserve.bench.soak_requests import CHAT, WEIGHTS, Req, build, exchange

_TEMPLATE = Path(__file__).resolve().parents[3] / "config/templates/hermes-tools.jinja"


@dataclass
class Soak:
    args: argparse.Namespace
    url: str
    model: str
    pids: dict[str, int]
    client: Any = None
    long_text: str = ""
    tally: Tally = field(default_factory=Tally)
    rss: dict[str, list[int | None]] = field(default_factory=dict)  # process -> [baseline, peak, end]
    peaks: dict[str, float] = field(default_factory=dict)
    health_failures: list[str] = field(default_factory=list)
    start: float = 0.0
    deadline: float = 0.0
    traffic_s: float = 0.0

    async def send(self, req: Req, hang: tuple[str, float] | None = None) -> float:
        """One request, counted in the tally; ``hang``: ("before", seconds) or ("mid", events).
        Returns how long a polite client now waits: the Retry-After of a 429, else 0."""
        httpx = import_httpx()
        try:
            async with asyncio.timeout(self.args.request_timeout_s):
                if hang is None:
                    outcome, detail, tokens = await exchange(self.client, self.url, req, None)
                else:  # a client of its own, whose connection closes when it hangs up
                    async with make_client(1, self.args.request_timeout_s) as own:
                        task = asyncio.create_task(
                            exchange(own, self.url, req, int(hang[1]) if hang[0] == "mid" else None)
                        )
                        done, _ = await asyncio.wait({task}, timeout=hang[1] if hang[0] == "before" else None)
                        if task not in done:
                            task.cancel()
                            with contextlib.suppress(asyncio.CancelledError):
                                await task
                        outcome, detail, tokens = task.result() if task in done else (DISCONNECTED, "", 0)
        except (TimeoutError, httpx.TimeoutException) as e:
            outcome, detail, tokens = "timeout", repr(e), 0
        except httpx.TransportError as e:
            outcome, detail, tokens = "transport", repr(e), 0
        except (httpx.HTTPError, ValueError, LookupError, TypeError, AttributeError) as e:
            outcome, detail, tokens = "bad_output", repr(e), 0
        if outcome == OVERLOADED and not detail:
            self.tally.missing_retry_after += 1
        self.tally.add(req.scenario, outcome, f"{detail} (request: {json.dumps(req.body)[:300]})", tokens)
        retry_after = 0.0
        if outcome == OVERLOADED:
            retry_after = 1.0
            with contextlib.suppress(ValueError):
                retry_after = float(detail)
        return retry_after

    async def client_loop(self, index: int) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        while time.monotonic() < self.deadline:
            req = build(rng.choices(list(WEIGHTS), list(WEIGHTS.values()))[0], rng, self.model, self.long_text)
            hang = None
            if rng.random() < self.args.disconnect_fraction:
                mid = req.body.get("stream") and rng.random() < 0.6
                hang = ("mid", rng.randint(1, 12)) if mid else ("before", rng.uniform(0.0, 1.5))
            retry_after = await self.send(req, hang)
            await asyncio.sleep(min(retry_after, max(0.0, self.deadline - time.monotonic())))

    async def burst_loop(self) -> None:
        rng, at = random.Random(self.args.seed - 1), self.start + self.args.burst_every_s / 2
        while self.args.burst_size > 0 and at < self.deadline:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            reqs = [build("burst", rng, self.model, "") for _ in range(self.args.burst_size)]
            await asyncio.gather(*(self.send(r) for r in reqs))
            at += self.args.burst_every_s

    async def probe(self) -> dict[str, float] | None:
        """Sample RSS, ``/health`` and ``/metrics``; the metrics, or None when they could not be read."""
        for name, pid in self.pids.items():
            kb, mem = rss_kb(pid), self.rss.setdefault(name, [None, None, None])
            mem[1], mem[2] = max(mem[1] or 0, kb or 0) or None, kb
        figures = None
        for path in ("/health", "/metrics"):
            try:
                r = await self.client.get(self.url + path, timeout=10.0)
            except import_httpx().HTTPError as e:
                self.health_failures.append(f"{path}: {e!r}")
                continue
            self.tally.other_5xx += r.status_code >= 500
            if r.status_code != 200:
                self.health_failures.append(f"{path}: HTTP {r.status_code}")
            elif path == "/metrics":
                figures = parse_metrics(r.text)
                for name in [*IDLE_GAUGES, "myserve_kv_pages_total"]:
                    self.peaks[name] = max(self.peaks.get(name, 0.0), figures.get(name, 0.0))
        return figures

    async def monitor(self) -> None:
        report_at = self.start + 60
        while time.monotonic() < self.deadline:
            await self.probe()
            now = time.monotonic()
            if now - self.start >= self.args.baseline_after_s and self.rss[next(iter(self.pids))][0] is None:
                for mem in self.rss.values():
                    mem[0] = mem[2]
                print(f"RSS baseline after {now - self.start:.0f} s: {self._rss_text()}", file=sys.stderr)
            if now >= report_at:
                report_at += 60
                counts = ", ".join(f"{o} {self.tally.total(o)}" for o in ("ok", "disconnected", "429"))
                failed = sum(n for (_, o), n in self.tally.counts.items() if o not in (OK, DISCONNECTED, OVERLOADED))
                print(f"{now - self.start:.0f} s: {counts}, failed {failed}; {self._rss_text()}", file=sys.stderr)
            await asyncio.sleep(min(self.args.probe_every_s, max(0.0, self.deadline - time.monotonic())))

    def _rss_text(self) -> str:
        return ", ".join(f"{n} {(m[2] or 0) / 1024:.1f} MiB" for n, m in self.rss.items())

    async def run(self) -> tuple[dict[str, float] | None, bool, str]:
        """Traffic, then idle; (metrics once idle, healthy, why not)."""
        async with make_client(self.args.clients + self.args.burst_size + 4, self.args.request_timeout_s) as client:
            self.client = client
            self.long_text = await self.calibrate_long_prompt()
            self.start = time.monotonic()
            self.deadline = self.start + self.args.minutes * 60
            loops = [self.client_loop(i) for i in range(self.args.clients)]
            await asyncio.gather(*loops, self.burst_loop(), self.monitor())
            self.traffic_s = time.monotonic() - self.start
            idle_by = time.monotonic() + self.args.idle_timeout_s
            while (idle := await self.probe()) is None or any(idle.get(g) != 0 for g in IDLE_GAUGES):
                if time.monotonic() > idle_by:
                    break
                await asyncio.sleep(0.5)
            await asyncio.sleep(2.0)  # let the processes settle before the last RSS reading
            await self.probe()
            probe = Req(
                "final", CHAT, {"model": self.model, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
            )
            before = self.tally.total(OK)
            await self.send(probe)
            why = "; ".join(self.health_failures[:3]) + (" ..." if len(self.health_failures) > 3 else "")
            healthy = not self.health_failures and self.tally.total(OK) == before + 1
            return idle, healthy, why or "every /health and /metrics probe answered 200, a last request too"

    async def calibrate_long_prompt(self) -> str:
        """Text of ``--long-prompt-tokens`` tokens (cut with the server's own tokenizer)."""
        text, tokens = " ".join(BUILTIN_PROMPTS), list[int]()
        while len(tokens) < self.args.long_prompt_tokens:
            text += "\n\n" + text
            r = await self.client.post(self.url + "/tokenize", json={"prompt": text, "add_special_tokens": False})
            tokens = r.raise_for_status().json()["tokens"]
        r = await self.client.post(self.url + "/detokenize", json={"tokens": tokens[: self.args.long_prompt_tokens]})
        return str(r.raise_for_status().json()["prompt"])


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m myserve.bench.soak", usage="%(prog)s [options] [-- SERVE_ARGS ...]",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--minutes", type=float, default=20.0, help="traffic time")
    p.add_argument("--baseline-after-s", type=float, default=60.0, help="when the RSS baseline is taken")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (bursts come on top)")
    p.add_argument("--disconnect-fraction", type=float, default=0.3, help="requests whose client hangs up")
    p.add_argument("--burst-size", type=int, default=64, help="requests sent at once per burst (0: none)")
    p.add_argument("--burst-every-s", type=float, default=45.0)
    p.add_argument("--max-waiting", type=int, default=32, help="the server's engine.max_waiting")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--long-prompt-tokens", type=int, default=1800)
    p.add_argument("--rss-tolerance", type=float, default=0.05, help="allowed RSS growth over the baseline")
    p.add_argument("--probe-every-s", type=float, default=5.0, help="RSS, /health and /metrics sampling")
    p.add_argument("--idle-timeout-s", type=float, default=60.0, help="wait for the gauges to reach 0")
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--launch-timeout", type=float, default=900.0, help="seconds to wait for /health")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 0 < args.baseline_after_s < args.minutes * 60:
        p.error("--baseline-after-s must fall inside the run (--minutes)")
    if args.clients < 1 or args.burst_size < 0 or not 0 <= args.disconnect_fraction <= 1:
        p.error("--clients must be positive, --burst-size not negative, --disconnect-fraction in [0, 1]")
    if args.long_prompt_tokens + 48 > args.max_model_len:
        p.error("--long-prompt-tokens leaves no room for the answer within --max-model-len")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    template = _TEMPLATE if _TEMPLATE.exists() else Path("config/templates/hermes-tools.jinja")
    serve_args = ["--chat-template", str(template), "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                  "--max-model-len", str(args.max_model_len), "--set", f"engine.max_waiting={args.max_waiting}",
                  *serve_extra]  # fmt: skip
    server = LaunchedServer(serve_args, ready_timeout_s=args.launch_timeout)
    try:
        server.start()
    except (LaunchError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        assert server.proc is not None
        pids = {"front end": server.proc.pid}
        core = core_pid(server.proc.pid)
        if core is not None:
            pids["core"] = core
        else:
            print("warning: no engine core child (server.engine_process=false?): one process measured", file=sys.stderr)
        print(f"launched {' '.join(server.command)} at {server.url}, pids {pids}", file=sys.stderr)
        soak = Soak(args, server.url, first_model_id(server.url, {}), pids)
        idle, healthy, why = asyncio.run(soak.run())
    finally:
        code = server.stop()
    checks = evaluate(soak.tally, idle, healthy, why, {n: (m[0], m[2]) for n, m in soak.rss.items()},
                      args.rss_tolerance, bursts=args.burst_size > 0)  # fmt: skip
    checks.append(Check("server exited 0 on SIGTERM", code == 0, f"exit code {code}"))
    rss = {n: (m[0], m[1], m[2]) for n, m in soak.rss.items()}
    print(format_summary(soak.tally, soak.traffic_s, rss, idle, soak.peaks, checks))
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
