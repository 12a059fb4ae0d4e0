"""Sleep mode (``--enable-sleep-mode``; ``core/engine_sleep.py``, ``runtime/device_sleep.py``).

On the fake device (host logic): a sleep waits for the requests held and refuses new ones from the
moment it is asked; a wake-up before it fell asleep cancels it. On the tiny Llama: levels 1 and 2
give back the device's weights and KV cache and, woken, the same greedy tokens with nothing
compiled; under 8 looping clients, sleep/wake cycles lose no admitted request (the others are
refused and retried); level 2 composes with a weight update while asleep. Over HTTP: the routes,
their opt-in, the 503 while asleep."""

from __future__ import annotations

import asyncio
import threading

import httpx
import jax
import pytest
from test_server import LiveServer

from myserve.frontend.app import create_app
from myserve.runtime.compile_counter import compile_count
from myserve.testing import TINY_ENGINE, FakeCore, collect, make_tiny_checkpoint, start_client, start_service
from myserve.wire.outputs import EngineSleeping
from myserve.wire.params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [100, 3, 100, 3, 9]]


class RecordingSleeper:
    """A sleeper that records what the engine asked of it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def sleep(self, level: int) -> dict[str, int]:
        self.calls.append(("sleep", level))
        return {"device_bytes_before": 100, "device_bytes_after": 1}

    def wake_up(self, paths: dict[int, str | None]) -> dict[str, int]:
        self.calls.append(("wake_up", paths))
        return {"device_bytes_after": 100}


def told() -> tuple[list[tuple[str | None, dict]], object]:
    answers: list[tuple[str | None, dict]] = []
    return answers, lambda error, state: answers.append((error, dict(state)))


def test_a_sleep_waits_for_the_requests_held_and_refuses_new_ones() -> None:
    e = FakeCore(max_num_seqs=4)
    sleeper = RecordingSleeper()
    e.core.sleeper = sleeper
    e.submit([5, 6, 7], SamplingParams(max_tokens=20, temperature=1.0, seed=1), "held")
    e.step()
    answers, done = told()
    e.core.request_sleep(2, done)
    with pytest.raises(EngineSleeping, match="POST /wake_up"):
        e.submit([8, 9], SamplingParams(max_tokens=4), "late")
    e.step()
    assert not sleeper.calls and not answers  # "held" still runs
    e.run()
    tokens, finish = e.finished("held")[0]
    assert len(tokens) == 20 and finish == "length"  # it finished, whole
    assert sleeper.calls == [("sleep", 2)] and answers[0][0] is None
    assert answers[0][1]["is_sleeping"] and answers[0][1]["level"] == 2
    alloc = e.scheduler.allocator
    assert alloc.num_used == 0 and alloc.num_free == alloc.num_pages  # the prefix cache forgotten too
    again, done_again = told()
    e.core.request_sleep(1, done_again)  # asleep already: answered at once
    e.core.drain_inbox()
    assert again == [(None, answers[0][1])] and len(sleeper.calls) == 1
    woke, done_wake = told()
    e.core.request_wake_up(done_wake)
    e.core.drain_inbox()
    assert sleeper.calls[-1] == ("wake_up", {0: None}) and woke[0][0] is None and not woke[0][1]["is_sleeping"]
    e.submit([8, 9], SamplingParams(max_tokens=4, temperature=1.0, seed=2), "after")
    e.run()
    assert len(e.finished("after")[0][0]) == 4


def test_a_wake_up_before_the_engine_fell_asleep_cancels_the_sleep() -> None:
    e = FakeCore()
    e.core.sleeper = RecordingSleeper()
    e.submit([5, 6, 7], SamplingParams(max_tokens=10, temperature=1.0, seed=1), "held")
    e.step()
    slept, done_sleep = told()
    woke, done_wake = told()
    e.core.request_sleep(1, done_sleep)
    e.core.request_wake_up(done_wake)
    e.run()
    assert slept[0][0] == "cancelled by a wake_up before the engine fell asleep"
    assert woke == [(None, {"is_sleeping": False, "level": 0})] and e.core.sleeper.calls == []
    e.submit([8], SamplingParams(max_tokens=2, temperature=1.0, seed=2), "after")  # admitted again


def test_without_sleep_mode_or_with_a_bad_level_the_sleep_is_refused() -> None:
    e = FakeCore()
    answers, done = told()
    e.core.request_sleep(1, done)
    e.core.drain_inbox()
    assert answers[0][0] == "this server was started without --enable-sleep-mode"
    e.submit([5], SamplingParams(max_tokens=1), "still served")  # nothing was refused
    e.core.sleeper = RecordingSleeper()
    e.core.request_sleep(3, done)
    e.core.drain_inbox()
    assert answers[1][0] == "level must be 1 or 2, got 3" and not answers[1][1]["is_sleeping"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("sleep")
    return make_tiny_checkpoint("llama3", root / "a", seed=0), make_tiny_checkpoint("llama3", root / "b", seed=1)


@pytest.fixture(scope="module")
def service(checkpoints):
    svc = start_service(
        checkpoints[0], *TINY_ENGINE, "engine.num_pages=128", "engine.enable_sleep_mode=true",
        "engine.enable_weight_updates=true",
    )  # fmt: skip
    assert svc.replicas[0].runner.device.background_builds_done(600)
    yield svc
    svc.shutdown()


def greedy(svc) -> list[list[int]]:
    return [collect(svc.submit(p, GREEDY))[0] for p in PROMPTS]


@pytest.mark.parametrize("level", [1, 2])
def test_a_sleep_frees_the_device_and_the_woken_engine_serves_the_same_tokens(service, level: int) -> None:
    before = greedy(service)
    compiled = compile_count()
    executor = service.replicas[0].runner.device
    held = sum(x.nbytes for x in jax.tree.leaves((executor.weight_slots[0][0], executor.kv_cache)))
    error, state = asyncio.run(service.sleep(level))
    assert error is None and state["is_sleeping"] and state["level"] == level
    # The weights and the KV cache left the device (what stays: the penalty state, a few small arrays).
    assert state["device_bytes_before"] - state["device_bytes_after"] >= held, (state, held)
    with pytest.raises(EngineSleeping):
        service.submit(PROMPTS[0], GREEDY)
    error, state = asyncio.run(service.wake_up())
    assert error is None and not state["is_sleeping"]
    assert greedy(service) == before
    assert compile_count() == compiled  # nothing compiled: sleep, wake-up, the requests after


def test_sleep_wake_cycles_under_8_looping_clients_lose_no_admitted_request(service) -> None:
    stop = threading.Event()
    done: list[list[int]] = []
    refused = [0]
    lock = threading.Lock()

    def client(i: int) -> None:
        while not stop.is_set():
            try:
                stream = service.submit(PROMPTS[i % len(PROMPTS)], GREEDY)
            except EngineSleeping:
                with lock:
                    refused[0] += 1
                stop.wait(0.01)
                continue
            tokens, _, finish = collect(stream)
            with lock:
                done.append(tokens)
            assert finish == "length"

    reference = greedy(service)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for level in (1, 2, 1):
        assert asyncio.run(service.sleep(level))[0] is None
        assert asyncio.run(service.wake_up())[0] is None
    stop.set()
    for t in threads:
        t.join(60)
    assert done and refused[0] > 0
    # Every admitted request finished whole, with the tokens of an engine that never slept.
    assert all(tokens in reference for tokens in done)


def test_level_2_then_a_weight_update_then_wake_up_serves_the_new_weights(service, checkpoints) -> None:
    plain_b = start_service(checkpoints[1], *TINY_ENGINE, "engine.num_pages=128")
    try:
        want = greedy(plain_b)
    finally:
        assert plain_b.replicas[0].runner.device.background_builds_done(600)
        plain_b.shutdown()
    assert asyncio.run(service.sleep(2))[0] is None
    error, version = asyncio.run(service.update_weights(str(checkpoints[1]), "b", "finish"))
    assert error is None and version["version"] == "b"
    assert asyncio.run(service.wake_up())[0] is None
    assert greedy(service) == want
    # And back to A the same way, so the module's other tests see A.
    assert asyncio.run(service.sleep(1))[0] is None
    assert asyncio.run(service.update_weights(str(checkpoints[0]), "a", "finish"))[0] is None
    assert asyncio.run(service.wake_up())[0] is None


@pytest.mark.parametrize("where", ["in_process", "core_process"])
def test_the_routes_their_opt_in_and_the_503_while_asleep(service, tiny_service, checkpoints, where: str) -> None:
    """The routes over the in-process engine and over an engine core in its own process (the
    sleep and its answer cross the wire)."""
    engine = service
    if where == "core_process":
        engine = start_client(checkpoints[0], *TINY_ENGINE, "engine.num_pages=128", "engine.enable_sleep_mode=true")
    live = LiveServer(create_app(engine, served_model_name="tiny", sleep_mode=True))
    closed = LiveServer(create_app(tiny_service, served_model_name="tiny"))  # not opted in: no such routes
    try:
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
        assert httpx.get(f"{live.url}/is_sleeping").json() == {"is_sleeping": False}
        slept = httpx.post(f"{live.url}/sleep", params={"level": 1}, timeout=60)
        assert slept.status_code == 200 and slept.json()["is_sleeping"] and slept.json()["level"] == 1
        assert httpx.get(f"{live.url}/is_sleeping").json() == {"is_sleeping": True}
        refused = httpx.post(f"{live.url}/v1/completions", json=body)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "engine_sleeping"
        assert httpx.post(f"{live.url}/sleep", params={"level": 3}).status_code == 400
        woke = httpx.post(f"{live.url}/wake_up", timeout=60)
        assert woke.status_code == 200 and woke.json()["is_sleeping"] is False
        assert httpx.post(f"{live.url}/v1/completions", json=body).json()["usage"]["completion_tokens"] == 3
        assert httpx.post(f"{closed.url}/sleep").status_code == 404
    finally:
        live.stop()
        closed.stop()
        if engine is not service:
            engine.shutdown()
