"""Live weight updates (``core/engine_weights.py``, sglang's ``/update_weights_from_disk``) on two
tiny random Llamas of one shape, A and B: under 32 concurrent streams, five updates alternating
them lose no request, compile nothing, and every response names the version whose greedy tokens it
carries (those of a server started on that version); ``policy: cut`` moves a running request over;
the prefix cache never hands one version's pages to another; bad updates are refused naming what
is wrong while the old version serves on; and over HTTP the route, its opt-in, the API key, the
``X-Weights-Version`` header, ``system_fingerprint`` and ``/v1/models`` say the same."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from test_server import LiveServer

from myserve.client import APIError, Client
from myserve.frontend.app import create_app
from myserve.testing import TINY_ENGINE, make_tiny_checkpoint, start_service
from myserve.wire.params import SamplingParams

ENGINE = (*TINY_ENGINE, "engine.num_pages=256", "engine.max_num_seqs=32")
PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [100, 3, 100, 3, 9], [11, 200, 31, 4, 250, 17, 9, 2, 60, 61, 62]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    return make_tiny_checkpoint("llama3", root / "a", seed=0), make_tiny_checkpoint("llama3", root / "b", seed=1)


@pytest.fixture(scope="module")
def service(checkpoints):
    svc = start_service(checkpoints[0], *ENGINE, "engine.enable_weight_updates=true")
    yield svc
    svc.shutdown()


@pytest.fixture(scope="module")
def references(checkpoints, service):
    """Each prompt's greedy tokens from a server started on A (the service before any update) and
    one started on B."""
    plain_b = start_service(checkpoints[1], *ENGINE)
    try:
        return {
            "a": [run(service, p)[0] for p in PROMPTS],
            "b": [run(plain_b, p)[0] for p in PROMPTS],
        }
    finally:  # its background builds done first: one still compiling would count in the test's process
        assert plain_b.replicas[0].runner.device.background_builds_done(600)
        plain_b.shutdown()


def run(service, prompt: list[int], params: SamplingParams = GREEDY) -> tuple[list[int], list[str], str | None]:
    """A request's tokens, the versions of the weights its outputs name (in order) and its finish."""
    tokens: list[int] = []
    versions: list[str] = []
    finish = None
    for out in service.submit(prompt, params):
        tokens.extend(out.token_ids)
        if out.weights_version is not None and out.weights_version not in versions:
            versions.append(out.weights_version)
        finish = out.error or out.finish_reason or finish
    return tokens, versions, finish


def update(service, path, version: str | None = None, policy: str = "finish") -> tuple[str | None, dict]:
    return asyncio.run(service.update_weights(str(path), version, policy))


def test_five_updates_under_32_streams_lose_nothing_and_compile_nothing(service, checkpoints, references) -> None:
    a, b = checkpoints
    stop = threading.Event()
    results: list[tuple[int, list[int], list[str], str | None]] = []
    lock = threading.Lock()

    def stream(worker: int) -> None:
        i = worker
        while not stop.is_set():
            prompt = i % len(PROMPTS)
            tokens, versions, finish = run(service, PROMPTS[prompt])
            with lock:
                results.append((prompt, tokens, versions, finish))
            i += 1

    workers = [threading.Thread(target=stream, args=(w,)) for w in range(32)]
    # (the few-rows variant of the 64-token bucket builds in the background after ready)
    assert service.replicas[0].runner.device.background_builds_done(600)
    compiled = service.stats().compile_count
    for w in workers:
        w.start()
    plan = [(b, "b1"), (a, "a2"), (b, "b3"), (a, "a4"), (b, "b5")]
    weights_of = {"0": "a", **{label: label[0] for _, label in plan}}
    switch_times = []
    try:
        time.sleep(0.5)
        for path, label in plan:
            t0 = time.perf_counter()
            error, info = update(service, path, label)
            switch_times.append(time.perf_counter() - t0)
            assert error is None and info["version"] == label
            time.sleep(0.3)
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=120)
    print(f"\nupdates: {len(results)} requests, call to switch {[round(t, 3) for t in switch_times]} s")
    assert service.stats().compile_count == compiled  # nothing compiled
    assert service.stats().weight_swaps >= 5
    served = set()
    for prompt, tokens, versions, finish in results:
        assert finish == "length", finish  # no request failed
        assert len(versions) == 1, versions  # finished on the version it started on
        served.add(versions[0])
        assert tokens == references[weights_of[versions[0]]][prompt], (prompt, versions)
    assert served == set(weights_of)  # every version served requests
    assert len(service.weight_versions) == 1  # the old versions were let go


