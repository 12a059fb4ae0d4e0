"""``myserve serve`` as vLLM's quick start runs it: the console script, the model positional, a
vLLM-format ``--config`` YAML beside flags, and a model served with its own defaults: under the
path as given, with its own context length, a KV pool of the byte budget, and its generation
config as request defaults (seen through the OpenAI SDK). Plus ``--seed``: requests that send no
seed sample alike on two engines with the same seed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from serve_process import ServeProcess

from myserve.bundled import bundled_gguf_path
from myserve.testing import collect, make_tiny_checkpoint
from myserve.testing.stand_in_hub import StandInHub
from myserve.wire.params import SamplingParams

MYSERVE = Path(sys.executable).with_name("myserve")
PAGES = 300


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny Llama (SmolLM2's vocabulary, so chat prompts fit) with a generation config: greedy,
    at most 5 new tokens (top_k 50 is transformers' default: it says nothing)."""
    path = make_tiny_checkpoint("llama3", tmp_path_factory.mktemp("vllm") / "tiny-llama", vocab_size=49152)
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5, "top_k": 50}))
    return path


def page_bytes(checkpoint: Path) -> int:
    cfg = json.loads((checkpoint / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * 16 * head_dim * 4  # float32 on CPU


@pytest.mark.skipif(not MYSERVE.exists(), reason="the myserve console script is not installed (pip install -e .)")
def test_quick_start_with_a_vllm_yaml(checkpoint: Path, tmp_path: Path) -> None:
    yaml_file = tmp_path / "serve.yaml"
    yaml_file.write_text(
        f"tokenizer: {bundled_gguf_path()}\nmax-num-seqs: 4\nmax-num-batched-tokens: 16\n"
        f"kv-cache-memory-bytes: {PAGES * page_bytes(checkpoint)}\nenforce-eager: true\nseed: 0\n"
    )
    served = ServeProcess(
        [str(MYSERVE), "serve", str(checkpoint)],
        ["--config", str(yaml_file), "--dtype", "auto", "--api-key", "token-abc123", "--generation-config", "auto",
         "--gpu-memory-utilization", "0.8", "--max-logprobs", "2"],
    )  # fmt: skip
    try:
        served.wait_ready()
        headers = {"Authorization": "Bearer token-abc123"}
        assert httpx.get(f"{served.url}/v1/models").status_code == 401
        models = httpx.get(f"{served.url}/v1/models", headers=headers).json()["data"]
        assert [m["id"] for m in models] == [str(checkpoint)]  # the path as given, like vLLM
        assert models[0]["max_model_len"] == 512  # the checkpoint's max_position_embeddings
        assert f"KV cache: {PAGES} pages of 16 tokens" in served.log  # the byte budget's pages
        gauge = f'myserve_kv_pages_total{{model_name="{checkpoint}"}} {PAGES}.0'
        deadline = time.monotonic() + 10  # the gauge follows the core's counters (sent every second)
        while gauge not in httpx.get(f"{served.url}/metrics", headers=headers).text:
            assert time.monotonic() < deadline, served.log[-2000:]
            time.sleep(0.2)
        assert "--enforce-eager has no meaning here" in served.log

        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="token-abc123", max_retries=0)
        messages = [{"role": "user", "content": "Count to ten."}]
        # No temperature, no max_tokens: the generation config's greedy, 5 tokens.
        plain = client.chat.completions.create(model=str(checkpoint), messages=messages)
        assert plain.usage.completion_tokens == 5 and plain.choices[0].finish_reason == "length"
        greedy = client.chat.completions.create(model=str(checkpoint), messages=messages, temperature=0, max_tokens=5)
        assert plain.choices[0].message.content == greedy.choices[0].message.content
        # As vLLM: the smallest of the request's max_tokens, the generation config's max_new_tokens
        # and the context's room, on both endpoints (completions' default max_tokens is 16).
        shorter = client.chat.completions.create(
            model=str(checkpoint), messages=messages, max_tokens=3, extra_body={"ignore_eos": True}
        )
        longer = client.chat.completions.create(
            model=str(checkpoint), messages=messages, max_tokens=9, extra_body={"ignore_eos": True}
        )
        assert (shorter.usage.completion_tokens, longer.usage.completion_tokens) == (3, 5)
        for asked in ({}, {"max_tokens": 3}, {"max_tokens": 9}):
            done = client.completions.create(
                model=str(checkpoint), prompt="Count to ten.", extra_body={"ignore_eos": True}, **asked
            )
            assert done.usage.completion_tokens == min(asked.get("max_tokens", 16), 5), asked
            assert done.choices[0].finish_reason == "length"
        # --max-logprobs 2: more is a 400 naming the field.
        with pytest.raises(openai.BadRequestError, match=r"logprobs \(5\) exceeds the server's max_logprobs \(2\)"):
            client.completions.create(model=str(checkpoint), prompt=[5, 6], max_tokens=1, logprobs=5)
        assert client.completions.create(model=str(checkpoint), prompt=[5, 6], max_tokens=1, logprobs=2).choices
    finally:
        served.stop()


@pytest.mark.skipif(not MYSERVE.exists(), reason="the myserve console script is not installed (pip install -e .)")
def test_a_hub_id_is_downloaded_from_the_hub_and_served_under_it(checkpoint: Path, tmp_path: Path) -> None:
    """vLLM's quick start by hub id: downloaded (from a stand-in Hub at HF_ENDPOINT) into
    --download-dir, served as the id; a second start (over HTTPS: --ssl-keyfile, --ssl-certfile)
    finds it cached and asks the Hub for nothing."""
    env = {"HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "home")}
    args = ["--download-dir", str(tmp_path / "models"), "--tokenizer", str(bundled_gguf_path())]
    args += ["--max-num-seqs", "4", "--max-num-batched-tokens", "16", "--kv-cache-memory-bytes", "4M"]
    with StandInHub({"org/tiny-llama": checkpoint}) as hub:
        env["HF_ENDPOINT"] = hub.url
        served = ServeProcess([str(MYSERVE), "serve", "org/tiny-llama"], args, env)
        try:
            served.wait_ready()
            models = httpx.get(f"{served.url}/v1/models").json()["data"]
            assert [m["id"] for m in models] == ["org/tiny-llama"]
            body = {"model": "org/tiny-llama", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
            assert httpx.post(f"{served.url}/v1/completions", json=body).json()["usage"]["completion_tokens"] == 3
        finally:
            served.stop()
        fetched = {path for path in hub.requests if "/resolve/" in path}
        assert any(p.endswith("model.safetensors") for p in fetched), hub.requests
        assert list((tmp_path / "models").glob("models--org--tiny-llama/snapshots/*/model.safetensors"))
        before = len(hub.requests)
        # Started again (over HTTPS, vLLM's --ssl-* flags, when openssl can make a certificate).
        tls = self_signed(tmp_path) if shutil.which("openssl") else None
        ssl_args = ["--ssl-keyfile", tls[0], "--ssl-certfile", tls[1]] if tls else []
        again = ServeProcess([str(MYSERVE), "serve", "org/tiny-llama"], args + ssl_args, env, tls[1] if tls else None)
        try:
            again.wait_ready()
            if tls:
                assert again.url.startswith("https://")
                models = httpx.get(f"{again.url}/v1/models", verify=tls[1]).json()["data"]
                assert [m["id"] for m in models] == ["org/tiny-llama"]
                with pytest.raises(httpx.TransportError):  # plain HTTP is not served
                    httpx.get(again.url.replace("https://", "http://") + "/health")
        finally:
            again.stop()
        assert len(hub.requests) == before  # the cached snapshot, without asking the Hub
    missing = ServeProcess([str(MYSERVE), "serve", "org/none"], args, {**env, "HF_HUB_OFFLINE": "1"})
    assert missing.exit_code(within=60) == 2
    assert "org/none: not in the cache and cannot be downloaded" in missing.log


def test_the_engine_seed_seeds_requests_that_send_none(make_service) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    prompt = [5, 9, 33, 70]

    def samples(*overrides: str) -> list[list[int]]:
        service = make_service(*overrides)
        try:
            return [collect(service.submit(prompt, params))[0] for _ in range(3)]
        finally:
            service.shutdown()

    first, again = samples("engine.seed=1234"), samples("engine.seed=1234")
    assert first == again  # the same requests in the same order
    assert len({tuple(s) for s in first}) > 1  # and each request still its own seed
    assert samples("engine.seed=99") != first


def self_signed(directory: Path) -> tuple[str, str]:
    """A key and a self-signed certificate for 127.0.0.1 (PEM files, made by openssl)."""
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return str(key), str(cert)
