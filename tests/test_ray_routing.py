"""The host logic of myserve on Ray Serve, without a Ray cluster (each test runs in milliseconds):
prefix-affinity routing (``PrefixAffinity``) and the text it matches (``routing_text``); several
replicas' Prometheus metrics merged into one exposition; an HTTP call run through a real FastAPI
app in-process (``call_app``: status, headers, streamed chunks, disconnects, errors) and an app's
lifespan; the ``ray`` config section's checks; and the engine replicas' Ray Serve options
(replica count or autoscaling, resources and placement, request router). On a real cluster:
``test_ray_serve.py``."""

from __future__ import annotations

import asyncio
import functools
import importlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from myserve.config import Config, load_config
from myserve.errors import ConfigError
from myserve.ray import http_call
from myserve.ray.affinity import BLOCK_CHARS, MAX_TEXT_CHARS, PrefixAffinity, routing_text
from myserve.ray.deployment import ROUTER_PATH, placement, replica_options
from myserve.ray.http_call import HttpCall, Lifespan, ResponseStart, call_app
from myserve.ray.metrics_merge import REPLICA_LABEL, merge_metrics
from myserve.ray.router import PrefixAffinityRouter

REPLICAS = ["r1", "r2", "r3"]


def blocks(seed: str, n: int) -> str:
    """``n`` whole blocks of text, each different (and different for each seed)."""
    return "".join(f"{seed}-{i}:".ljust(BLOCK_CHARS, ".") for i in range(n))


def test_a_request_goes_to_the_replica_holding_its_prefix() -> None:
    policy = PrefixAffinity()
    system = blocks("system", 3)
    policy.routed("r2", system + "first question")
    assert policy.rank(system + "second question", REPLICAS) == [["r2"], ["r1", "r3"]]
    assert policy.rank(blocks("other", 3), REPLICAS) == [["r1", "r3", "r2"]]  # no holder: by load


def test_the_longest_match_wins() -> None:
    policy = PrefixAffinity()
    policy.routed("r1", blocks("s", 2))
    policy.routed("r2", blocks("s", 4))
    assert policy.best_match(blocks("s", 5), REPLICAS) == ("r2", 4)
    assert policy.rank(blocks("s", 4) + "tail", REPLICAS)[0] == ["r2"]
    assert policy.best_match(blocks("s", 2) + blocks("t", 2), REPLICAS) == ("r1", 2)  # a tie: the first


def test_a_busy_holder_is_skipped_until_its_requests_complete() -> None:
    policy = PrefixAffinity(imbalance=2)
    text = blocks("doc", 2)
    for sent in (text, None, None):
        policy.routed("r1", sent)
    assert policy.rank(text, ["r1", "r2"]) == [["r2", "r1"]]  # 3 above the least loaded: one group by load
    policy.completed("r1")
    assert policy.rank(text, ["r1", "r2"]) == [["r1"], ["r2"]]  # 2 above: allowed
    for _ in range(5):
        policy.completed("r1")  # down to 0, never below
    policy.routed("r1", None)
    assert policy.rank(None, ["r1", "r2"]) == [["r2", "r1"]]  # r1 has 1 in flight, not -2


def test_a_replaced_replica_is_forgotten() -> None:
    policy = PrefixAffinity()
    text = blocks("doc", 3)
    for _ in range(5):
        policy.routed("r1", text)
    policy.routed("r2", None)
    assert policy.rank(None, ["r1", "r2"]) == [["r2", "r1"]]
    policy.keep_only(["r2"])
    assert policy.held_blocks("r1") == 0
    assert policy.rank(text, ["r1", "r2"]) == [["r1", "r2"]]  # no holder, and r1's load is gone


@pytest.mark.parametrize(
    ("use_prefix", "text"), [(True, "x" * (BLOCK_CHARS - 1)), (False, blocks("doc", 4))], ids=["short", "least_loaded"]
)
def test_a_text_under_a_block_or_least_loaded_routing_never_sticks(use_prefix: bool, text: str) -> None:
    policy = PrefixAffinity(use_prefix=use_prefix)
    policy.routed("r1", text)
    assert policy.held_blocks("r1") == 0
    assert policy.rank(text, ["r1", "r2"]) == [["r2", "r1"]]


def test_block_memory_is_bounded_and_drops_the_least_recently_sent() -> None:
    policy = PrefixAffinity(max_blocks=4)
    a, b, c = blocks("a", 2), blocks("b", 2), blocks("c", 2)
    for sent in (a, b, a, c):  # a sent again is recent again
        policy.routed("r1", sent)
    assert policy.held_blocks("r1") == 4
    assert [policy.best_match(text, ["r1"]) for text in (a, b, c)] == [("r1", 2), ("r1", 0), ("r1", 2)]


