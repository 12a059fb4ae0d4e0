"""Several models in one server: ``python -m myserve.serve`` with the bundled SmolLM2 and a tiny
random Llama (``--add-model``), each in an engine core process of its own. Both answer by name (and
alias) through the OpenAI SDK, ``/v1/models`` lists them, another name is 404 ``model_not_found``,
every ``/metrics`` series carries its model's name, SIGTERM drains a request in flight on each and
exits 0, and killing either core ends the server non-zero. Plus the config (``models:`` in YAML, the
repeatable ``--add-model``) and the memory check, without a server."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import httpx
import openai
import pytest
from conftest import SMOL_TEST_ENGINE
from serve_process import ServeProcess, gone

from myserve.bundled import BUNDLED_MODEL_NAME
from myserve.config import load_config
from myserve.entrypoints import serve
from myserve.entrypoints.memory_check import check_memory, footprint
from myserve.errors import ConfigError
from myserve.runtime.cpu_dtype import native_bf16

EXIT_WITHIN_S = 5.0
SMOL = BUNDLED_MODEL_NAME
TINY_LEN = 1024
"""The tiny model's max_model_len (SmolLM2's is 512 here): /tokenize and the model cards tell them apart."""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the bundled tokenizer (numpy; no torch)."""
    from myserve.bench.random_checkpoint import make_random_llama

    return make_random_llama("tiny-llama", tmp_path_factory.mktemp("tiny") / "tiny-llama")


class Server(ServeProcess):
    """``python -m myserve.serve`` with ``args`` as a subprocess, ready, with each model's core pid."""

    def __init__(self, args: list[str]):
        super().__init__(["-m", "myserve.serve"], args)
        self.wait_ready(600)
        self.cores = {m[1]: int(m[2]) for m in re.finditer(r"model (\S+): engine core process (\d+)", self.log)}

    def stop(self, children: Iterable[int] = ()) -> None:
        super().stop((*self.cores.values(), *children))


@pytest.fixture(scope="module")
def server(tiny_dir: Path):
    """SmolLM2 (the flags' model) and the tiny Llama (``--add-model``), both with SmolLM2's small
    test engine (inherited), the tiny one with its own context length, an alias, and embeddings."""
    sets = [arg for s in SMOL_TEST_ENGINE for arg in ("--set", s)]
    spec = f"checkpoint={tiny_dir},served_model_name=[tiny,tiny-alias],max_model_len={TINY_LEN},task=generate+embed"
    s = Server([*sets, "--add-model", spec])
    yield s
    s.stop()


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.mark.slow
def test_both_models_answer_by_name_and_alias(server: Server) -> None:
    assert set(server.cores) == {SMOL, "tiny"} and len(set(server.cores.values())) == 2, server.log[-3000:]
    # The front end holds neither model: no JAX in its process (each core has its own).
    assert "jaxlib" not in Path(f"/proc/{server.proc.pid}/maps").read_text()
    client = _client(server)
    chat = client.chat.completions.create(
        model=SMOL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8,
        temperature=0,
    )
    assert chat.model == SMOL and chat.choices[0].message.content
    texts = {}
    for name in ("tiny", "tiny-alias", SMOL):
        reply = client.completions.create(model=name, prompt="Once upon a time", max_tokens=12, temperature=0)
        assert reply.model == name and reply.usage.completion_tokens == 12
        texts[name] = reply.choices[0].text
    assert texts["tiny"] == texts["tiny-alias"] != texts[SMOL]  # the alias is the tiny model; SmolLM2 is another
    answer = client.responses.create(model="tiny", input="Hello", max_output_tokens=4, temperature=0)
    assert answer.model == "tiny" and answer.usage.output_tokens == 4
    # The tiny model is also an embedding model (model.task generate+embed); SmolLM2 is not.
    vectors = client.embeddings.create(model="tiny-alias", input=["Hello world", "Bonjour"])
    assert vectors.model == "tiny-alias" and [len(d.embedding) for d in vectors.data] == [64, 64]
    assert vectors.data[0].embedding != vectors.data[1].embedding
    with pytest.raises(openai.BadRequestError, match="does not serve embeddings"):
        client.embeddings.create(model=SMOL, input="Hello world")
    # /tokenize routes by model too: each reports its own context length.
    for name, length in ((SMOL, 512), ("tiny", TINY_LEN), (None, 512)):  # no model: the first
        body = {"prompt": "Hello world"} | ({"model": name} if name else {})
        assert httpx.post(f"{server.url}/tokenize", json=body).json()["max_model_len"] == length


