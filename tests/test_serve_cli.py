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
from conftest import SMOL_TEST_ENGINE
from test_server import free_port

from myserve.config import load_config
from myserve.entrypoints import serve


@pytest.mark.slow
def test_serve_subprocess_curl_and_sigterm_drain() -> None:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "myserve.serve",
        "--port",
        str(port),
        # the in-process SmolLM2 fixtures' engine: its steps load from the step cache they filled
        *(arg for s in SMOL_TEST_ENGINE for arg in ("--set", s)),
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
        # The line may reach the reader thread a moment after /health first answers.
        while not any("ready on http://" in line for line in log) and time.monotonic() < deadline:
            time.sleep(0.1)
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


def test_flags_map_to_config_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MYSERVE_API_KEY", "sk-env")
    args = serve.parse_args(
        [
            "--hf-checkpoint", "some/model", "--host", "0.0.0.0", "--port", "9001",
            "--served-model-name", "m", "--chat-template", "{{ x }}", "--max-model-len", "1024",
            "--max-num-seqs", "8", "--dtype", "bfloat16", "--tensor-parallel-size", "2",
            "--log-level", "debug", "--set", "engine.page_size=32", "--set", "server.drain_timeout_s=5",
            "--api-server-count", "3", "--expert-parallel-size", "4",
            "--otlp-traces-endpoint", "http://collector:4317",
        ]
    )  # fmt: skip
    c = serve.config_from_args(args)
    assert (c.model.checkpoint, c.model.chat_template, c.model.max_model_len, c.model.dtype) == (
        "some/model", "{{ x }}", 1024, "bfloat16"
    )  # fmt: skip
    assert (c.engine.max_num_seqs, c.engine.page_size, c.mesh.model, c.mesh.expert) == (8, 32, 2, 4)
    assert (c.server.host, c.server.port, c.server.served_model_name) == ("0.0.0.0", 9001, "m")
    assert (c.server.api_key, c.server.log_level, c.server.drain_timeout_s) == ("sk-env", "debug", 5.0)
    assert (c.server.api_server_count, c.server.otlp_traces_endpoint) == (3, "http://collector:4317")
    # An explicit flag wins over the environment; no flags at all is the default deployment.
    assert serve.config_from_args(serve.parse_args(["--api-key", "sk-flag"])).server.api_key == "sk-flag"
    monkeypatch.delenv("MYSERVE_API_KEY")
    assert serve.config_from_args(serve.parse_args([])) == load_config(None)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-num-seqs", "0"], "engine.max_num_seqs"),
        (["--set", "engine.no_such_key=1"], "no_such_key"),
        (["--port", "70000"], "server.port"),
        (["--api-server-count", "2", "--set", "server.engine_process=false"], "server.engine_process"),
    ],
)
def test_bad_flags_exit_2_with_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert serve.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and "\n" not in err
