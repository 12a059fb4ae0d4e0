"""``python -m myserve.serve`` runs the engine core in its own process: requests go through it, a
dead core errors every open request and the server exits non-zero within seconds, a dead front end
takes the core down with it, SIGTERM stops both with status 0. Stop strings are matched in the front
end, which aborts just the choice that matched. With ``--api-server-count 2`` two front ends share
the port and the core, /metrics merges their figures, and the same rules hold for all three."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import httpx
import pytest
from serve_process import alive, gone
from test_serve_supervision import EXIT_WITHIN_S, Served


class Server(Served):
    """``python -m myserve.serve`` on a tiny model, ready, with the pids of its engine core process
    and of its extra front ends (``--api-server-count``)."""

    def __init__(self, checkpoint: Path, args: tuple[str, ...] = (), env: dict | None = None):
        super().__init__(checkpoint, args=args, env=env)
        self.wait_ready()
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        spawned = [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
        found = re.search(r"engine core ready \(pid (\d+)\)", self.log)
        assert found and int(found[1]) in spawned, (spawned, self.log[-3000:])
        self.core = int(found[1])
        self.fronts = [pid for pid in spawned if pid != self.core]

    def exit_code(self, within: float = EXIT_WITHIN_S) -> int | None:
        return super().exit_code(within)

    def stop(self, children: Iterable[int] = ()) -> None:
        super().stop((self.core, *self.fronts, *children))


@pytest.fixture
def server(tiny_checkpoints):
    s = Server(tiny_checkpoints["llama3"])
    yield s
    s.stop()


def _body(**kw) -> dict:
    return {"model": "tiny", "prompt": [40, 41, 42], "max_tokens": 16, "temperature": 0, **kw}  # a 256-token vocabulary


@pytest.mark.slow
def test_requests_go_through_the_core_process_and_stop_strings_end_one_choice(server) -> None:
    assert alive(server.core)
    # The front end never loads JAX (nor touches a device): only the core does.
    assert "jaxlib" not in Path(f"/proc/{server.proc.pid}/maps").read_text()
    assert "jaxlib" in Path(f"/proc/{server.core}/maps").read_text()
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
    assert gone(server.core, EXIT_WITHIN_S), "the engine core outlived its front end"


@pytest.mark.slow
def test_sigterm_stops_both_processes_with_status_zero(server) -> None:
    server.proc.send_signal(signal.SIGTERM)
    assert server.exit_code(30) == 0, server.log[-2000:]
    assert gone(server.core, EXIT_WITHIN_S)


# -- several front ends (--api-server-count) ---------------------------------------------------


@pytest.fixture
def two_fronts(tiny_checkpoints, tmp_path):
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    s = Server(tiny_checkpoints["llama3"], ("--api-server-count", "2"), {"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)})
    s.metrics_dir = metrics_dir
    yield s
    s.stop()


def _requests_by_process(metrics_dir: Path, tmp: Path) -> dict[int, float]:
    """Finished requests counted by each process (its own prometheus_client file, read alone)."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    counts = {}
    for path in metrics_dir.glob("counter_*.db"):
        alone = tmp / path.stem
        alone.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, alone / path.name)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, str(alone))
        counts[int(path.stem.split("_")[1])] = sum(
            s.value for m in registry.collect() for s in m.samples if s.name == "myserve_requests_total"
        )
    return counts


def _stream_texts(url: str, bodies: list[dict], started: threading.Event | None = None) -> list[list[dict]]:
    """Stream every body at once, each on a connection of its own; each stream's events.
    ``started`` is set once every stream has had its first event (each request is in the engine)."""
    first: list[int] = []

    async def one(body: dict) -> list[dict]:
        lines = []
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line and not lines:
                        first.append(1)
                        if started is not None and len(first) == len(bodies):
                            started.set()
                    if line:
                        lines.append(line)
        return [{"done": True} if line == "data: [DONE]" else json.loads(line[6:]) for line in lines]

    async def go() -> list[list[dict]]:
        return list(await asyncio.gather(*(one(b) for b in bodies)))

    return asyncio.run(go())