@pytest.mark.slow
def test_models_lists_both_and_other_names_are_404(server: Server) -> None:
    client = _client(server)
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == [SMOL, "tiny", "tiny-alias"]
    assert cards["tiny-alias"].root == "tiny" and cards["tiny"].max_model_len == TINY_LEN  # type: ignore[attr-defined]
    assert client.models.retrieve("tiny-alias").id == "tiny-alias"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert info.value.code == "model_not_found" and info.value.body["param"] == "model"  # type: ignore[index]
    for method, path, body in [
        ("GET", "/v1/models/gpt-9", None),
        ("POST", "/v1/completions", {"model": "gpt-9", "prompt": "hi", "max_tokens": 2}),
        ("POST", "/v1/responses", {"model": "gpt-9", "input": "hi"}),
        ("POST", "/tokenize", {"model": "gpt-9", "prompt": "hi"}),
        ("POST", "/detokenize", {"model": "gpt-9", "tokens": [1]}),
    ]:
        r = httpx.request(method, f"{server.url}{path}", json=body)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", (path, r.text)


@pytest.mark.slow
def test_every_metrics_series_carries_its_model(server: Server) -> None:
    client = _client(server)
    for name in (SMOL, "tiny-alias"):
        client.completions.create(model=name, prompt="Hi", max_tokens=3, temperature=0)
    text = httpx.get(f"{server.url}/metrics").text
    samples = [line for line in text.splitlines() if line.startswith(("myserve_", "vllm:"))]
    assert samples and all(re.match(r'(myserve_|vllm:)\w+\{(.*,)?model_name="', line) for line in samples), samples
    for name in (SMOL, "tiny"):  # an alias counts under its model's name
        ok = re.search(rf'myserve_requests_total{{endpoint="completion",model_name="{name}",status="ok"}} (\S+)', text)
        assert ok and float(ok[1]) >= 1, name
        assert f'myserve_kv_pages_total{{model_name="{name}"}} 256.0' in text
        generated = re.search(rf'vllm:generation_tokens_total{{model_name="{name}"}} (\S+)', text)
        assert generated and float(generated[1]) >= 3
    assert 'model_name="tiny-alias"' not in text


