"""``myserve.client`` against the real app over real HTTP (a tiny random Llama with SmolLM2's
vocabulary, serving chat, completions and embeddings), and against small stub servers for what the
real one does not do on demand: a 429 with ``Retry-After``, a slow answer, a paced stream."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from test_server import LiveServer, free_port

import myserve
from myserve.client import APIError, AsyncClient, Client, RetryPolicy, TransportError
from myserve.frontend.app import create_app

MODEL = "tiny"
KEY = "sk-client-test"
SRC = Path(myserve.__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cold(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, object, int]]:
    """The real app over an engine that is still compiling when the server opens: (server, service,
    the status ``/health`` gave before warmup began). The engine warms up in a thread."""
    from myserve.bundled import bundled_gguf_path
    from myserve.config import load_config
    from myserve.entrypoints.service import GenerationService
    from myserve.runtime.deployment import Deployment
    from myserve.testing import TINY_ENGINE, make_tiny_checkpoint

    checkpoint = make_tiny_checkpoint("llama3", tmp_path_factory.mktemp("client"), vocab_size=49152)
    overrides = [f"model.checkpoint={checkpoint}", f"model.tokenizer={bundled_gguf_path()}", "model.dtype=float32"]
    config = load_config(None, [*overrides, *TINY_ENGINE, "engine.num_pages=256", "model.task=generate+embed"])
    service = GenerationService.from_deployment(Deployment.load(config))
    server = LiveServer(create_app(service, served_model_name=MODEL, api_key=KEY))
    before = httpx.get(f"{server.url}/health").status_code
    warmup = threading.Thread(target=service.start, daemon=True)
    warmup.start()
    yield server, service, before
    server.stop()
    warmup.join(timeout=300)
    service.shutdown()


@pytest.fixture(scope="module")
def live(cold) -> str:
    """The URL of the real server, warm."""
    server, _, _ = cold
    with Client(server.url) as client:
        client.wait_ready(300)
    return server.url


def test_wait_ready_returns_once_warm(cold) -> None:
    server, service, before = cold
    assert before == 503  # the server was up before the engine was ready
    with Client(server.url) as client:
        client.wait_ready(300, interval=0.05)
        # It returned because the engine is warm, not early: the engine says so and so does /health.
        assert service.ready.is_set()  # type: ignore[attr-defined]
        assert httpx.get(f"{server.url}/health").status_code == 200


def test_wait_ready_gives_up_when_nothing_listens() -> None:
    with Client(f"http://127.0.0.1:{free_port()}") as client:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            client.wait_ready(0.5, interval=0.1)
        assert 0.4 < time.monotonic() - start < 3


def test_sync_chat_and_completions_streamed_and_not(live: str) -> None:
    with Client(f"{live}/v1", api_key=KEY) as client:  # an OpenAI-style base URL works too
        assert client.models() == [MODEL]
        kw = dict(max_tokens=12, temperature=0, ignore_eos=True)
        full = client.chat("Name three colors.", **kw)  # the model: the server's first
        assert full.model == MODEL and full.id.startswith("chatcmpl-") and full.text
        assert full.choices[0].finish_reason == "length"
        assert full.usage is not None and full.usage.completion_tokens == 12 and full.usage.prompt_tokens > 5
        chunks = list(client.chat_stream("Name three colors.", **kw))
        # (A reader that falls behind gets deltas coalesced: fewer chunks, the same text.)
        assert len(chunks) >= 2 and "".join(c.text for c in chunks) == full.text
        assert [c.finish_reason for c in chunks if c.finish_reason] == ["length"]
        assert chunks[-1].choices == () and chunks[-1].usage == full.usage

        done = client.complete("Once upon a time", **kw)
        assert done.raw["object"] == "text_completion" and done.usage and done.usage.completion_tokens == 12
        streamed = list(client.complete_stream("Once upon a time", **kw))
        assert "".join(c.text for c in streamed) == done.text and streamed[-1].usage == done.usage


def test_async_client_chat_complete_and_embed(live: str) -> None:
    async def go() -> None:
        async with AsyncClient(live, api_key=KEY, model=MODEL) as client:
            kw = dict(max_tokens=10, temperature=0, ignore_eos=True)
            full, done = await asyncio.gather(
                client.chat("Hello!", system="Be brief.", **kw), client.complete([5, 6, 7], **kw)
            )
            chunks = [c async for c in client.chat_stream("Hello!", system="Be brief.", **kw)]
            assert full.text and "".join(c.text for c in chunks) == full.text and chunks[-1].usage == full.usage
            pieces = [c async for c in client.complete_stream([5, 6, 7], **kw)]
            assert "".join(c.text for c in pieces) == done.text and done.usage and done.usage.prompt_tokens == 3

            vectors = await client.embed(["first text", "second, longer text"])
            assert len(vectors.vectors) == 2 and vectors.vectors[0] != vectors.vectors[1]
            assert all(math.isclose(math.hypot(*v), 1.0, abs_tol=1e-4) for v in vectors.vectors)
            assert vectors.usage and vectors.usage.prompt_tokens > 4

    asyncio.run(go())


def test_errors_carry_the_openai_envelope(live: str) -> None:
    with Client(live, api_key=KEY, model=MODEL) as client:
        with pytest.raises(APIError) as missing:
            client.chat("hi", model="no-such-model")
        assert (missing.value.status, missing.value.code) == (404, "model_not_found")
        with pytest.raises(APIError) as bad:
            client.chat("hi", max_tokens=-1)
        assert (bad.value.status, bad.value.param) == (400, "max_tokens")
    with Client(live, api_key="wrong", model=MODEL) as client, pytest.raises(APIError) as denied:
        client.chat("hi")
    assert denied.value.status == 401 and denied.value.type == "authentication_error"


def test_the_cli_streams_the_answer(live: str) -> None:
    with Client(live, api_key=KEY, model=MODEL) as client:
        want = client.chat("What is the capital of France?", max_tokens=24, temperature=0).text
    assert want.strip()
    done = run_cli(live, "chat", "What is the capital of France?", "--max-tokens", "24", "--temperature", "0")
    assert done.returncode == 0, done.stderr
    assert done.stdout == want + "\n"


# -- stub servers: what the real one does not do on demand ------------------------------------------

CHAT_BODY = {
    "id": "chatcmpl-stub",
    "object": "chat.completion",
    "model": "stub",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}


def _event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def stub_app(calls: list[float], *, refuse: int = 0, delay_s: float = 0.0, pace_s: float = 0.0) -> FastAPI:
    """A chat endpoint that answers 429 (``Retry-After: 1``) to its first ``refuse`` requests, waits
    ``delay_s`` before answering, and streams three pieces ``pace_s`` apart; ``calls`` gets each
    request's arrival time."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        calls.append(time.monotonic())
        body = await request.json()
        if len(calls) <= refuse:
            error = {"error": {"message": "busy", "type": "rate_limit_error", "param": None, "code": "overloaded"}}
            return JSONResponse(error, status_code=429, headers={"Retry-After": "1"})
        await asyncio.sleep(delay_s)
        if not body.get("stream"):
            return JSONResponse(CHAT_BODY)

        async def events():
            for piece in ("one ", "two ", "three"):
                yield _event({"id": "s", "model": "stub", "choices": [{"index": 0, "delta": {"content": piece}}]})
                await asyncio.sleep(pace_s)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture
