"""``--launch``: run ``python -m myserve.serve`` as a child process for the length of a benchmark.

The server gets a free port unless its arguments name one, is ready when ``GET /health`` answers
200, and is always stopped on the way out (SIGTERM, so it drains and exits 0; SIGKILL after a
grace period). If it dies or never becomes ready the error carries its last log lines.
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from types import TracebackType

from myserve.bench.loadgen import import_httpx

_LOG_LINES = 40


class LaunchError(RuntimeError):
    """The launched server exited or did not become ready in time."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class LaunchedServer:
    """A ``myserve.serve`` child process; use as a context manager, ``url`` once entered.

    ``serve_args`` are passed through unchanged; ``--host``/``--port`` in them are honoured.
    """

    def __init__(
        self,
        serve_args: Sequence[str],
        ready_timeout_s: float = 600.0,
        stop_grace_s: float = 30.0,
        env: dict[str, str] | None = None,
    ) -> None:
        known, _ = _host_port_parser().parse_known_args(list(serve_args))
        self.args = list(serve_args)
        host = known.host or "127.0.0.1"
        port = known.port
        if port is None:
            port = free_port()
            self.args += ["--port", str(port)]
        # A wildcard bind is reachable on loopback; the URL needs a concrete address.
        connect_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        self.url = f"http://{connect_host}:{port}"
        self.ready_timeout_s = ready_timeout_s
        self.stop_grace_s = stop_grace_s
        self.env = env
        self.log: collections.deque[str] = collections.deque(maxlen=_LOG_LINES)
        self.proc: subprocess.Popen[str] | None = None

    @property
    def command(self) -> list[str]:
        """The server's command line."""
        return [sys.executable, "-m", "myserve.serve", *self.args]

    def start(self) -> None:
        """Start the process and wait until it is ready; stops it and raises ``LaunchError`` if not."""
        self.proc = subprocess.Popen(
            self.command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env={**os.environ, **(self.env or {})},
        )
        stdout = self.proc.stdout
        assert stdout is not None
        # Drained continuously so a chatty server never blocks on a full pipe.
        threading.Thread(target=lambda: self.log.extend(iter(stdout.readline, "")), daemon=True).start()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        httpx = import_httpx()
        assert self.proc is not None
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise LaunchError(f"the server exited with code {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise LaunchError(f"the server was not ready within {self.ready_timeout_s:g}s:\n{self.log_tail()}")
            # Readiness of another process can only be polled; /health answers 503 while compiling.
            time.sleep(0.25)

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after the grace period; returns the exit code (None if never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.stop_grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log_tail(self) -> str:
        """The server's last log lines."""
        return "".join(self.log).rstrip() or "(no output)"

    def __enter__(self) -> LaunchedServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _host_port_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    return p