@pytest.mark.slow
def test_sigterm_drains_a_request_on_each_model_then_exits_0(server: Server) -> None:
    """Last of the shared server's tests: it stops it."""
    results: dict[str, httpx.Response] = {}
    lengths = {SMOL: 64, "tiny": TINY_LEN - 8}

    def long_request(name: str) -> None:
        body = {"model": name, "prompt": [40, 41, 42], "max_tokens": lengths[name], "ignore_eos": True}
        results[name] = httpx.post(f"{server.url}/v1/completions", json={**body, "temperature": 0}, timeout=300)

    threads = [threading.Thread(target=long_request, args=(name,)) for name in lengths]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while True:  # both running in their engines
        text = httpx.get(f"{server.url}/metrics").text
        if all(f'vllm:num_requests_running{{model_name="{n}"}} 1.0' in text for n in lengths):
            break
        assert time.monotonic() < deadline and not results, (results, text[-2000:])
        time.sleep(0.02)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    refused = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_draining"
    for t in threads:
        t.join(timeout=300)
    assert server.exit_code(120) == 0, server.log[-3000:]
    for name, r in results.items():
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == lengths[name], (name, r.text)
    assert all(gone(pid, 10) for pid in server.cores.values())


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["a", "b"])
def test_killing_either_core_exits_the_server_non_zero(tiny_dir: Path, victim: str) -> None:
    sets = [arg for s in (*SMOL_TEST_ENGINE, "model.max_model_len=4096") for arg in ("--set", s)]
    s = Server(
        ["--hf-checkpoint", str(tiny_dir), "--served-model-name", "a", *sets, "--add-model", "served_model_name=b"]
    )
    try:
        assert set(s.cores) == {"a", "b"}
        result: dict[str, httpx.Response] = {}
        body = {"model": victim, "prompt": [40, 41], "max_tokens": 4000, "ignore_eos": True, "temperature": 0}
        thread = threading.Thread(
            target=lambda: result.update(r=httpx.post(f"{s.url}/v1/completions", json=body, timeout=120))
        )
        thread.start()
        time.sleep(0.5)
        os.kill(s.cores[victim], signal.SIGKILL)
        killed = time.monotonic()
        code = s.exit_code(within=30)
        assert code not in (None, 0), s.log[-3000:]
        assert time.monotonic() - killed < EXIT_WITHIN_S
        thread.join(timeout=30)
        r = result["r"]  # the request in flight on the dead core got the engine's error
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error", r.text
        assert f"the engine of {victim} stopped" in s.log
        other = "b" if victim == "a" else "a"
        assert gone(s.cores[other], 10), "the other model's core outlived the server"
    finally:
        s.stop()


# --- config and memory check, no server -------------------------------------------------------------


def test_models_entries_inherit_the_top_level_keys(tmp_path: Path) -> None:
    path = tmp_path / "two.yaml"
    path.write_text(
        "model: {dtype: float32, max_model_len: 1024}\n"
        "engine: {num_pages: 512, token_buckets: [1, 16]}\n"
        "models:\n"
        "  - served_model_name: [first, one]\n"
        "  - model: {checkpoint: /models/x, max_model_len: 256}\n"
        "    engine: {num_pages: 64}\n"
        "    reasoning_parser: qwen3\n"
    )
    first, second = load_config(path, ["engine.page_size=32"]).per_model()  # --set reaches every model
    assert first.server.served_model_name == ("first", "one") and second.server.served_model_name is None
    assert (first.model.checkpoint, first.model.max_model_len, first.engine.num_pages) == (None, 1024, 512)
    assert (second.model.checkpoint, second.model.max_model_len, second.engine.num_pages) == ("/models/x", 256, 64)
    assert first.model.dtype == second.model.dtype == "float32"
    assert first.engine.page_size == second.engine.page_size == 32
    assert first.engine.token_buckets == second.engine.token_buckets == (1, 16)
    assert (first.server.reasoning_parser, second.server.reasoning_parser) == (None, "qwen3")
    assert serve.served_model_names(second) == ("x",)  # derived from the checkpoint, as for one model
    assert load_config(None).per_model() == (load_config(None),)  # no models: the one model, as it was


