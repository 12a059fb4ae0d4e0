"""``python -m myserve.serve`` (or a launcher of it) as a child process, for the tests that need the
real command: its output lines with the time each arrived, readiness by ``/health``, its exit code,
and whether the processes it started are gone. The supervision, core-process and several-models
tests build their servers on it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import httpx
from test_server import free_port


class ServeProcess:
    """A serve command on a free port (``--port`` is appended), its log read on a thread."""

    def __init__(
        self, entry: Sequence[str], args: Sequence[str], env: dict[str, str] | None = None, cafile: str | None = None
    ):
        """``entry``: what follows the interpreter (``-m myserve.serve``, or a launcher script);
        ``env``: added to this process's environment (JAX on the CPU); ``cafile``: the server
        speaks HTTPS with a certificate this file vouches for."""
        self.port = free_port()
        self.verify: str | bool = cafile or True
        self.url = f"{'https' if cafile else 'http'}://127.0.0.1:{self.port}"
        cmd = [sys.executable, *entry, "--port", str(self.port), *args]
        env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[tuple[float, str]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in iter(self.proc.stdout.readline, ""):
            self.lines.append((time.monotonic(), line))

    @property
    def log(self) -> str:
        """Everything it printed so far."""
        return "".join(line for _, line in self.lines)

    def wait_ready(self, timeout: float = 300) -> None:
        """Until ``/health`` answers 200; fails if the process ends or ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, self.log[-4000:]
            try:
                if httpx.get(f"{self.url}/health", timeout=2, verify=self.verify).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server never became ready:\n" + self.log[-4000:]
            time.sleep(0.2)

    def exit_code(self, within: float) -> int | None:
        """Its exit status once it ends within ``within`` seconds, else None."""
        try:
            return self.proc.wait(timeout=within)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGKILL, if it still runs."""
        if self.proc.poll() is None:
            self.proc.kill()

    def stop(self, children: Iterable[int] = ()) -> None:
        """Kill it and wait; then ``children`` (pids it started) must be gone within 10 s."""
        self.kill()
        self.proc.wait()
        for pid in children:
            assert gone(pid, 10), f"process {pid} outlived the server"


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as ended)."""
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def gone(pid: int, within: float) -> bool:
    """Whether ``pid`` has ended, waiting up to ``within`` seconds."""
    deadline = time.monotonic() + within
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