@pytest.mark.slow
def test_two_front_ends_share_the_port_and_the_core_and_merge_their_metrics(two_fronts, tmp_path) -> None:
    server = two_fronts
    assert len(server.fronts) == 1 and alive(server.core)
    expected = httpx.post(f"{server.url}/v1/completions", json=_body(), timeout=60).json()["choices"][0]["text"]
    sent = 1
    for _ in range(10):  # until both processes have served requests (the kernel picks who accepts)
        streams = _stream_texts(server.url, [_body() for _ in range(8)])
        sent += len(streams)
        for events in streams:  # the same greedy text, whichever front end served it
            assert events[-1] == {"done": True}, events[-3:]
            assert "".join(c["text"] for e in events[:-1] for c in e["choices"]) == expected
        by_process = _requests_by_process(server.metrics_dir, tmp_path / "alone")
        if len(by_process) == 2 and all(by_process.values()):
            break
    assert sorted(by_process) == sorted([server.proc.pid, *server.fronts]) and all(by_process.values()), by_process
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    total = sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("myserve_requests_total{"))
    assert total == sent == sum(by_process.values())
    steps = next(line for line in metrics.splitlines() if line.startswith("myserve_engine_steps{"))
    assert float(steps.split()[1]) > 0  # the core's counters, through the front ends
    queries = [line for line in metrics.splitlines() if line.startswith("vllm:prefix_cache_queries_total{")]
    assert len(queries) == 1 and float(queries[0].split()[-1]) > 0  # the core's count, once: not summed

    # SIGTERM: each front end finishes its streams (the core stays up until they are done), all exit 0.
    results: list[list[list[dict]]] = []
    long = _body(max_tokens=300, ignore_eos=True)
    started = threading.Event()
    streamer = threading.Thread(target=lambda: results.append(_stream_texts(server.url, [long] * 8, started)))
    streamer.start()
    # Every stream in (one arriving after the signal would get a 503): each has had a token. (The
    # engine's request count was polled before: 8 requests of 300 tokens at 8 a call could finish
    # between polls.)
    assert started.wait(60), "the 8 streams did not all start"
    server.proc.send_signal(signal.SIGTERM)
    streamer.join(timeout=60)
    assert server.exit_code(30) == 0, server.log[-3000:]
    assert "Traceback" not in server.log, server.log[-3000:]  # every process stopped cleanly
    for events in results[0]:
        assert events[-1] == {"done": True} and events[-2]["choices"][0]["finish_reason"] == "length", events[-2:]
    assert all(gone(pid, EXIT_WITHIN_S) for pid in (server.core, *server.fronts))


@pytest.mark.slow
def test_a_dead_core_ends_every_front_end(two_fronts) -> None:
    server = two_fronts
    results: list[list[list[dict]]] = []
    long = _body(max_tokens=480, ignore_eos=True, n=8)  # 8 sequences run at once: these queue
    streamer = threading.Thread(target=lambda: results.append(_stream_texts(server.url, [long] * 8)))
    streamer.start()
    # The core dies once the streams run (a fixed pause was too short on a loaded machine: the
    # streams had not connected, and met a closed port).
    _wait_requests(server.url, 1)
    os.kill(server.core, signal.SIGKILL)
    killed = time.monotonic()
    assert server.exit_code() == 1, server.log[-2000:]
    assert time.monotonic() - killed < EXIT_WITHIN_S
    assert all(gone(pid, EXIT_WITHIN_S) for pid in server.fronts)
    streamer.join(timeout=30)
    # Every stream ends with an event: an engine error, or [DONE] for one that finished before.
    ends = [events[-1].get("error", {}).get("code", "done") if events else "cut" for events in results[0]]
    assert set(ends) <= {"engine_error", "done"} and ends.count("engine_error") >= 4, ends


@pytest.mark.slow
def test_a_dead_front_end_ends_the_server(two_fronts) -> None:
    server = two_fronts
    os.kill(server.fronts[0], signal.SIGKILL)
    assert server.exit_code() == 1, server.log[-2000:]
    assert gone(server.core, EXIT_WITHIN_S)


@pytest.mark.slow
def test_a_request_the_front_end_admitted_is_never_refused_by_the_core(tiny_checkpoints) -> None:
    # The front end admits against the core's last report plus what it sent since; a report that
    # arrives while requests are still in transit does not count them. The core must not refuse
    # those (it used to, as a 500 engine_error): it serves every request the front end took.
    from myserve.testing import TINY_ENGINE, collect, start_client
    from myserve.wire.params import SamplingParams

    client = start_client(tiny_checkpoints["llama3"], *TINY_ENGINE, "engine.max_num_seqs=1", "engine.max_waiting=2")
    try:
        streams = []
        for i in range(8):
            client._added_since_stats = 0  # as if a report had just come that counts none of them
            streams.append(client.submit([40 + i, 41, 42], SamplingParams(max_tokens=4, temperature=0.0)))
        finishes = [collect(s)[2] for s in streams]
        assert finishes == ["length"] * 8
    finally:
        client.shutdown()


def _wait_requests(url: str, n: int) -> None:
    """Until the engine holds at least ``n`` requests (running or waiting, from its metrics): a
    fixed pause is too short on a loaded machine."""
    deadline = time.monotonic() + 60
    pattern = re.compile(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$", re.M)
    while sum(float(v) for v in pattern.findall(httpx.get(f"{url}/metrics").text)) < n:
        assert time.monotonic() < deadline, f"fewer than {n} requests ever reached the engine"
        time.sleep(0.1)
