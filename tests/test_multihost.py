"""Multi-host serving with ``jax.distributed`` on localhost: two ``python -m myserve.serve`` processes
with 2 fake CPU devices each serve one model=4 mesh (tensor parallelism across the processes).
Process 0 answers chat requests over HTTP with the greedy tokens of a one-process engine; a signal to
the leader ends both processes, and so does killing it outright."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import zmq
from native_writers import write_orbax
from safetensors.numpy import load_file
from test_server import free_port

from myserve.bundled import bundled_gguf_path
from myserve.testing import TINY_ENGINE, make_tiny_checkpoint, start_service
from myserve.wire.params import SamplingParams

ENGINE = [*TINY_ENGINE, "engine.num_pages=64", "engine.compilation_cache_dir=null"]
QUESTIONS = ["What is the capital of France?", "Name three colors.", "Count to five.", "Say hi."]


class Cluster:
    """Two serve processes of one deployment; process 0 serves HTTP."""

    def __init__(self, checkpoint: Path, weights: Path | None = None):
        self.port, coordinator = free_port(), free_port()
        args = [f"model.checkpoint={checkpoint}", f"model.tokenizer={bundled_gguf_path()}", "model.dtype=float32"]
        args += [] if weights is None else [f"model.checkpoint_path={weights}"]
        args += [*ENGINE, "mesh.model=4", "mesh.num_processes=2", f"mesh.coordinator_address=127.0.0.1:{coordinator}"]
        args += ["mesh.heartbeat_timeout_s=5"]
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
        self.logs: list[list[str]] = [[], []]
        self.procs: list[subprocess.Popen] = []
        for pid in (0, 1):
            cmd = [sys.executable, "-m", "myserve.serve", "--port", str(self.port), "--served-model-name", "tiny"]
            cmd += [x for a in [*args, f"mesh.process_id={pid}"] for x in ("--set", a)]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            threading.Thread(target=self._read, args=(proc, self.logs[pid]), daemon=True).start()
            self.procs.append(proc)
        self.url = f"http://127.0.0.1:{self.port}"

    @staticmethod
    def _read(proc: subprocess.Popen, log: list[str]) -> None:
        log.extend(iter(proc.stdout.readline, ""))

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in self.procs:
                assert proc.poll() is None, self.output()
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"not ready in {timeout}s\n{self.output()}")

    def wait_exit(self, timeout: float = 60) -> list[int | None]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.2)
        return [p.poll() for p in self.procs]

    def elements_read(self) -> list[int]:
        """How many parameter elements each process read from the checkpoint (its log says)."""
        found = [re.search(r"read (\d+) parameter elements", "".join(log)) for log in self.logs]
        assert all(found), self.output()
        return [int(f[1]) for f in found]  # type: ignore[index]

    def output(self) -> str:
        return "\n".join(f"--- process {i} ---\n" + "".join(log)[-3000:] for i, log in enumerate(self.logs))

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()


def one_process_texts(checkpoint: Path) -> list[tuple[str, int]]:
    """The greedy answers (text, completion tokens) of a one-device engine, one decode step per
    dispatch: the reference."""
    svc = start_service(checkpoint, *ENGINE)
    try:
        out = []
        for q in QUESTIONS:
            ids = svc.tokenizer.apply_chat_template([{"role": "user", "content": q}])
            tokens = [t for o in svc.submit(ids, SamplingParams(max_tokens=12, temperature=0.0)) for t in o.token_ids]
            out.append((svc.tokenizer.decode(tokens), len(tokens)))
        return out
    finally:
        svc.shutdown()


def chat(url: str, question: str) -> tuple[str, int]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": question}], "max_tokens": 12, "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    reply = r.json()
    return reply["choices"][0]["message"]["content"], reply["usage"]["completion_tokens"]


class Intruders:
    """Two SUB sockets of a process outside the deployment on the leader's step channel: one with
    no security, one with a CURVE key pair of its own (and the leader's public key, which is no
    secret)."""

    def __init__(self, leader_log: list[str]):
        found = re.search(r"step channel: publishing on (\S+) \(CURVE server key (\S+),", "".join(leader_log))
        assert found, "".join(leader_log)[-3000:]
        self.context = zmq.Context()
        plain = self.context.socket(zmq.SUB)
        keyed = self.context.socket(zmq.SUB)
        public, secret = zmq.curve_keypair()
        keyed.curve_serverkey, keyed.curve_publickey, keyed.curve_secretkey = found[2].encode(), public, secret
        self.sockets = [plain, keyed]
        for s in self.sockets:
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.connect(found[1])

    def received(self) -> list[int]:
        """Messages each socket got so far (then closes them)."""
        counts = []
        for s in self.sockets:
            n = 0
            while s.poll(200):
                s.recv()
                n += 1
            counts.append(n)
            s.close(linger=0)
        self.context.term()
        return counts


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with SmolLM2's vocabulary size, so chat-templated prompts fit."""
    return make_tiny_checkpoint("llama3", tmp_path_factory.mktemp("chat") / "llama", vocab_size=49152)


