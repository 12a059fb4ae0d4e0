"""``python -m myserve.bench.startup``: start-up and the first minute after ``ready``, as a new
user meets them.

Starts the default server (``python -m myserve.serve``, any extra ``--serve-arg`` passed on) over
an empty step cache (cold) and times it to its ``ready`` log line and until the idle engine has
run every executable once (``primed``), stops it, starts it again over the cache it filled
(warm), sends ``--requests`` 8-token chat requests one after another from ``ready``, waits for
``primed`` and sends the same again: the first ones against the primed ones is what a user who
arrives just after a restart pays. Also the warmup log line (compiled / loaded) and the engine
process's peak count of memory mappings (XLA:CPU maps each kernel on its own; a process may hold
``vm.max_map_count``). To compare trees, run each tree's copy of this module with that tree's
``src`` on ``PYTHONPATH``, alternating.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_BODY = {
    "model": "SmolLM2-135M-Instruct",  # the default server's; --model for another
    "messages": [{"role": "user", "content": "Tell me about the sea."}],
    "max_tokens": 8,
    "temperature": 0,
}


class Server:
    """One ``myserve.serve`` process and what its log said when."""

    def __init__(self, args: argparse.Namespace):
        self.t0 = time.perf_counter()
        command = [sys.executable, "-m", "myserve.serve", "--port", str(args.port)]
        command += ["--set", f"engine.compilation_cache_dir={args.cache_dir}", *args.serve_arg]
        self.proc = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.port, self.model = args.port, args.model
        self.ready, self.primed = threading.Event(), threading.Event()
        self.warmup_line: str | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=20)
        """The last lines of its log (what a server that exited said last)."""
        self.peak_mappings = 0
        self._done = threading.Event()
        self._code: int | None = None
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=self._count_mappings, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.tail.append(line.rstrip())
            if " ready on " in line:
                self.ready.set()
            elif "has run once" in line:
                self.primed.set()
            elif "warmup:" in line:
                self.warmup_line = line.strip()

    def _count_mappings(self) -> None:
        """The peak of the server's and its children's mappings (the engine core is a child)."""
        while not self._done.is_set():
            for proc in Path("/proc").glob("[0-9]*"):
                try:
                    parent = (proc / "stat").read_text().split()[3]
                    if proc.name == str(self.proc.pid) or parent == str(self.proc.pid):
                        with open(proc / "maps") as f:
                            self.peak_mappings = max(self.peak_mappings, sum(1 for _ in f))
                except (OSError, IndexError):
                    continue
            time.sleep(2)

    def wait(self, event: threading.Event, what: str, timeout: float) -> None:
        """Wait for ``event`` (``ready`` or ``primed``); exit with the log's tail if the server
        exits first or ``timeout`` seconds pass."""
        until = time.perf_counter() + timeout
        while not event.wait(0.5):
            if self.proc.poll() is not None:
                time.sleep(0.5)  # (the pump reads the last lines)
                log = "\n".join(self.tail)
                raise SystemExit(f"the server exited ({self.proc.returncode}) before {what}:\n{log}")
            if time.perf_counter() > until:
                self.stop()
                raise SystemExit(f"the server was not {what} in {timeout:.0f} s")

    def since_start(self) -> float:
        """Seconds since the process was started."""
        return time.perf_counter() - self.t0

    def chat(self) -> float:
        """Seconds of one 8-token chat request, answered."""
        t = time.perf_counter()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/chat/completions",
            json.dumps({**_BODY, "model": self.model}).encode(),
            {"Content-Type": "application/json"},
        )
        urllib.request.urlopen(request, timeout=300).read()
        return time.perf_counter() - t

    def stop(self) -> int | None:
        """Stop the server (again: nothing); its exit code if it had already exited by itself (None:
        it was running)."""
        if self._done.is_set():
            return self._code
        self._code = self.proc.poll()
        self._done.set()
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        return self._code


def _median(values: Sequence[float]) -> float:
    v = sorted(values)
    return (v[(len(v) - 1) // 2] + v[len(v) // 2]) / 2


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Cold then warm start, the requests after the warm ``ready`` and after ``primed``."""
    shutil.rmtree(args.cache_dir, ignore_errors=True)
    out: dict[str, Any] = {"argv": args.serve_arg}
    cold = Server(args)
    try:
        cold.wait(cold.ready, "ready (cold)", args.timeout)
        out["cold_ready_s"] = cold.since_start()
        out["cold_warmup"] = cold.warmup_line
        cold.wait(cold.primed, "primed (cold)", args.timeout)
        out["cold_primed_s"] = cold.since_start()
    finally:
        out["cold_exited"] = cold.stop()
    warm = Server(args)
    try:
        warm.wait(warm.ready, "ready (warm)", args.timeout)
        out["warm_ready_s"] = warm.since_start()
        out["warm_warmup"] = warm.warmup_line
        out["first_s"] = [warm.chat() for _ in range(args.requests)]
        warm.wait(warm.primed, "primed (warm)", args.timeout)
        out["warm_primed_s"] = warm.since_start()
        out["primed_s"] = [warm.chat() for _ in range(args.requests)]
        out["first_over_primed"] = _median(out["first_s"]) / _median(out["primed_s"])
        out["peak_mappings"] = max(cold.peak_mappings, warm.peak_mappings)
    finally:
        out["warm_exited"] = warm.stop()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, print the JSON (and write it to ``--output``); 1 if a server exited by itself."""
    p = argparse.ArgumentParser(prog="python -m myserve.bench.startup", description=__doc__)
    p.add_argument("--port", type=int, default=8111)
    p.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "myserve-startup-cache")
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--model", default=_BODY["model"], help="the served model's name the requests ask for")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for ready, and for primed")
    p.add_argument("--serve-arg", action="append", default=[], help="an argument for myserve.serve (repeat)")
    p.add_argument("--output", type=Path)
    args = p.parse_args(argv)
    out = measure(args)
    text = json.dumps(out, indent=1)
    if args.output is not None:
        args.output.write_text(text)
    print(text)
    return 0 if out["cold_exited"] is None and out["warm_exited"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