def test_loads_from_ray_override_the_routers_own_counts() -> None:
    policy = PrefixAffinity(imbalance=8)
    text = blocks("doc", 2)
    policy.routed("r1", text)
    assert policy.rank(text, ["r1", "r2"]) == [["r1"], ["r2"]]  # by its own count: 1 in flight
    assert policy.rank(text, ["r1", "r2"], loads={"r1": 10, "r2": 1}) == [["r2", "r1"]]  # 9 above
    assert policy.rank(text, ["r1", "r2"], loads={"r1": 9, "r2": 1}) == [["r1"], ["r2"]]  # 8 above
    for _ in range(3):
        policy.routed("r2", None)
    # r1 as Ray saw it, r2 by this router's count (3), r3 by neither (0).
    assert policy.rank(None, REPLICAS, loads={"r1": 1}) == [["r3", "r1", "r2"]]


CHAT = "/v1/chat/completions"


def body(**request: Any) -> bytes:
    return json.dumps(request).encode()


def chat(model: str, *messages: tuple[str, Any]) -> str | None:
    return routing_text(CHAT, body(model=model, messages=[{"role": r, "content": c} for r, c in messages]))


def test_a_chat_conversation_extends_its_earlier_turns_text() -> None:
    turns = [("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello!"), ("user", "Bye")]
    short, long = chat("m", *turns[:2]), chat("m", *turns)
    assert short is not None and long is not None and long.startswith(short)
    assert all(content in long for _, content in turns)
    image = {"type": "image_url", "image_url": {"url": "x"}}
    in_parts = chat("m", ("system", [{"type": "text", "text": "Be"}, image, {"type": "text", "text": "brief."}]))
    assert in_parts is not None and "Be" in in_parts and "brief." in in_parts and "image_url" not in in_parts
    assert chat("m", ("user", [{"type": "text", "text": "Hi"}])) == chat("m", ("user", "Hi"))


def test_completions_responses_and_embeddings_prompts_are_matched() -> None:
    text = routing_text("/v1/completions", body(model="m", prompt="Once upon a time"))
    assert text is not None and text.startswith("m") and text.endswith("Once upon a time")
    ids = routing_text("/v1/completions", body(model="m", prompt=[101, 2023, 2003]))
    more = routing_text("/v1/completions", body(model="m", prompt=[101, 2023, 2003, 1037]))
    assert ids is not None and more is not None and more.startswith(ids) and "2023" in ids
    text = routing_text("/v1/responses", body(model="m", instructions="Speak French.", input="Hello"))
    assert text is not None and text.index("Speak French.") < text.index("Hello")
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Bonjour"}]}]
    listed = routing_text("/v1/responses", body(model="m", input=items))
    assert listed is not None and "user" in listed and "Bonjour" in listed
    embedded = routing_text("/v1/embeddings", body(model="e", input=["alpha", "beta"]))
    assert embedded is not None and "alpha" in embedded and "beta" in embedded


def test_two_models_never_share_a_block() -> None:
    a, b = (chat(model, ("user", blocks("shared", 4))) for model in ("model-a", "model-b"))
    assert a is not None and b is not None
    policy = PrefixAffinity()
    policy.routed("r1", a)
    assert policy.best_match(a, ["r1"]) == ("r1", 4) and policy.best_match(b, ["r1"]) == ("r1", 0)


def test_a_body_without_a_prompt_has_no_routing_text() -> None:
    for raw in (b"{not json", b"\xff\xfe", b"[1, 2]", b"", body(model="m"), body(model="m", messages=[])):
        assert routing_text(CHAT, raw) is None, raw
    assert routing_text("/v1/completions", body(model="m", prompt="")) is None


def test_the_routing_text_is_capped() -> None:
    text = routing_text("/v1/completions", body(model="m", prompt="a" * (2 * MAX_TEXT_CHARS)))
    assert text is not None and len(text) == MAX_TEXT_CHARS


def replica_metrics(requests: int, running: int, ttfts: list[float]) -> str:
    """One replica's /metrics, as prometheus_client writes it."""
    registry = CollectorRegistry()
    Counter("myserve_requests", "Requests served.", ["route"], registry=registry).labels("chat").inc(requests)
    running_gauge = Gauge("vllm:num_requests_running", "Requests running.", ["model_name"], registry=registry)
    running_gauge.labels("tiny").set(running)
    ttft = Histogram("myserve_ttft_seconds", "Time to first token.", buckets=(0.1, 1.0), registry=registry)
    for t in ttfts:
        ttft.observe(t)
    return generate_latest(registry).decode()


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    families = text_string_to_metric_families(text)
    return {(s.name, frozenset(s.labels.items())): s.value for family in families for s in family.samples}


