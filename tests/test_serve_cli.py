"""``python -m myserve.serve`` as a real subprocess: models, a chat completion via curl, SIGTERM drain."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from test_server import free_port


@pytest.mark.slow
def test_serve_subprocess_curl_and_sigterm_drain() -> None:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "myserve.serve",
        "--port",
        str(port),
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "4",
        "--set",
        "engine.batch_buckets=[1,4]",
        "--set",
        "engine.prefill_row_tokens=32",
        "--set",
        "engine.page_buckets=[16]",
        "--set",
        "engine.max_num_batched_tokens=128",
        "--set",
        "engine.num_pages=128",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}
    )
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, "".join(log)
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server never became ready:\n" + "".join(log[-30:])
            time.sleep(0.5)
        assert any("ready on http://" in line for line in log)
        models = httpx.get(f"{url}/v1/models").json()
        assert models["data"][0]["id"] == "SmolLM2-135M-Instruct"
        curl = shutil.which("curl")
        body = json.dumps(
            {
                "model": "SmolLM2-135M-Instruct",
                "max_tokens": 8,
                "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
            }
        )
        if curl:
            out = subprocess.run(
                [curl, "-s", f"{url}/v1/chat/completions", "-H", "Content-Type: application/json", "-d", body],
                capture_output=True,
                text=True,
                timeout=60,
            ).stdout
        else:
            out = httpx.post(f"{url}/v1/chat/completions", content=body, timeout=60).text
        assert json.loads(out)["choices"][0]["message"]["content"]

        # A long request in flight, then SIGTERM: it must finish, new requests get 503, exit code 0.
        result: dict = {}

        def long_request() -> None:
            r = httpx.post(
                f"{url}/v1/completions",
                timeout=120,
                json={
                    "model": "SmolLM2-135M-Instruct",
                    "prompt": "Once upon a time",
                    "max_tokens": 100,
                    "ignore_eos": True,
                    "temperature": 0,
                },
            )
            result["status"], result["body"] = r.status_code, r.json()

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:
            refused = httpx.get(f"{url}/health", timeout=5).status_code
        except httpx.TransportError:
            refused = None
        t.join(timeout=120)
        assert proc.wait(timeout=60) == 0
        assert result["status"] == 200 and result["body"]["usage"]["completion_tokens"] == 100
        assert refused == 503  # admission stopped while the in-flight request drains
    finally:
        if proc.poll() is None:
            proc.kill()