def test_add_model_flags(tmp_path: Path) -> None:
    entry = tmp_path / "entry.yaml"
    entry.write_text("served_model_name: third\nmodel: {checkpoint: /models/z}\nengine: {num_pages: 32}\n")
    args = serve.parse_args(
        [
            "--hf-checkpoint", "/models/x", "--served-model-name", "x", "x-alias", "--max-model-len", "1024",
            "--set", "engine.token_buckets=[1,16]",
            "--add-model", "hf_checkpoint=/models/y,served_model_name=y,engine.token_buckets=[1,4,8],dtype=bfloat16",
            "--add-model", str(entry),
        ]
    )  # fmt: skip
    config = serve.config_from_args(args)
    assert config.server.served_model_name is None and len(config.models) == 3
    x, y, z = config.per_model()
    assert [serve.served_model_names(c) for c in (x, y, z)] == [("x", "x-alias"), ("y",), ("third",)]
    assert [c.model.checkpoint for c in (x, y, z)] == ["/models/x", "/models/y", "/models/z"]
    assert [c.model.max_model_len for c in (x, y, z)] == [1024] * 3  # inherited from the flags
    assert [c.engine.token_buckets for c in (x, y, z)] == [(1, 16), (1, 4, 8), (1, 16)]
    assert (y.model.dtype, z.engine.num_pages) == ("bfloat16", 32)
    one = serve.config_from_args(serve.parse_args(["--served-model-name", "m"]))
    assert one.server.served_model_name == "m" and not one.models


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--add-model", "checkpoint=/m,bogus=1"], "unknown key 'bogus'"),
        (["--add-model", "engine.page_size=3,served_model_name=b"], "engine.page_size must be a power of two"),
        (["--add-model", "served_model_name=SmolLM2-135M-Instruct"], "both served as 'SmolLM2-135M-Instruct'"),
        (["--add-model", "served_model_name=b", "--api-server-count", "2"], "server.api_server_count: 1"),
        (["--add-model", "served_model_name=b", "--set", "server.engine_process=false"], "server.engine_process"),
        (["--add-model", "/no/such/entry.yaml"], "nor a readable YAML file"),
        (["--add-model", "served_model_name=b,tool_call_parser=nope"], "tool_call_parser must be one of"),
    ],
)
def test_bad_model_lists_exit_2_with_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    assert serve.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and "\n" not in err, err


def test_models_need_their_own_names_and_one_host(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("server: {served_model_name: x}\nmodels: [{}, {model: {checkpoint: /y}}]\n")
    with pytest.raises(ConfigError, match="set each entry's served_model_name"):
        load_config(path)
    path.write_text("models: [{}, {mesh: {num_processes: 2}}]\n")
    with pytest.raises(ConfigError, match="num_processes must be 1"):
        load_config(path)


def test_memory_check_names_the_model_that_does_not_fit(tiny_dir: Path, capsys: pytest.CaptureFixture) -> None:
    # On this machine's memory: a KV pool of 10^8 pages cannot fit, and the error says whose it is.
    argv = ["--add-model", f"checkpoint={tiny_dir},served_model_name=tiny,engine.num_pages=100000000"]
    assert serve.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: model 'tiny' does not fit in memory") and "\n" not in err, err
    # Against a given amount: the models fill it in order, and the first that overflows is named.
    configs = serve.config_from_args(serve.parse_args(["--add-model", f"checkpoint={tiny_dir},served_model_name=tiny"]))
    smol = footprint(configs.per_model()[0], SMOL, "cpu")
    # SmolLM2's 135M parameters, and its 2048 pages x 16 tokens x 30 layers x K, V x 3 heads x 64, in
    # bfloat16 on a CPU with AVX512-BF16 (the default dtype, auto, there), else in float32 with the
    # tied table's one-row copy (models/row_head.py).
    item = 2 if native_bf16() else 4
    row_head = 0 if native_bf16() else 49152 * 576 * 4
    assert smol.weights == pytest.approx(135e6 * item + row_head, rel=0.02)
    assert smol.kv_cache == 2048 * 16 * 30 * 2 * 3 * 64 * item
    enough_for_one = int(smol.total / 0.9) + 1024
    with pytest.raises(ConfigError, match=r"model 'tiny' does not fit in memory: it needs .* left after the models"):
        check_memory(configs.per_model(), [SMOL, "tiny"], available=(enough_for_one, "test memory"))
    fits = check_memory(configs.per_model(), [SMOL, "tiny"], available=(enough_for_one * 2, "test memory"))
    assert [f.name for f in fits] == [SMOL, "tiny"]