def test_replicas_metrics_merge_into_one_labelled_exposition() -> None:
    texts = {"replica-a": replica_metrics(3, 2, [0.05, 0.5]), "replica-b": replica_metrics(7, 0, [2.0])}
    merged = merge_metrics(texts)
    got = samples(merged)  # every replica's every sample, labelled, and nothing else:
    assert got == {(n, ls | {(REPLICA_LABEL, r)}): v for r, t in texts.items() for (n, ls), v in samples(t).items()}
    assert got[("myserve_requests_total", frozenset({("route", "chat"), (REPLICA_LABEL, "replica-b")}))] == 7
    assert got[("vllm:num_requests_running", frozenset({("model_name", "tiny"), (REPLICA_LABEL, "replica-a")}))] == 2
    assert got[("myserve_ttft_seconds_bucket", frozenset({("le", "1.0"), (REPLICA_LABEL, "replica-a")}))] == 2
    lines = merged.splitlines()
    for kind in ("# HELP ", "# TYPE "):  # each family's HELP and TYPE, once
        names = [line.split()[2] for line in lines if line.startswith(kind)]
        assert len(names) == len(set(names))
        assert set(names) == {line.split()[2] for line in texts["replica-a"].splitlines() if line.startswith(kind)}
    assert {"# TYPE vllm:num_requests_running gauge", "# TYPE myserve_ttft_seconds histogram"} <= set(lines)


