"""What the app answers while a model loads (no device: stand-in engines, the real app): the model
list holds only models that serve, and is 503 ``server_not_ready`` while none does, as a vLLM server
listens only once its model serves; a loading model's card and its requests are 503 too; /health is
503 until every model serves."""

from __future__ import annotations

import threading

from fastapi.testclient import TestClient

from myserve.config import Config
from myserve.frontend.app import ServedModel
from myserve.frontend.http_server import app_for_models
from myserve.wire.outputs import EngineStats


class StandIn:
    """An engine that never runs a request: loading until ``ready`` is set."""

    tokenizer = None
    vocab_size, max_model_len = 100, 64

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.adapter_paths: dict[str, str] = {}
        self.dead: str | None = None

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0, 0, 0, 0.0, 0, 0, 0, 0, 0, 0, 0, 0)


def test_the_model_list_holds_the_models_that_serve() -> None:
    first, second = StandIn(), StandIn()
    app = app_for_models(Config(), [ServedModel(engine=first, names=("a",)), ServedModel(engine=second, names=("b",))])
    client = TestClient(app)

    def listed() -> list[str] | str:
        r = client.get("/v1/models")
        return [m["id"] for m in r.json()["data"]] if r.status_code == 200 else r.json()["error"]["code"]

    assert listed() == "server_not_ready"
    assert client.get("/v1/models/a").json()["error"]["code"] == "server_not_ready"
    assert client.post("/v1/completions", json={"model": "a", "prompt": "x"}).status_code == 503
    assert client.get("/health").status_code == 503

    second.ready.set()
    assert listed() == ["b"]
    assert client.get("/v1/models/b").json()["id"] == "b"
    assert client.get("/v1/models/a").status_code == 503
    assert client.get("/v1/models/c").json()["error"]["code"] == "model_not_found"
    assert client.get("/health").status_code == 503

    first.ready.set()
    assert listed() == ["a", "b"]
    assert client.get("/health").status_code == 200
