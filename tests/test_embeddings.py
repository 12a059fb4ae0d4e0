"""Embeddings through the real engine and the real app: vectors equal transformers' pooled hidden
states (tiny random Qwen3 and Llama, last and mean pooling), the same vector alone and inside a
batch mixed with generation, ``/v1/embeddings`` through the OpenAI SDK (float and base64), its
errors, truncation, and an embedding-only deployment whose steps hold no LM head."""

from __future__ import annotations

import base64
import dataclasses
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from test_server import LiveServer

from myserve.frontend.app import create_app
from myserve.runtime.deployment import step_buckets
from myserve.testing import TINY_ENGINE, make_tiny_checkpoint, start_service
from myserve.wire.params import SamplingParams
from myserve.wire.pooling import PoolingParams

LENGTHS = (3, 40, 150)  # a decode-sized input, one step's worth, and one prefilled in chunks of 64


def inputs(seed: int = 1, lengths: tuple[int, ...] = LENGTHS) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    return [[int(t) for t in rng.randint(3, 256, size=n)] for n in lengths]


@pytest.fixture(scope="module", params=["qwen3", "llama3"])
def embedder(request, tmp_path_factory: pytest.TempPathFactory):
    """A generate+embed engine of each architecture, and its checkpoint (SmolLM2's vocabulary, so
    that text inputs tokenize into it)."""
    checkpoint = make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param), vocab_size=49152)
    svc = start_service(checkpoint, *TINY_ENGINE, "engine.num_pages=256", "model.task=generate+embed")
    yield svc, checkpoint
    svc.shutdown()


def pooled_as(svc, kind: str) -> None:
    """The pooling is the host's alone (the steps sum whichever tokens the layout names), so one
    compiled engine serves both kinds: switched between requests."""
    svc.pooler = dataclasses.replace(svc.pooler, type=kind)


def vector(svc, ids: list[int], **pooling: object):
    outputs = list(svc.submit(ids, SamplingParams(pooling=PoolingParams(**pooling))))  # type: ignore[arg-type]
    (out,) = [o for o in outputs if o.embedding is not None]
    return np.frombuffer(out.embedding, "<f4")


def hf_vector(model, ids: list[int], kind: str) -> np.ndarray:
    import torch

    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0].numpy()
    v = hidden[-1] if kind == "last" else hidden.mean(axis=0)
    return v / np.linalg.norm(v)


@pytest.mark.parametrize("kind", ["last", "mean"])
def test_vectors_equal_transformers_pooled_hidden_states(embedder, kind: str) -> None:
    import torch
    import transformers

    svc, checkpoint = embedder
    pooled_as(svc, kind)
    ref = transformers.AutoModel.from_pretrained(checkpoint, dtype=torch.float32).eval()
    prompts = inputs()
    streams = [svc.submit(p, SamplingParams(pooling=PoolingParams())) for p in prompts]  # all at once
    for p, stream in zip(prompts, streams, strict=True):
        (out,) = [o for o in stream if o.embedding is not None]
        got, want = np.frombuffer(out.embedding, "<f4"), hf_vector(ref, p, kind)
        cosine, diff = float(got @ want), float(np.abs(got - want).max())
        print(f"{checkpoint.name} {kind} {len(p)} tokens: cosine {cosine:.7f}, max abs diff {diff:.2e}")
        assert cosine >= 0.9999 and diff < 1e-4, (len(p), cosine, diff)
        assert np.linalg.norm(got) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("kind", ["last", "mean"])
def test_the_same_input_alone_and_in_a_batch_mixed_with_generation(embedder, kind: str) -> None:
    svc, _ = embedder
    pooled_as(svc, kind)
    target = inputs(seed=2, lengths=(90,))[0]
    alone = vector(svc, target)
    others = inputs(seed=3, lengths=(5, 70, 12, 33, 100, 8, 64))
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    gens = [svc.submit(p, greedy) for p in inputs(seed=4, lengths=(7, 50, 3, 20, 80, 9, 30, 15))]
    embs = [svc.submit(p, SamplingParams(pooling=PoolingParams())) for p in [*others[:3], target, *others[3:]]]
    vectors = [np.frombuffer(next(o for o in s if o.embedding is not None).embedding, "<f4") for s in embs]
    assert all(sum(len(o.token_ids) for o in s) == 12 for s in gens)
    in_batch = vectors[3]
    diff = float(np.abs(in_batch - alone).max())
    print(f"{kind}: alone vs in a batch of 16: max abs diff {diff:.2e}")
    assert float(in_batch @ alone) >= 0.99999 and diff < 1e-5
    # And each of the batch's other vectors is its own alone.
    np.testing.assert_allclose(vectors[0], vector(svc, others[0]), atol=1e-5)


@pytest.fixture(scope="module")
def live(embedder):
    svc, _ = embedder
    pooled_as(svc, "last")
    server = LiveServer(create_app(svc, served_model_name="tiny-embed"))
    yield server, svc
    server.stop()