def run_async(test: Callable[..., Awaitable[None]]) -> Callable[..., None]:
    """An async test, run on a fresh event loop (the suite has no asyncio plugin); one that hangs fails."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(asyncio.wait_for(test(*args, **kwargs), 10))

    return run


async def collect(app: Any, call: HttpCall) -> tuple[list[ResponseStart], bytes]:
    starts: list[ResponseStart] = []
    chunks: list[bytes] = []
    async for item in call_app(app, call):
        if isinstance(item, ResponseStart):
            assert not chunks, "the start comes before the body"
            starts.append(item)
        else:
            chunks.append(item)
    return starts, b"".join(chunks)


def test_the_request_reaches_the_app_and_its_response_comes_back_whole() -> None:
    app = FastAPI()

    @app.api_route("/echo/{name}", methods=["PUT"])
    async def echo(name: str, request: Request) -> JSONResponse:
        client = request.client.host if request.client else None
        got = [request.method, request.url.path, name, dict(request.query_params), request.headers.get("x-test")]
        return JSONResponse([*got, (await request.body()).decode(), client], 201, headers={"x-replica": "r1"})

    call = HttpCall("put", "/echo/abc", b"a=1&b=two", ((b"X-Test", b"yes"),), b'{"k": 1}', client=("10.0.0.1", 5555))
    starts, content = asyncio.run(collect(app, call))
    assert len(starts) == 1 and starts[0].status == 201
    assert {(b"x-replica", b"r1"), (b"content-type", b"application/json")} <= set(starts[0].headers)
    assert json.loads(content) == ["PUT", "/echo/abc", "abc", {"a": "1", "b": "two"}, "yes", '{"k": 1}', "10.0.0.1"]


@run_async
async def test_a_stream_arrives_chunk_by_chunk_before_the_app_finishes() -> None:
    release = asyncio.Event()
    app = FastAPI()

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            yield b"data: 1\n\n"
            await release.wait()  # the second chunk waits until the test saw the first
            yield b"data: 2\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    items = call_app(app, HttpCall("GET", "/stream"))
    start = await asyncio.wait_for(anext(items), 2)
    assert isinstance(start, ResponseStart) and start.status == 200
    assert await asyncio.wait_for(anext(items), 2) == b"data: 1\n\n"
    release.set()
    assert [chunk async for chunk in items] == [b"data: 2\n\n"]


@run_async
async def test_closing_the_stream_early_tells_the_app_the_client_left() -> None:
    received: list[str] = []
    done = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        received.append((await receive())["type"])
        received.append((await receive())["type"])
        done.set()

    items = call_app(app, HttpCall("GET", "/"))
    assert isinstance(await anext(items), ResponseStart) and await anext(items) == b"a"
    await asyncio.sleep(0.01)
    assert received == ["http.request"] and not done.is_set()
    await items.aclose()
    await asyncio.wait_for(done.wait(), 1)
    assert received == ["http.request", "http.disconnect"]


@run_async
async def test_closing_the_stream_early_stops_a_starlette_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_call, "CANCEL_AFTER_S", 60.0)  # only the disconnect can stop it in time
    stopped = asyncio.Event()
    app = FastAPI()

    @app.get("/forever")
    async def forever() -> StreamingResponse:
        async def ticks() -> AsyncIterator[bytes]:
            try:
                while True:
                    yield b"tick"
                    await asyncio.sleep(0.005)
            finally:
                stopped.set()

        return StreamingResponse(ticks())

    items = call_app(app, HttpCall("GET", "/forever"))
    assert isinstance(await anext(items), ResponseStart) and await anext(items) == b"tick"
    assert not stopped.is_set()
    await items.aclose()
    await asyncio.wait_for(stopped.wait(), 2)


@run_async
async def test_an_error_of_the_app_is_raised_to_the_consumer() -> None:
    app = FastAPI()

    @app.get("/fails")
    async def fails() -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            yield b"partial"
            raise ValueError("engine died")

        return StreamingResponse(events())

    got: list[ResponseStart | bytes] = []
    with pytest.raises(ValueError, match="engine died"):
        async for item in call_app(app, HttpCall("GET", "/fails")):
            got.append(item)
    assert got[1:] == [b"partial"]

    async def raw(scope: Any, receive: Any, send: Any) -> None:
        raise KeyError("no route")

    with pytest.raises(KeyError, match="no route"):
        await collect(raw, HttpCall("GET", "/"))


def lifespan_app(events: list[str], fail: bool = False) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if fail:
            raise OSError("no weights")
        events.append("startup")
        yield
        events.append("shutdown")

    return FastAPI(lifespan=lifespan)


@run_async
async def test_lifespan_runs_startup_then_shutdown_and_raises_if_startup_fails() -> None:
    events: list[str] = []
    life = Lifespan(lifespan_app(events))
    await life.shutdown()  # before startup: nothing
    await life.startup()
    assert events == ["startup"]
    await life.shutdown()
    await life.shutdown()
    assert events == ["startup", "shutdown"]
    with pytest.raises(RuntimeError, match="startup failed") as failure:
        await Lifespan(lifespan_app([], fail=True)).startup()
    assert "no weights" in str(failure.value)


@run_async
async def test_an_app_without_lifespan_support_starts_without_waiting() -> None:
    async def no_lifespan(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            raise RuntimeError("lifespan not supported")  # ASGI allows this: the server goes on

    life = Lifespan(no_lifespan)
    await asyncio.wait_for(life.startup(), 2)
    await asyncio.wait_for(life.shutdown(), 2)


def test_serve_run_args_from_a_config_file_keep_their_types() -> None:
    from myserve.ray.deployment import app_builder

    app = app_builder({"ray.accelerator": "none", "server.api_key": None, "ray.replicas": 2, "ray.routing": "prefix"})
    config = app._bound_deployment._replica_config.init_args[1]  # the ingress's (engine handle, config)
    assert config.server.api_key is None and config.ray.replicas == 2 and config.ray.routing == "prefix"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["ray.routing=random"], "ray.routing must be one of prefix, least_loaded, got 'random'"),
        (["ray.accelerator=cuda"], "ray.accelerator must be one of auto, none, gpu, tpu, got 'cuda'"),
        (["ray.min_replicas=3", "ray.max_replicas=2"], "ray.max_replicas (2) must be >= 1 and >= ray.min_replicas (3)"),
        (["ray.replicas=5", "ray.min_replicas=1", "ray.max_replicas=3"], "ray.replicas (5) must lie in [1, 3]"),
        (["ray.replicas=1", "ray.min_replicas=2", "ray.max_replicas=3"], "ray.replicas (1) must lie in [2, 3]"),
        (["ray.replicas=2", "models=[{model: {dtype: float32}}]"], "serves one model: models must be empty"),
        (["ray.replicas=2", "mesh.num_processes=2"], "a replica's mesh is one host (mesh.num_processes: 1)"),
        (["ray.replicas=2", "server.ssl_certfile=c.pem", "server.ssl_keyfile=k.pem"], "TLS ends at Ray Serve's proxy"),
    ],
)
def test_a_bad_ray_section_is_a_config_error_that_says_why(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert message in str(error.value)


def test_a_replica_count_enables_ray_and_bounds_decide_autoscaling() -> None:
    def ray(*overrides: str) -> tuple[bool, bool, tuple[int, int]]:
        section = load_config(None, list(overrides)).ray
        return section.enabled, section.autoscaling, section.bounds()

    assert ray() == (False, False, (1, 1))
    assert ray("ray.replicas=2") == (True, False, (2, 2))
    assert ray("ray.min_replicas=2") == (True, False, (2, 2))  # a count given as a bound alone is a count
    assert ray("ray.max_replicas=3") == (True, True, (1, 3))  # never to zero unless asked
    assert ray("ray.min_replicas=0", "ray.max_replicas=3") == (True, True, (0, 3))
    assert ray("ray.min_replicas=1", "ray.max_replicas=4") == (True, True, (1, 4))
    assert ray("ray.replicas=2", "ray.max_replicas=4") == (True, True, (2, 4))


def config(*overrides: str) -> Config:
    return load_config(None, ["ray.replicas=2", *overrides])


def test_a_fixed_count_is_num_replicas_with_twice_max_num_seqs_ongoing() -> None:
    cfg = config("ray.accelerator=none")
    options = replica_options(cfg, {})
    assert options["num_replicas"] == 2 and "autoscaling_config" not in options
    assert options["max_ongoing_requests"] == 2 * cfg.engine.max_num_seqs
    assert replica_options(config("ray.max_ongoing_requests=5"), {})["max_ongoing_requests"] == 5


def test_min_below_max_is_an_autoscaling_config_with_the_configs_windows() -> None:
    windows = "upscale_delay_s=5 downscale_delay_s=60 metrics_interval_s=2 look_back_period_s=8"
    scaled = f"min_replicas=1 max_replicas=4 target_ongoing_requests=16 {windows}"
    options = replica_options(config(*(f"ray.{setting}" for setting in scaled.split())), {})
    scaling = options["autoscaling_config"]
    assert "num_replicas" not in options and scaling.target_ongoing_requests == 16
    assert (scaling.min_replicas, scaling.initial_replicas, scaling.max_replicas) == (1, 2, 4)
    assert (scaling.upscale_delay_s, scaling.downscale_delay_s) == (5, 60)
    assert (scaling.metrics_interval_s, scaling.look_back_period_s) == (2, 8)


GPU_MESH = ["mesh.model=2", "ray.replica_cpus=4"]
TPU_MESH = ["mesh.data=2", "mesh.model=2"]


@pytest.mark.parametrize(
    ("overrides", "cluster", "actor", "bundle"),
    [
        (GPU_MESH, {"CPU": 64, "GPU": 8}, {"num_cpus": 4.0, "num_gpus": 2}, {"CPU": 4.0, "GPU": 2}),
        (["ray.accelerator=gpu", *GPU_MESH], {}, {"num_cpus": 4.0, "num_gpus": 2}, {"CPU": 4.0, "GPU": 2}),
        (["ray.accelerator=tpu", *TPU_MESH], {}, {"num_cpus": 1.0, "resources": {"TPU": 4}}, {"CPU": 1.0, "TPU": 4}),
        (TPU_MESH, {"CPU": 8, "TPU": 4}, {"num_cpus": 1.0, "resources": {"TPU": 4}}, {"CPU": 1.0, "TPU": 4}),
        (["ray.accelerator=none", *GPU_MESH], {"GPU": 8}, {"num_cpus": 4.0}, None),
        (["ray.replica_cpus=3"], {"CPU": 16}, {"num_cpus": 3.0}, None),
    ],
    ids=["auto-gpu", "gpu", "tpu", "auto-tpu", "none", "auto-cpu"],
)
def test_a_replica_reserves_its_meshs_devices_on_one_node(
    overrides: list[str], cluster: dict[str, float], actor: dict[str, Any], bundle: dict[str, float] | None
) -> None:
    expected: dict[str, Any] = {"ray_actor_options": actor}
    if bundle is not None:
        expected |= {"placement_group_bundles": [bundle], "placement_group_strategy": "STRICT_PACK"}
    assert placement(config(*overrides), cluster) == expected


@pytest.mark.parametrize(("routing", "use_prefix"), [("prefix", True), ("least_loaded", False)])
def test_the_replicas_router_is_prefix_affinity_with_the_imbalance(routing: str, use_prefix: bool) -> None:
    router = replica_options(config(f"ray.routing={routing}", "ray.prefix_imbalance=3"), {})["request_router_config"]
    assert router.request_router_class == "myserve.ray.router:PrefixAffinityRouter" == ROUTER_PATH
    assert router.request_router_kwargs == {"imbalance": 3, "use_prefix": use_prefix}
    module, _, name = ROUTER_PATH.partition(":")
    assert getattr(importlib.import_module(module), name) is PrefixAffinityRouter