def assert_each_read_its_part(cluster: Cluster, checkpoint: Path) -> None:
    """Each process read its own part of the sharded weights (the vocabulary and MLP over model=4,
    two devices each: about half), not the whole checkpoint."""
    total = sum(t.size for t in load_file(str(checkpoint / "model.safetensors")).values())
    read = cluster.elements_read()
    assert all(0.4 * total < n < 0.7 * total for n in read), (read, total)


@pytest.mark.slow
def test_two_processes_serve_chat_like_one_and_stop_together(chat_checkpoint: Path, tmp_path: Path) -> None:
    checkpoint = chat_checkpoint
    expected = one_process_texts(checkpoint)
    # The weights from an Orbax checkpoint (as a JAX trainer saves them); the reference's from safetensors.
    cluster = Cluster(checkpoint, weights=write_orbax(checkpoint, tmp_path / "orbax", config=False))
    try:
        cluster.wait_ready()
        assert_each_read_its_part(cluster, checkpoint)
        intruders = Intruders(cluster.logs[0])
        with concurrent.futures.ThreadPoolExecutor(len(QUESTIONS)) as pool:  # concurrent: batched steps
            got = list(pool.map(lambda q: chat(cluster.url, q), QUESTIONS))
        assert got == expected
        # A process outside the deployment (this one) subscribed to the step channel, with no key and
        # with a key of its own and the leader's public key: it received no step, and was refused.
        assert intruders.received() == [0, 0]
        assert "step channel: refused a subscriber" in "".join(cluster.logs[0]), cluster.output()
        # Grammar masks travel with the steps to the follower (only the constrained rows' masks).
        constrained = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "A code?"}],
            "max_tokens": 20,
            "temperature": 1.0,
            "seed": 7,
            "structured_outputs": {"regex": "[A-Z]{3}-[0-9]{4}"},
        }
        with concurrent.futures.ThreadPoolExecutor(3) as pool:  # with free requests in the same steps
            replies = list(
                pool.map(
                    lambda body: httpx.post(f"{cluster.url}/v1/chat/completions", json=body, timeout=120).json(),
                    [constrained, {**constrained, "seed": 8}, {**constrained, "structured_outputs": None}],
                )
            )
        for reply in replies[:2]:
            text = reply["choices"][0]["message"]["content"]
            assert re.fullmatch("[A-Z]{3}-[0-9]{4}", text) and reply["choices"][0]["finish_reason"] == "stop", reply
        assert "following process 0's steps" in "".join(cluster.logs[1])
        assert "engine core ready" in "".join(cluster.logs[0])  # the leader's core runs in its own process
        metrics = httpx.get(f"{cluster.url}/metrics", timeout=10).text
        steps = next(line for line in metrics.splitlines() if line.startswith("myserve_engine_steps{"))
        assert float(steps.split()[1]) > 0  # the leader's steps, replayed by the follower
        # The steps overlapped on two processes too: each was dispatched and sent to the follower
        # before the previous one was read (a negative host-measured gap).
        gap = next(line for line in metrics.splitlines() if line.startswith("myserve_engine_step_gap_seconds{"))
        assert float(gap.split()[1]) < 0, gap
        # A signal to the leader: it drains, tells the follower to stop, and both exit cleanly.
        cluster.procs[0].send_signal(signal.SIGTERM)
        assert cluster.wait_exit() == [0, 0], cluster.output()
        assert "the leader stopped" in "".join(cluster.logs[1])
    finally:
        cluster.kill()


@pytest.mark.slow
def test_killing_the_leader_ends_the_follower(chat_checkpoint: Path) -> None:
    cluster = Cluster(chat_checkpoint)
    try:
        cluster.wait_ready()
        assert_each_read_its_part(cluster, chat_checkpoint)  # from safetensors
        cluster.procs[0].kill()
        codes = cluster.wait_exit(timeout=30)
        assert codes[1] is not None, "the follower outlived its leader\n" + cluster.output()
    finally:
        cluster.kill()
