"""``python -m myserve.serve`` runs the engine core in its own process: requests go through it, a
dead core errors every open request and the server exits non-zero within seconds, a dead front end
takes the core down with it, SIGTERM stops both with status 0. Stop strings are matched in the front
end, which aborts just the choice that matched."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_serve_supervision import EXIT_WITHIN_S, Served


class Server(Served):
    """``python -m myserve.serve`` on a tiny model, ready, with its engine core process's pid."""

    def __init__(self, checkpoint: Path):
        super().__init__(checkpoint)
        self.wait_ready()
        self.core = self._core_pid()

    def _core_pid(self) -> int:
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        cores = [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
        assert len(cores) == 1, children
        return cores[0]

    def exit_code(self, within: float = EXIT_WITHIN_S) -> int | None:
        try:
            return self.proc.wait(timeout=within)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        _gone(self.core, 10)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def server(tiny_checkpoints):
    s = Server(tiny_checkpoints["llama3"])
    yield s
    s.stop()


def _body(**kw) -> dict:
    return {"model": "tiny", "prompt": [40, 41, 42], "max_tokens": 16, "temperature": 0, **kw}  # a 256-token vocabulary


@pytest.mark.slow
def test_requests_go_through_the_core_process_and_stop_strings_end_one_choice(server) -> None:
    assert _alive(server.core)
    free = httpx.post(f"{server.url}/v1/completions", json=_body(n=3, temperature=1.0, seed=1), timeout=60).json()
    assert "choices" in free, (free, server.log[-3000:])
    texts = [c["text"] for c in free["choices"]]
    # A stop string taken from the first choice's text (at the same seed it comes out the same).
    stop = texts[0][3:5]
    assert stop.strip(), texts
    cut = httpx.post(f"{server.url}/v1/completions", json=_body(n=3, temperature=1.0, seed=1, stop=[stop]), timeout=60)
    choices = cut.json()["choices"]
    assert choices[0]["text"] == texts[0][: texts[0].index(stop)] and choices[0]["finish_reason"] == "stop"
    for got, full in zip(choices[1:], texts[1:], strict=True):  # siblings go on to their own end
        assert got["text"] == (full[: full.index(stop)] if stop in full else full)
    usage = cut.json()["usage"]
    assert usage["completion_tokens"] < free["usage"]["completion_tokens"], "usage ends at the stop"


@pytest.mark.slow
def test_a_dead_core_errors_open_requests_and_the_server_exits_non_zero(server) -> None:
    events: list[str] = []
    answers: list[httpx.Response] = []

    long = {"max_tokens": 480, "ignore_eos": True, "n": 8}  # seconds of work for the tiny model

    def stream() -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=_body(**long, stream=True), timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)

    def whole() -> None:
        answers.append(httpx.post(f"{server.url}/v1/completions", json=_body(**long), timeout=60))

    threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while len(events) < 3:  # mid-stream
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(server.core, signal.SIGKILL)
    killed = time.monotonic()
    for t in threads:
        t.join(timeout=10)
    assert server.exit_code() == 1, server.log[-2000:]
    assert time.monotonic() - killed < EXIT_WITHIN_S
    assert "engine_error" in events[-1] and "data: [DONE]" not in events
    assert answers and answers[0].status_code == 500 and answers[0].json()["error"]["code"] == "engine_error"


@pytest.mark.slow
def test_a_dead_front_end_takes_the_core_down(server) -> None:
    server.proc.kill()
    assert _gone(server.core, EXIT_WITHIN_S), "the engine core outlived its front end"


@pytest.mark.slow
def test_sigterm_stops_both_processes_with_status_zero(server) -> None:
    server.proc.send_signal(signal.SIGTERM)
    assert server.exit_code(30) == 0, server.log[-2000:]
    assert _gone(server.core, EXIT_WITHIN_S)
