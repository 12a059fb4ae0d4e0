"""The HTTP load generator: statistics, SSE parsing, the client on a mock transport, plots, and
``python -m myserve.bench --launch`` end to end against a tiny random model."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from myserve.bench.__main__ import main as bench_main
from myserve.bench.__main__ import redacted
from myserve.bench.launch import LaunchedServer, LaunchError, free_port
from myserve.bench.loadgen import LevelRun, RequestRecord, StreamError, StreamParser, Target, run_level
from myserve.bench.metrics import Stats, format_table, summarize
from myserve.bench.prompts import BUILTIN_PROMPTS, DatasetError, Prompt, builtin_prompts, load_prompts
from myserve.testing import TINY_ENGINE

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# A chat stream as myserve sends it: a role chunk with empty content, text chunks, a finish chunk
# with an empty delta, the usage chunk with no choices, then [DONE].
CHAT_STREAM = [
    'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant",'
    '"content":""}}]}',
    "",
    'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}]}',
    "",
    'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":null}]}',
    'data: {"id":"c1","choices":[{"index":0,"delta":{},"finish_reason":null}]}',
    'data: {"id":"c1","choices":[{"index":0,"delta":{"content":" world"},"finish_reason":"length"}]}',
    'data: {"id":"c1","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":5,"total_tokens":12}}',
    "data: [DONE]",
]


def feed(lines: list[str], times: list[float], start: float = 0.0) -> StreamParser:
    parser = StreamParser(start=start)
    for line, t in zip(lines, times, strict=True):
        parser.feed(line, t)
    return parser


def test_stats_percentiles_on_known_data() -> None:
    s = Stats.of(range(1, 101))
    assert s.mean == pytest.approx(50.5)
    assert (s.p50, s.p95, s.p99) == pytest.approx((50.5, 95.05, 99.01))  # linear interpolation
    assert Stats.of([0.002, 0.004], scale=1e3) == Stats(mean=3.0, p50=3.0, p95=3.9, p99=3.98)
    assert Stats.of([]) == Stats()


def test_summarize_throughput_tpot_and_errors() -> None:
    records = [
        RequestRecord(start=0.0, end=2.0, ttft_s=0.5, itl_s=(0.5, 1.0), prompt_tokens=10, output_tokens=4,
                      usage_reported=True, content_chunks=3),
        RequestRecord(start=1.0, end=4.0, ttft_s=1.0, itl_s=(2.0,), prompt_tokens=20, output_tokens=3,
                      usage_reported=True, content_chunks=2),
        RequestRecord(start=0.5, end=0.6, error="http_503", error_detail="not ready"),
        RequestRecord(start=0.5, end=0.7, error="http_503", error_detail="still not ready"),
    ]  # fmt: skip
    s = summarize(LevelRun(concurrency=2, records=records))
    assert (s.requests_ok, s.requests_failed, s.errors) == (2, 2, {"http_503": 2})
    assert s.error_samples == {"http_503": "not ready"}
    assert s.wall_s == 4.0 and s.output_tokens == 7 and s.prompt_tokens == 30
    assert s.output_tokens_per_s == pytest.approx(7 / 4) and s.total_tokens_per_s == pytest.approx(37 / 4)
    assert s.requests_per_s == pytest.approx(0.5)
    assert s.ttft_ms.mean == pytest.approx(750.0)
    assert s.itl_ms.p50 == pytest.approx(1000.0)  # gaps of every request pooled: 0.5, 1.0, 2.0
    assert s.tpot_ms.mean == pytest.approx(1e3 * ((2.0 - 0.5) / 3 + (3.0 - 1.0) / 2) / 2)
    assert s.e2e_s.p50 == pytest.approx(2.5)
    table = format_table([s.to_json()])
    assert "2/2" in table and "TTFT p50 ms" in table
    assert json.loads(json.dumps(s.to_json()))["ttft_ms"]["p99"] == pytest.approx(s.ttft_ms.p99)


def test_sse_chat_stream_with_usage() -> None:
    times = [0.1, 0.1, 0.3, 0.3, 0.4, 0.5, 0.7, 0.8, 0.8]
    record = feed(CHAT_STREAM, times).finish(0.9)
    assert record.ok and record.usage_reported
    assert record.ttft_s == pytest.approx(0.3)  # the role chunk carries no text
    assert record.itl_s == pytest.approx((0.1, 0.3))  # one gap per text chunk after the first
    assert (record.prompt_tokens, record.output_tokens, record.content_chunks) == (7, 5, 3)
    assert record.e2e_s == pytest.approx(0.9)


def test_sse_completion_stream_without_usage_counts_chunks() -> None:
    # llama-server style: no space after "data:", extra fields, an SSE comment; no usage was asked for.
    lines = [
        ": keep-alive",
        'data:{"choices":[{"index":0,"text":"Once","finish_reason":null}],"timings":{"predicted_n":1}}',
        'data:{"choices":[{"index":0,"text":" upon","finish_reason":null}]}',
        'data:{"choices":[{"index":0,"text":"","finish_reason":"stop"}]}',
    ]
    parser = feed(lines, [0.0, 0.2, 0.25, 0.3])
    assert not parser.done and parser.finished  # a finish_reason completes a stream without [DONE]
    record = parser.finish(0.3)
    assert record.ok and not record.usage_reported
    assert record.output_tokens == record.content_chunks == 2 and record.prompt_tokens is None


def test_sse_errors() -> None:
    parser = StreamParser(start=0.0)
    parser.feed(CHAT_STREAM[2], 0.1)
    with pytest.raises(StreamError) as e:
        parser.feed('data: {"error": {"message": "engine died", "code": "engine_error"}}', 0.2)
    assert e.value.kind == "stream_error" and "engine died" in str(e.value)
    with pytest.raises(StreamError) as e:
        StreamParser(start=0.0).feed("data: {not json", 0.1)
    assert e.value.kind == "bad_chunk"
    cut_short = feed(CHAT_STREAM[:3], [0.1, 0.1, 0.2]).finish(0.3)
    assert cut_short.error == "incomplete_stream" and not cut_short.ok


def test_run_level_on_a_mock_transport_limits_concurrency_and_records_errors() -> None:
    in_flight, peak, seen = 0, 0, []
    body = ("\n\n".join(CHAT_STREAM) + "\n\n").encode()

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, peak
        payload = json.loads(request.content)
        seen.append(payload)
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        if payload["messages"][0]["content"] == "fail":
            return httpx.Response(429, json={"error": {"message": "queue full"}})
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    async def go() -> LevelRun:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://mock") as client:
            bodies = [{"messages": [{"role": "user", "content": "fail" if i == 3 else "hi"}]} for i in range(8)]
            return await run_level(client, Target("http://mock/v1/chat/completions", {}, 10.0), bodies, 2)

    run = asyncio.run(go())
    assert peak == 2 and len(seen) == 8
    assert [r.error for r in run.records] == [None, None, None, "http_429", None, None, None, None]
    assert "queue full" in run.records[3].error_detail
    s = summarize(run)
    assert s.requests_ok == 7 and s.output_tokens == 35 and s.errors == {"http_429": 1}


def test_prompts_builtin_and_jsonl(tmp_path: Path) -> None:
    lengths = sorted(len(p) for p in BUILTIN_PROMPTS)
    assert lengths[0] < 60 and lengths[-1] > 1000  # short questions up to long-context tasks
    prompts = builtin_prompts(2 * len(BUILTIN_PROMPTS))
    assert len({p.prompt for p in prompts}) == len(prompts)  # repeats are tagged, never verbatim
    assert Prompt(prompt="hi").payload("chat") == {"messages": [{"role": "user", "content": "hi"}]}
    assert Prompt(prompt=[1, 2]).payload("completions") == {"prompt": [1, 2]}

    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "a"}\n\n{"messages": [{"role": "user", "content": "b"}]}\n')
    assert [p.payload("chat")["messages"][0]["content"] for p in load_prompts(str(good), 3, "chat")] == ["a", "b", "a"]
    with pytest.raises(DatasetError, match="prompt 2"):
        load_prompts(str(good), 2, "completions")  # messages cannot be sent to /v1/completions
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(DatasetError, match="bad.jsonl:2"):
        load_prompts(str(bad), 1, "chat")


def test_image_requests_distinct_or_shared() -> None:
    from myserve.bench.__main__ import parse_args
    from myserve.bench.images import with_images

    bodies = [{"model": "m", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(3)]
    distinct, same = with_images(bodies, "distinct", 32), with_images(bodies, "same", 32)
    assert with_images(bodies, "none", 32) == bodies
    for body in (*distinct, *same):
        image, text = body["messages"][0]["content"]
        assert image["type"] == "image_url" and image["image_url"]["url"].startswith("data:image/png;base64,")
        assert text == {"type": "text", "text": body["messages"][0]["content"][1]["text"]}
    urls = [[b["messages"][0]["content"][0]["image_url"]["url"] for b in bs] for bs in (distinct, same)]
    assert len(set(urls[0])) == 3 and len(set(urls[1])) == 1
    assert bodies[0]["messages"][0]["content"] == "q0"  # the originals are left as they were
    with pytest.raises(SystemExit):
        parse_args(["--images", "same", "--endpoint", "completions"])


def test_command_line_hides_the_api_key() -> None:
    assert redacted(["x", "--api-key", "sk-1", "--api-key=sk-2", "--model", "m"]) == [
        "x", "--api-key", "***", "--api-key=***", "--model", "m",
    ]  # fmt: skip


def _result_file(path: Path, label: str, scale: float) -> Path:
    def stats(v: float) -> dict[str, float]:
        return {"mean": v, "p50": v, "p95": 1.5 * v, "p99": 2 * v}

    results = [
        {"concurrency": c, "requests_ok": 8, "requests_failed": 0, "output_tokens_per_s": scale * c,
         "total_tokens_per_s": 2 * scale * c, "requests_per_s": c / 4, "ttft_ms": stats(10.0 * c),
         "itl_ms": stats(5.0 + c), "tpot_ms": stats(5.0 + c), "e2e_s": stats(1.0)}
        for c in (1, 4, 16)
    ]  # fmt: skip
    path.write_text(json.dumps({"label": label, "endpoint": "chat", "settings": {"max_tokens": 8}, "results": results}))
    return path


def test_plot_compares_two_result_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = _result_file(tmp_path / "a.json", "myserve", 10.0), _result_file(tmp_path / "b.json", "llama.cpp", 12.0)
    out = tmp_path / "cmp.png"
    assert bench_main(["plot", str(a), str(b), "--output", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    printed = capsys.readouterr().out
    assert "myserve" in printed and "llama.cpp" in printed


def test_exit_code_1_when_every_request_of_a_level_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    argv = ["--base-url", dead, "--model", "m", "--concurrency", "1,2", "--num-prompts", "2", "--warmup", "0"]
    assert bench_main([*argv, "--output", str(out)]) == 1
    assert "every request at concurrency 1 failed" in capsys.readouterr().err
    results = json.loads(out.read_text())["results"]
    assert [(r["requests_ok"], r["errors"]) for r in results] == [(0, {"connection": 2})] * 2


def test_launch_reports_a_server_that_dies_with_its_log() -> None:
    with pytest.raises(LaunchError, match="exited with code 2(.|\n)*invalid int value"):
        LaunchedServer(["--max-num-seqs", "many"], ready_timeout_s=60).start()


@pytest.mark.slow
def test_launch_benchmarks_a_tiny_model_and_stops_it(tiny_checkpoints, tmp_path: Path) -> None:
    from myserve.bundled import bundled_gguf_path

    # Tiny checkpoints have a 256-token vocabulary; digits and spaces encode to ids inside it, and a
    # template that renders only the contents keeps the chat endpoint's prompts inside it too.
    dataset = tmp_path / "digits.jsonl"
    lines = [{"prompt": " ".join(str(d % 10) for d in range(n))} for n in (3, 9, 20)]
    lines += [{"messages": [{"role": "user", "content": "4 2" * n}]} for n in (1, 5, 12)]
    dataset.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "r.json"
    png = tmp_path / "r.png"
    cmd = [
        sys.executable, "-m", "myserve.bench", "--launch", "--dataset", str(dataset),
        "--concurrency", "1,4", "--num-prompts", "6", "--max-tokens", "8", "--ignore-eos",
        "--output", str(out), "--plot", str(png), "--launch-timeout", "240",
        "--",
        "--hf-checkpoint", str(tiny_checkpoints["llama3"]), "--set", f"model.tokenizer={bundled_gguf_path()}",
        "--served-model-name", "tiny-llama", "--chat-template", "{% for m in messages %}{{ m['content'] }}{% endfor %}",
        # tiny_service's engine: the steps it built load from the step cache
        *(f"--set={s}" for s in (*TINY_ENGINE, "engine.num_pages=256")),
    ]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert time.monotonic() - t0 < 300

    doc = json.loads(out.read_text())
    for key in ("label", "base_url", "model", "endpoint", "command", "machine", "started_at", "settings"):
        assert doc[key], key
    assert doc["endpoint"] == "chat" and doc["model"] == doc["label"] == "tiny-llama"  # from /v1/models
    assert doc["settings"]["max_tokens"] == 8 and doc["settings"]["ignore_eos"] is True
    assert doc["command"][:4] == ["python", "-m", "myserve.bench", "--launch"] and doc["machine"]["cpu_count"]
    assert [r["concurrency"] for r in doc["results"]] == [1, 4]
    for r in doc["results"]:
        assert r["requests_ok"] == 6 and r["requests_failed"] == 0 and r["errors"] == {}
        assert r["usage_missing"] == 0 and r["output_tokens"] == 6 * 8  # ignore_eos: exactly max_tokens each
        assert r["output_tokens_per_s"] > 0 and r["total_tokens_per_s"] > r["output_tokens_per_s"]
        assert r["requests_per_s"] > 0 and r["wall_s"] > 0
        for name in ("ttft_ms", "tpot_ms", "e2e_s"):
            s = r[name]
            assert 0 <= s["p50"] <= s["p95"] <= s["p99"], (name, s)
        # The server coalesces a stream's tokens while its client lags (and K tokens come per call), so
        # on a loaded machine every stream's 8 tokens can arrive in one chunk: no gap, no ITL to report.
        itl = r["itl_ms"]
        assert itl["p50"] is None or 0 <= itl["p50"] <= itl["p95"] <= itl["p99"], itl
    assert "TTFT p50 ms" in proc.stdout and "tiny-llama" in proc.stdout
    assert png.read_bytes()[:8] == PNG_MAGIC

    url = urlparse(doc["base_url"])  # the launched server is gone: nothing listens on its port
    with pytest.raises(OSError), socket.create_connection((url.hostname, url.port), timeout=2):
        pass


def test_random_checkpoint_without_torch_loads_as_a_checkpoint(tmp_path: Path) -> None:
    """``myserve.bench.random_checkpoint`` writes a servable checkpoint (tokenizer included) with
    numpy only: torch is never imported."""
    directory = tmp_path / "tiny-llama"
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from myserve.bench.random_checkpoint import make_random_llama\n"
        f"make_random_llama('tiny-llama', Path({str(directory)!r}), dtype='bfloat16')\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    from myserve.models.checkpoint import resolve_checkpoint
    from myserve.models.loading import open_source
    from myserve.tokenizer import Tokenizer

    spec = open_source(resolve_checkpoint(str(directory))).spec
    assert (spec.num_layers, spec.hidden_size, spec.vocab_size, spec.tie_word_embeddings) == (2, 64, 49152, True)
    tokenizer = Tokenizer.load(directory)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids and tokenizer.decode(tokenizer.encode("Hello world")) == "Hello world"


def test_engine_bench_random_prompts_are_seeded_and_in_the_vocabulary() -> None:
    from myserve.bench.engine import random_prompts

    prompts = random_prompts(300, 3, 4096)
    assert [len(p) for p in prompts] == [4096] * 3
    assert all(0 <= t < 300 for p in prompts for t in p)
    assert prompts == random_prompts(300, 3, 4096) and prompts[0] != prompts[1]


@pytest.mark.parametrize(
    "shape, layers, hidden, experts",
    [("tiny-llama-16", 16, 64, 0), ("tiny-moe", 2, 64, 8)],
)
def test_random_checkpoint_small_shapes(tmp_path: Path, shape: str, layers: int, hidden: int, experts: int) -> None:
    """The 16-layer yardstick is the 2-layer one with 16 layers; the tiny MoE has experts: both load
    as checkpoints of their shape."""
    from myserve.bench.random_checkpoint import make_random_llama, parameter_counts
    from myserve.models.checkpoint import resolve_checkpoint
    from myserve.models.loading import open_source

    spec = open_source(resolve_checkpoint(str(make_random_llama(shape, tmp_path / shape)))).spec
    assert (spec.num_layers, spec.hidden_size, spec.vocab_size, spec.num_experts) == (layers, hidden, 49152, experts)
    total, active = parameter_counts(shape)
    assert (total == active) == (experts == 0)
    assert parameter_counts("llama-3.1-8b") == (8030261248, 8030261248)  # Llama-3.1-8B's published count
