"""vLLM's and SageMaker's other endpoints through the real app on a generate+embed engine:
``/version``, ``/ping``, ``/invocations``, ``/server_info``, ``/reset_prefix_cache``, and
``/v1/score`` and ``/v1/rerank`` ranked by the cosine of the model's own embeddings."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from test_server import LiveServer

from myserve.frontend.app import create_app
from myserve.testing import TINY_ENGINE, make_tiny_checkpoint, start_service

KEY = {"Authorization": "Bearer k"}
DOCS = ["The cat sat on the mat.", "Stock markets fell sharply today.", "A kitten naps on a rug.", "Rain tomorrow."]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    checkpoint = make_tiny_checkpoint("llama3", tmp_path_factory.mktemp("endpoints"), vocab_size=49152)
    svc = start_service(checkpoint, *TINY_ENGINE, "engine.num_pages=256", "model.task=generate+embed")
    live = LiveServer(create_app(svc, served_model_name="tiny", api_key="k"))
    yield live, svc
    live.stop()
    svc.shutdown()


def embedding(url: str, text: str) -> np.ndarray:
    body = {"model": "tiny", "input": text}
    v = np.array(httpx.post(f"{url}/v1/embeddings", json=body, headers=KEY).json()["data"][0]["embedding"])
    return v / np.linalg.norm(v)


def test_version_and_ping_need_no_key(server) -> None:
    live, _ = server
    version = httpx.get(f"{live.url}/version").json()["version"]
    assert version and version[0].isdigit()
    assert httpx.get(f"{live.url}/ping").status_code == 200
    assert httpx.post(f"{live.url}/ping").status_code == 200


def test_server_info_names_what_is_served(server) -> None:
    live, _ = server
    assert httpx.get(f"{live.url}/server_info").status_code == 401
    info = httpx.get(f"{live.url}/server_info", headers=KEY).json()
    (model,) = info["models"]
    assert model["names"] == ["tiny"] and model["max_model_len"] == 512 and model["embeddings"] is True
    assert "k" not in str(info)  # no secret in it


def test_invocations_dispatch_by_body(server) -> None:
    live, _ = server
    url = f"{live.url}/invocations"
    chat = httpx.post(
        url, json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, headers=KEY
    )
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    text = httpx.post(url, json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}, headers=KEY).json()
    assert text["object"] == "text_completion" and text["usage"]["completion_tokens"] == 2
    vec = httpx.post(url, json={"input": "hello"}, headers=KEY).json()
    assert vec["data"][0]["object"] == "embedding"
    bad = httpx.post(url, json={"model": "tiny", "prompt": [1], "max_tokens": -1}, headers=KEY)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    neither = httpx.post(url, json={"hello": 1}, headers=KEY)
    assert neither.status_code == 400 and "messages (chat), prompt (completion) or input" in neither.text
    assert httpx.post(url, json={"prompt": [1]}).status_code == 401


def test_rerank_and_score_order_by_the_cosine_of_our_embeddings(server) -> None:
    live, _ = server
    query = "Where is the cat?"
    q = embedding(live.url, query)
    want = [float(q @ embedding(live.url, d)) for d in DOCS]
    body = {"model": "tiny", "query": query, "documents": DOCS}
    ranked = httpx.post(f"{live.url}/v1/rerank", json=body, headers=KEY).json()
    assert [r["index"] for r in ranked["results"]] == sorted(range(len(DOCS)), key=lambda i: -want[i])
    for r in ranked["results"]:
        assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-5)
        assert r["document"]["text"] == DOCS[r["index"]]
    assert ranked["id"].startswith("rerank-") and ranked["usage"]["total_tokens"] > 0
    top = httpx.post(f"{live.url}/v2/rerank", json={**body, "top_n": 2, "return_documents": False}, headers=KEY)
    assert [r["index"] for r in top.json()["results"]] == [r["index"] for r in ranked["results"][:2]]
    assert "document" not in top.json()["results"][0]

    one_to_many = httpx.post(f"{live.url}/v1/score", json={"text_1": query, "text_2": DOCS}, headers=KEY).json()
    assert [d["score"] for d in one_to_many["data"]] == pytest.approx(want, abs=1e-5)
    pairs = {"text_1": [query, DOCS[0]], "text_2": [DOCS[1], DOCS[2]]}
    pairwise = httpx.post(f"{live.url}/score", json=pairs, headers=KEY).json()["data"]
    assert pairwise[0]["score"] == pytest.approx(want[1], abs=1e-5)
    assert pairwise[1]["score"] == pytest.approx(
        float(embedding(live.url, DOCS[0]) @ embedding(live.url, DOCS[2])), abs=1e-5
    )
    mismatch = httpx.post(f"{live.url}/v1/score", json={"text_1": ["a", "b"], "text_2": ["c"]}, headers=KEY)
    assert mismatch.status_code == 400 and mismatch.json()["error"]["param"] == "text_2"
    empty = httpx.post(f"{live.url}/v1/rerank", json={"query": "q", "documents": []}, headers=KEY)
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "documents"


def test_reset_prefix_cache_forgets_cached_prompts(server) -> None:
    live, svc = server
    prompt = list(range(3, 100))  # six full pages of 16
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
    httpx.post(f"{live.url}/v1/completions", json=body, headers=KEY)
    before = svc.stats().prefix_cache_hit_tokens
    httpx.post(f"{live.url}/v1/completions", json=body, headers=KEY)
    assert svc.stats().prefix_cache_hit_tokens > before  # the second prompt hit the cache
    assert httpx.post(f"{live.url}/reset_prefix_cache").status_code == 401
    assert httpx.post(f"{live.url}/reset_prefix_cache", headers=KEY).status_code == 200
    hits = svc.stats().prefix_cache_hit_tokens
    httpx.post(f"{live.url}/v1/completions", json=body, headers=KEY)
    assert svc.stats().prefix_cache_hit_tokens == hits  # computed afresh
    httpx.post(f"{live.url}/v1/completions", json=body, headers=KEY)
    assert svc.stats().prefix_cache_hit_tokens > hits  # and cached again


def test_score_needs_an_embedding_model(tiny_service) -> None:
    live = LiveServer(create_app(tiny_service, served_model_name="gen"))
    try:
        r = httpx.post(f"{live.url}/v1/rerank", json={"query": "q", "documents": ["d"]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported"
    finally:
        live.stop()