def test_cut_moves_a_running_request_to_the_new_version(service, checkpoints, references) -> None:
    a, b = checkpoints
    current = service.stats().weights_version
    nxt, path = ("a-cut", a) if service.weights_info["path"] == str(b) else ("b-cut", b)
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    stream = service.submit(PROMPTS[0], long)
    outputs, cut = [], False
    for out in stream:
        outputs.append(out)
        # (>=, once: a reader that fell behind gets deltas coalesced, so the count can skip 6.)
        if not cut and len([o for o in outputs if o.token_ids]) >= 6:
            cut = True
            error, _ = update(service, path, nxt, "cut")
            assert error is None
    versions = [o.weights_version for o in outputs if o.token_ids]
    assert versions[0] == current and versions[-1] == nxt  # its later tokens came from the new one
    assert sum(len(o.token_ids) for o in outputs) == 400 and outputs[-1].usage is not None
    first = [t for o in outputs if o.weights_version == current for t in o.token_ids]
    before = references["a" if nxt.startswith("b") else "b"][0]
    assert first[: len(before)] == before[: len(first)]
    assert len(service.weight_versions) == 1  # cut lets the old version go at once


def test_the_new_version_never_reuses_the_old_versions_cached_pages(service, checkpoints, references) -> None:
    a, b = checkpoints
    prompt = [7 + (i * 13) % 200 for i in range(40)] + PROMPTS[1]  # 5 full pages of 8 tokens and more
    error, _ = update(service, a, "a-cache")
    assert error is None
    first = service.submit(prompt, GREEDY)
    a_tokens = [t for out in first for t in out.token_ids]
    error, _ = update(service, b, "b-cache")
    assert error is None
    outs = list(service.submit(prompt, GREEDY))
    assert outs[-1].usage.cached_tokens == 0  # A's pages of the same prompt are not B's
    b_tokens = [t for out in outs for t in out.token_ids]
    assert b_tokens != a_tokens
    again = list(service.submit(prompt, GREEDY))
    assert again[-1].usage.cached_tokens >= 40 and [t for o in again for t in o.token_ids] == b_tokens


def test_bad_updates_are_refused_and_the_old_version_serves_on(service, checkpoints, tmp_path) -> None:
    a, _ = checkpoints
    before = service.stats().weights_version
    expected = run(service, PROMPTS[2])[0]
    wider = make_tiny_checkpoint("llama3", tmp_path / "wider", vocab_size=512)
    qwen = make_tiny_checkpoint("qwen3", tmp_path / "qwen")
    reshaped = tmp_path / "reshaped"
    make_tiny_checkpoint("llama3", reshaped, seed=3)
    weights = load_file(str(reshaped / "model.safetensors"))
    name = next(k for k in weights if k.endswith("layers.0.mlp.up_proj.weight"))
    weights[name] = np.zeros((weights[name].shape[0] + 2, weights[name].shape[1]), weights[name].dtype)
    save_file(weights, str(reshaped / "model.safetensors"), metadata={"format": "pt"})
    cases = [
        (tmp_path / "missing", "no such directory"),
        (wider, "vocab_size is 512"),
        (qwen, "model_type is 'qwen3'"),
        (reshaped, "up_proj"),
    ]
    for path, says in cases:
        error, info = update(service, path)
        assert error is not None and says in error, (path, error)
        assert info["version"] == before
    error, _ = update(service, a, before)  # a label already loaded
    assert error is not None and "already loaded" in error
    assert run(service, PROMPTS[2])[0] == expected and service.stats().weights_version == before


