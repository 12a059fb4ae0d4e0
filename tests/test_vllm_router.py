"""vLLM's router (``vllm-router``, the PyPI binary) in front of two ``python -m myserve.serve``
processes on loopback: round robin and cache-aware routing both serve a 64-request burst with no
error, its power-of-two policy reads our ``/get_load``, its ``/flush_cache`` reaches both servers,
and on a workload of shared system prompts the servers' own prefix-cache metrics show cache-aware
routing hitting the cache more often than round robin (the router matches the token ids our
``/v1/chat/completions/render`` returns)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_process import ServeProcess
from test_server import free_port

from myserve.bundled import bundled_gguf_path
from myserve.testing import TINY_ENGINE, make_tiny_checkpoint

MODEL = "tiny"


def router_binary() -> str:
    found = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
    assert os.access(found, os.X_OK), "vllm-router is in the test extra"
    return found


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServeProcess]]:
    """Two myserve servers of a tiny Llama with SmolLM2's vocabulary and tokenizer, ready (the model
    and engine of other modules', test_structured's: their steps load from the step cache)."""
    checkpoint = make_tiny_checkpoint("llama3", tmp_path_factory.mktemp("vocab") / "llama", vocab_size=49152)
    sets = [f"--set={o}" for o in (*TINY_ENGINE, "engine.num_pages=256", f"model.tokenizer={bundled_gguf_path()}")]
    args = ["--hf-checkpoint", str(checkpoint), "--served-model-name", MODEL, "--disable-log-requests", *sets]
    started = [ServeProcess(["-m", "myserve.serve"], args) for _ in range(2)]
    try:
        for server in started:
            server.wait_ready()
        yield started
    finally:
        for server in started:
            server.proc.terminate()
        for server in started:
            server.proc.wait(timeout=60)


class Router:
    """``vllm-router --policy POLICY`` in front of ``servers`` on a free port."""

    def __init__(self, servers: list[ServeProcess], policy: str) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        cmd = [router_binary(), "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1], "--policy", policy]
        cmd += ["--worker-urls", *(s.url for s in servers), "--worker-startup-check-interval", "1"]
        cmd += ["--log-level", "warning", "--disable-retries", "--prometheus-port", str(free_port())]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"vllm-router exited: {self.proc.communicate()[0][-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "vllm-router never became ready"
            time.sleep(0.2)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.communicate(timeout=30)


def counter(server: ServeProcess, name: str) -> float:
    """A counter of ``server``'s /metrics, summed over its labels."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def burst(url: str, n: int = 64) -> list[str]:
    """``n`` concurrent chat requests through ``url``: their finish reasons."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)

    async def run() -> list[str]:
        calls = [
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"question {i}"}], max_tokens=6, temperature=0
            )
            for i in range(n)
        ]
        return [c.choices[0].finish_reason or "" for c in await asyncio.gather(*calls)]

    return asyncio.run(run())


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware", "power_of_two"])
def test_a_burst_of_64_through_the_router_is_served_without_error(servers: list[ServeProcess], policy: str) -> None:
    router = Router(servers, policy)
    try:
        before = [counter(s, "vllm:request_success_total") for s in servers]
        assert burst(router.url) == ["length"] * 64
        served = [counter(s, "vllm:request_success_total") - b for s, b in zip(servers, before, strict=True)]
        assert sum(served) == 64, served
        if policy == "round_robin":
            assert served == [32, 32]
        # (cache_aware may keep the whole burst on one server: its prompts share the chat template's
        # opening, and 64 requests stay under the router's imbalance threshold of 64)
        if policy == "power_of_two":  # it polls each server's /get_load
            loads = httpx.get(f"{router.url}/get_loads", timeout=10).json()["workers"]
            assert sorted(w["load"] for w in loads) == [0, 0], loads  # (-1 where a server did not answer)
    finally:
        router.close()


def shared_prefix_hit_rate(router: Router, servers: list[ServeProcess], tag: str) -> float:
    """Eight system prompts, four questions each, one request at a time: the servers' prefix-cache
    hit rate (hit tokens over looked-up tokens) over the workload, after a flush of both caches."""
    assert httpx.post(f"{router.url}/flush_cache", timeout=30).status_code == 200
    hits = [counter(s, "vllm:prefix_cache_hits_total") for s in servers]
    queries = [counter(s, "vllm:prefix_cache_queries_total") for s in servers]
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="none", max_retries=0, timeout=60)
    for p in range(8):
        system = f"[{tag} {p}] You are assistant number {p}; answer briefly and kindly. " * 10
        for q in range(4):
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "system", "content": system}, {"role": "user", "content": f"Question {q}?"}],
                max_tokens=2,
            )
    hit = sum(counter(s, "vllm:prefix_cache_hits_total") for s in servers) - sum(hits)
    looked_up = sum(counter(s, "vllm:prefix_cache_queries_total") for s in servers) - sum(queries)
    return hit / looked_up


def test_cache_aware_routing_hits_the_prefix_cache_more_than_round_robin(servers: list[ServeProcess]) -> None:
    rates = {}
    for policy in ("round_robin", "cache_aware"):
        router = Router(servers, policy)
        try:
            rates[policy] = shared_prefix_hit_rate(router, servers, policy)
        finally:
            router.close()
    print(f"prefix-cache hit rate: {rates}")
    # Round robin computes each system prompt on both servers (2 of 4 requests miss); cache-aware
    # routing keeps a prompt on one server (1 of 4 misses).
    assert rates["cache_aware"] > rates["round_robin"] + 0.1, rates