def test_the_openai_sdk_gets_float_and_base64_vectors(live) -> None:
    server, svc = live
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    texts = ["The capital of France is Paris.", "Embeddings map text to vectors."]
    ids = [svc.tokenizer.encode(t, add_special_tokens=True) for t in texts]
    floats = client.embeddings.create(model="tiny-embed", input=texts, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1] and floats.model == "tiny-embed"
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    decoded = client.embeddings.create(model="tiny-embed", input=texts)  # the SDK asks for base64 and decodes it
    for i, want in enumerate(vector(svc, p) for p in ids):
        np.testing.assert_allclose(floats.data[i].embedding, want, atol=1e-6)
        np.testing.assert_allclose(decoded.data[i].embedding, want, atol=1e-6)
    raw = httpx.post(
        f"{server.url}/v1/embeddings", json={"input": ids[0], "encoding_format": "base64"}, timeout=60
    ).json()
    assert np.array_equal(np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4"), vector(svc, ids[0]))


def test_truncation_and_the_errors_of_bad_inputs(live) -> None:
    server, svc = live
    post = lambda body: httpx.post(f"{server.url}/v1/embeddings", json={"model": "tiny-embed", **body}, timeout=60)  # noqa: E731
    long = inputs(seed=6, lengths=(600,))[0]  # past the 512-token context
    r = post({"input": long})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = post({"input": long, "truncate_prompt_tokens": 100})
    assert r.status_code == 200
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], vector(svc, long[-100:]), atol=1e-6)
    assert r.json()["usage"]["prompt_tokens"] == 100
    assert post({"input": long, "truncate_prompt_tokens": -1}).json()["usage"]["prompt_tokens"] == 512
    cases = [
        ({"input": "x", "dimensions": 8}, "dimensions"),  # the model has no matryoshka widths
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[1, 2], [99999]]}, "input"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "truncate_prompt_tokens": 9999}, "truncate_prompt_tokens"),
        ({"input": ["x"] * 2049}, "input"),
    ]
    for body, param in cases:
        r = post(body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    assert post({"input": "x", "model": "other"}).status_code == 404


def test_matryoshka_dimensions_truncate_and_renormalize(live) -> None:
    server, svc = live
    full = vector(svc, [5, 6, 7])
    svc.pooler = dataclasses.replace(svc.pooler, dimensions=())  # as is_matryoshka in config.json says
    try:
        body = httpx.post(f"{server.url}/v1/embeddings", json={"input": [5, 6, 7], "dimensions": 16}, timeout=60).json()
    finally:
        svc.pooler = dataclasses.replace(svc.pooler, dimensions=None)
    got = np.array(body["data"][0]["embedding"])
    assert got.shape == (16,)
    np.testing.assert_allclose(got, full[:16] / np.linalg.norm(full[:16]), atol=1e-6)


def test_a_generation_model_refuses_embeddings_and_an_embedding_model_refuses_chat(smol_service, live) -> None:
    server = LiveServer(create_app(smol_service, served_model_name="smol"))
    try:
        r = httpx.post(f"{server.url}/v1/embeddings", json={"input": "hi"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported"
    finally:
        server.stop()
    live_server, svc = live
    svc.pooler = dataclasses.replace(svc.pooler, generate=False)
    try:
        body = {"model": "tiny-embed", "prompt": "hi", "max_tokens": 2}
        r = httpx.post(f"{live_server.url}/v1/completions", json=body, timeout=60)
    finally:
        svc.pooler = dataclasses.replace(svc.pooler, generate=True)
    assert r.status_code == 400 and "embeddings only" in r.json()["error"]["message"]


def test_an_embedding_only_step_has_no_lm_head_nor_sampler(tiny_checkpoints: dict[str, Path]) -> None:
    from myserve.bundled import bundled_gguf_path
    from myserve.config import load_config
    from myserve.core.build import make_executors
    from myserve.runtime.deployment import Deployment

    kinds, texts = {}, {}
    for task in ("embed", "generate+embed"):
        checkpoint = f"model.checkpoint={tiny_checkpoints['qwen3']}"
        overrides = [checkpoint, f"model.tokenizer={bundled_gguf_path()}", *TINY_ENGINE, f"model.task={task}"]
        config = load_config(None, overrides)
        (executor,) = make_executors(Deployment.load(config))
        now, _ = step_buckets(config, 512).compile_ops()
        kinds[task] = {key[0] for key in executor.keys(now)}
        texts[task] = executor.lower(("forward", next(s for s in now.shapes if s.tokens == 8))).as_text()
        if task != "embed":
            texts["head"] = executor.lower(("head", 8, "argmax")).as_text()
    # Embedding only: no LM head nor sampler executable at all.
    assert kinds == {"embed": {"forward"}, "generate+embed": {"forward", "head", "score"}}
    # The LM head's logits of the 8 sampling rows (f32[8,256]: the tiny vocabulary) are the head's alone.
    assert "<8x256xf32>" in texts["head"]
    assert "<8x256xf32>" not in texts["embed"] and "<8x256xf32>" not in texts["generate+embed"]