def stub() -> Iterator[tuple[list[float], dict[str, LiveServer]]]:
    calls: list[float] = []
    servers: dict[str, LiveServer] = {}
    yield calls, servers
    for server in servers.values():
        server.stop()


def serve(stub, **options) -> str:
    calls, servers = stub
    servers[str(len(servers))] = server = LiveServer(stub_app(calls, **options))
    return server.url


def test_429_with_retry_after_is_retried_after_the_wait(stub) -> None:
    calls, _ = stub
    url = serve(stub, refuse=1)
    with Client(url, model="stub") as client:
        start = time.monotonic()
        answer = client.chat("hi")
    assert answer.text == "ok" and len(calls) == 2
    assert 1.0 <= calls[1] - calls[0] < 2.0 and time.monotonic() - start >= 1.0


def test_429_is_retried_for_streams_too_and_bounded(stub) -> None:
    calls, _ = stub
    url = serve(stub, refuse=1)
    with Client(url, model="stub") as client:
        assert "".join(c.text for c in client.chat_stream("hi")) == "one two three"
    assert len(calls) == 2 and calls[1] - calls[0] >= 1.0
    calls.clear()
    with Client(url, model="stub", retry=RetryPolicy(max_retries=0)) as client, pytest.raises(APIError) as refused:
        client.chat("hi")
    assert (refused.value.status, refused.value.code, refused.value.retry_after) == (429, "overloaded", 1.0)
    assert len(calls) == 1


def test_a_request_that_may_have_reached_the_engine_is_not_retried_unless_asked(stub) -> None:
    calls, _ = stub
    url = serve(stub, delay_s=1.0)
    with Client(url, model="stub", retry=RetryPolicy(max_retries=2, backoff_s=0.05)) as client:
        start = time.monotonic()
        with pytest.raises(TransportError) as timed_out:
            client.chat("hi", timeout=0.3)  # a per-call timeout, shorter than the answer takes
        assert timed_out.value.sent and len(calls) == 1 and time.monotonic() - start < 0.9
        with pytest.raises(TransportError):
            client.chat("hi", timeout=0.3, retry_unsafe=True)
        assert len(calls) == 1 + 3


def test_connection_refused_is_retried_with_backoff() -> None:
    with Client(
        f"http://127.0.0.1:{free_port()}", model="m", retry=RetryPolicy(max_retries=2, backoff_s=0.2)
    ) as client:
        start = time.monotonic()
        with pytest.raises(TransportError) as refused:
            client.chat("hi")
    assert not refused.value.sent and time.monotonic() - start >= 0.2 + 0.4


def test_the_cli_writes_each_piece_as_it_arrives(stub) -> None:
    url = serve(stub, pace_s=0.5)
    cli = subprocess.Popen(
        [sys.executable, "-m", "myserve.client", "--base-url", url, "--model", "stub", "chat", "hi"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_cli_env(),
    )
    assert cli.stdout is not None
    reads: list[tuple[float, bytes]] = []
    while piece := os.read(cli.stdout.fileno(), 1024):
        reads.append((time.monotonic(), piece))
    assert cli.wait(timeout=30) == 0
    assert b"".join(p for _, p in reads) == b"one two three\n"
    # The first piece was on the terminal a second before the last one was sent.
    assert reads[0][1].startswith(b"one") and reads[-1][0] - reads[0][0] >= 0.9


def test_importing_the_client_loads_nothing_of_the_server() -> None:
    server = ("jax", "jaxlib", "fastapi", "numpy")
    code = (
        "import sys, myserve.client; "
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {server} or m.startswith('myserve.frontend')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=_cli_env())
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def _cli_env() -> dict[str, str]:
    # The child imports this checkout's myserve, whichever way it is installed.
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}


def run_cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m myserve.client`` against ``url`` with the test key and model."""
    command = [sys.executable, "-m", "myserve.client", "--base-url", url, "--api-key", KEY, "--model", MODEL, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=_cli_env())