def test_over_http_with_the_api_key(service, checkpoints, references) -> None:
    a, b = checkpoints
    live = LiveServer(create_app(service, served_model_name="tiny", api_key="k", weight_updates=True))
    closed = LiveServer(create_app(service, served_model_name="tiny"))
    auth = {"Authorization": "Bearer k"}
    try:
        url = f"{live.url}/update_weights_from_disk"
        assert httpx.post(url, json={"model_path": str(b)}).status_code == 401
        assert httpx.post(f"{closed.url}/update_weights_from_disk", json={"model_path": str(b)}).status_code == 404
        answer = httpx.post(url, json={"model_path": str(b), "version": "http-b"}, headers=auth, timeout=120)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["success"] is True and body["version"] == "http-b" and "http-b" in body["message"]
        card = httpx.get(f"{live.url}/v1/models", headers=auth).json()["data"][0]
        assert card["weights_version"] == "http-b" and card["weights_loaded_at"] >= body["loaded_at"] - 1
        done = httpx.post(
            f"{live.url}/v1/completions",
            json={"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0},
            headers=auth,
        )
        assert done.headers["x-weights-version"] == "http-b"
        assert done.json()["system_fingerprint"].endswith("+weights-http-b")
        with httpx.stream(
            "POST",
            f"{live.url}/v1/completions",
            json={"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 4, "stream": True},
            headers=auth,
        ) as streamed:
            assert streamed.headers["x-weights-version"] == "http-b"
            chunks = [line for line in streamed.iter_lines() if line.startswith("data: {")]
        assert all('"system_fingerprint":"myserve-0.1.0+weights-http-b"' in c.replace(" ", "") for c in chunks)
        refused = httpx.post(url, json={"model_path": "/nowhere"}, headers=auth)
        assert refused.status_code == 400
        assert refused.json()["success"] is False and refused.json()["error"]["param"] == "model_path"
        bad_policy = httpx.post(url, json={"model_path": str(a), "policy": "later"}, headers=auth)
        assert bad_policy.status_code == 400 and bad_policy.json()["error"]["param"] == "policy"
        with Client(live.url, api_key="k") as client:  # the client a trainer pushes weights with
            pushed = client.update_weights(str(a), version="http-a", policy="cut")
            assert pushed["success"] and pushed["version"] == "http-a"
            with pytest.raises(APIError) as refused_by_client:
                client.update_weights("/nowhere")
            assert refused_by_client.value.status == 400
        metrics = httpx.get(f"{live.url}/metrics", headers=auth).text
        assert 'myserve:weights_loaded_at_seconds{model_name="tiny",version="http-a"}' in metrics
        assert "myserve:weight_updates_total" in metrics
    finally:
        live.stop()
        closed.stop()


def test_an_update_through_the_core_process(checkpoints, references) -> None:
    """The same with the engine core in its own process (as ``serve`` runs it): the update and its
    answer cross the wire, and so does each output's version."""
    from myserve.testing import start_client

    a, b = checkpoints
    client = start_client(a, *ENGINE, "engine.enable_weight_updates=true")
    try:
        error, info = asyncio.run(client.update_weights(str(b), "b-process", "finish"))
        assert error is None and info["version"] == "b-process" and info["path"] == str(b)
        tokens, versions, finish = run(client, PROMPTS[3])
        assert (tokens, versions, finish) == (references["b"][3], ["b-process"], "length")
        error, info = asyncio.run(client.update_weights("/nowhere", None, "finish"))
        assert error is not None and "/nowhere" in error and info["version"] == "b-process"
        assert client.stats().weights_version == "b-process"  # as the core's last report says
    finally:
        client.shutdown()
