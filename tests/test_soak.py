"""The soak benchmark's pure logic, without a server (milliseconds): metrics parsing, RSS reading,
the checks and the summary, every scenario's request, and judging answers on a mock transport."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time

import httpx
import pytest

from myserve.bench.soak_checks import IDLE_GAUGES, Tally, core_pid, evaluate, format_summary, parse_metrics, rss_kb
from myserve.bench.soak_requests import CHAT, COMPLETIONS, WEIGHTS, Req, build, exchange

METRICS = """# HELP myserve_kv_pages_used KV cache pages referenced
# TYPE myserve_kv_pages_used gauge
myserve_kv_pages_used 0.0
myserve_requests_total{endpoint="chat",status="ok"} 12.0
myserve_grammar_matchers_active 2.0
"""
IDLE = dict.fromkeys(IDLE_GAUGES, 0.0)
RSS = {"front end": (100_000, 104_000), "core": (500_000, 510_000)}


def test_parse_metrics() -> None:
    figures = parse_metrics(METRICS)
    assert figures == {
        "myserve_kv_pages_used": 0.0,
        'myserve_requests_total{endpoint="chat",status="ok"}': 12.0,
        "myserve_grammar_matchers_active": 2.0,
    }


def test_rss_of_this_process_and_of_none() -> None:
    assert (rss_kb(os.getpid()) or 0) > 1000
    assert rss_kb(-1) is None


# A front end's stand-in: spawns one child the way EngineClient starts the core, prints its pid.
SPAWNING = """
import multiprocessing, time
child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
child.start()
print(child.pid, flush=True)
child.join()
"""


def test_the_core_is_the_spawned_child_of_its_front_end() -> None:
    # Not this process: the test session may hold engine cores of its own.
    front = subprocess.Popen([sys.executable, "-c", SPAWNING], stdout=subprocess.PIPE, text=True)
    leaf = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert front.stdout is not None
        child = int(front.stdout.readline())
        # Its command line names spawn_main once the child has exec'd (not yet, on a loaded machine,
        # when its pid is printed: the suite failed so once).
        deadline = time.monotonic() + 30
        while core_pid(front.pid) != child and time.monotonic() < deadline:
            time.sleep(0.05)
        assert core_pid(front.pid) == child
        assert core_pid(leaf.pid) is None  # no spawned child
        os.kill(child, signal.SIGKILL)
    finally:
        for proc in (front, leaf):
            proc.kill()
            proc.wait()


def clean_tally() -> Tally:
    tally = Tally()
    tally.add("chat", "ok", tokens=30)
    tally.add("burst", "429", "1")
    tally.add("tool", "disconnected")
    return tally


def failed(checks) -> list[str]:
    return [c.name for c in checks if not c.ok]


def test_a_clean_run_passes() -> None:
    checks = evaluate(clean_tally(), IDLE, True, "fine", RSS, 0.05, bursts=True)
    assert failed(checks) == [] and len(checks) == len(IDLE_GAUGES) + 7


def test_each_problem_fails_its_check() -> None:
    tally = clean_tally()
    tally.add("regex", "5xx", "500 engine_error")
    tally.add("long", "incomplete", "the stream ended before [DONE]")
    tally.missing_retry_after = 1
    idle = {**IDLE, "myserve_grammar_matchers_active": 1.0}
    del idle["myserve_penalty_slots_used"]  # an older server without the gauge
    rss = {"front end": (100_000, 106_000), "core": (None, 510_000)}
    checks = evaluate(tally, idle, False, "/health: HTTP 503", rss, 0.05, bursts=True)
    assert failed(checks) == [
        "idle: grammar matchers alive = 0",
        "idle: penalty slots owned = 0",
        "no 5xx at any time",
        "no other failed request",
        "every 429 had Retry-After",
        "server healthy at the end",
        "front end RSS within 5%",
        "core RSS within 5%",
    ]
    assert {c.name: c.detail for c in checks}["no other failed request"] == "incomplete x1"
    # Memory that shrinks is no leak; bursts that never reach the queue limit fail; probes' 5xx count.
    quiet = Tally()
    quiet.add("chat", "ok")
    quiet.other_5xx = 1
    checks = evaluate(quiet, IDLE, True, "", {"core": (500_000, 400_000)}, 0.05, bursts=True)
    assert failed(checks) == ["no 5xx at any time", "bursts went over the queue limit (429)"]
    assert failed(evaluate(quiet, None, True, "", {}, 0.05, bursts=False))[0] == "idle: requests running = 0"


def test_summary_lists_outcomes_rss_gauges_and_checks() -> None:
    tally = clean_tally()
    tally.add("regex", "bad_output", "breaks its grammar")
    checks = evaluate(tally, IDLE, True, "fine", RSS, 0.05, bursts=True)
    rss = {"core": (500_000, 520_000, 510_000)}
    text = format_summary(tally, 10.0, rss, IDLE, {"myserve_kv_pages_used": 40}, checks)
    assert "generated 30 tokens in 10 s of traffic: 3.0 tokens/s" in text
    assert "488.3 MiB" in text and "+2.0%" in text
    assert "first regex/bad_output: breaks its grammar" in text
    assert "FAIL  no other failed request: bad_output x1" in text
    all_row = next(line for line in text.splitlines() if line.startswith("all "))
    assert all_row.split() == ["all", "1", "1", "1", "1", "4"]


@pytest.mark.parametrize("scenario", [*WEIGHTS, "burst"])
def test_every_scenario_builds_a_request(scenario: str) -> None:
    for seed in range(6):
        req = build(scenario, random.Random(seed), "m", "long text")
        assert req.path == (CHAT if "messages" in req.body else COMPLETIONS)
        assert req.body["model"] == "m" and req.body["max_tokens"] >= 2
        assert not req.body.get("stream_options") or req.body["stream"]


def judge(req: Req, handler, hang_after: int | None = None) -> tuple[str, str, int]:
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await exchange(client, "http://x", req, hang_after)

    return asyncio.run(go())


def sse(*events) -> httpx.Response:
    body = "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events)
    return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})


def test_answers_are_judged() -> None:
    rng = random.Random(0)
    regex = build("regex", rng, "m", "")
    regex = Req(regex.scenario, regex.path, {**regex.body, "stream": False}, regex.check)
    answer = {"choices": [{"index": 0, "text": "555-1234", "finish_reason": "stop"}], "usage": {"completion_tokens": 7}}
    assert judge(regex, lambda r: httpx.Response(200, json=answer)) == ("ok", "", 7)
    answer["choices"][0]["text"] = "555-12345"
    assert judge(regex, lambda r: httpx.Response(200, json=answer))[0] == "bad_output"
    answer["choices"][0]["finish_reason"] = "length"  # cut off: not a finished match, not checked
    assert judge(regex, lambda r: httpx.Response(200, json=answer))[0] == "ok"
    assert judge(regex, lambda r: httpx.Response(429, headers={"Retry-After": "1"})) == ("429", "1", 0)
    assert judge(regex, lambda r: httpx.Response(429))[:2] == ("429", "")
    assert judge(regex, lambda r: httpx.Response(503, text="draining"))[:2] == ("5xx", "503 draining")
    assert judge(regex, lambda r: httpx.Response(400, text="bad"))[0] == "4xx"


def test_streams_are_judged() -> None:
    tool = build("tool", random.Random(1), "m", "")
    tool = Req(tool.scenario, tool.path, {**tool.body, "stream": True}, tool.check)
    call = {"index": 0, "id": "call_1", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", '}}
    rest = {"index": 0, "function": {"arguments": '"unit": "celsius"}'}}
    events = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [rest]}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"completion_tokens": 9}},
    ]
    assert judge(tool, lambda r: sse(*events, "[DONE]")) == ("ok", "", 9)
    assert judge(tool, lambda r: sse(*events))[0] == "incomplete"  # no [DONE]
    assert judge(tool, lambda r: sse(*events[:2], "[DONE]"))[0] == "incomplete"  # no finish reason
    assert judge(tool, lambda r: sse(events[0], {"error": {"message": "engine error"}}))[0] == "stream_error"
    assert judge(tool, lambda r: sse(*events, "[DONE]"), hang_after=2) == ("disconnected", "", 0)
    broken = {"index": 0, "function": {"arguments": '"unit": "celsius"'}}  # no closing brace
    events[2]["choices"][0]["delta"] = {"tool_calls": [broken]}
    assert judge(tool, lambda r: sse(*events, "[DONE]"))[0] == "bad_output"
