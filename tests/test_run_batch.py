"""``python -m myserve.run_batch``: Batch API lines through the real app, in order, resumable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from myserve.config import load_config
from myserve.entrypoints import run_batch
from myserve.frontend.app import create_app
from myserve.testing import TINY_ENGINE

MODEL = "tiny"
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
"""The tiny model's vocabulary is 256 tokens: a chat is its messages' single letters (ids 65-90)."""


def request(custom_id: str, url: str, **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": MODEL, **body}})


def chat(custom_id: str, text: str = "a", **kw) -> str:
    return request(custom_id, "/v1/chat/completions", messages=[{"role": "user", "content": text}], **kw)


def completion(custom_id: str, prompt: str | list[int] = [40, 41, 42], **kw) -> str:  # noqa: B006
    return request(custom_id, "/v1/completions", prompt=prompt, **kw)


MIXED = [
    chat("chat-1", max_tokens=6, temperature=0),
    completion("cmpl-1", max_tokens=5, temperature=0),
    request("emb-1", "/v1/embeddings", input="hello"),  # a generation-only model: the server's 400
    "{not json",
    completion("cmpl-2", max_tokens=-1),  # the server's 400
    "[1, 2, 3]",
    json.dumps({"method": "POST", "url": "/v1/completions", "body": {"model": MODEL, "prompt": "x"}}),
    "",  # a blank line is not a request
    chat("chat-2", "b", max_tokens=7, temperature=0.8, seed=3, n=2),
    json.dumps({"custom_id": "no-body", "method": "POST", "url": "/v1/completions"}),
    completion("wrong-model", model="gpt-4o", max_tokens=3),
    completion("streamed", max_tokens=3, stream=True),
    completion("cmpl-3", prompt=[50, 51], max_tokens=4, temperature=0),
]
EXPECTED = [  # custom_id, status (None: the line's error object), error code
    ("chat-1", 200, None),
    ("cmpl-1", 200, None),
    ("emb-1", 400, None),
    (None, None, "invalid_json"),
    ("cmpl-2", 400, None),
    (None, None, "invalid_request"),
    (None, None, "missing_custom_id"),
    ("chat-2", 200, None),
    ("no-body", None, "invalid_body"),
    ("wrong-model", 404, None),
    ("streamed", None, "invalid_body"),
    ("cmpl-3", 200, None),
]


@pytest.fixture(scope="module")
def app(tiny_service):
    return create_app(tiny_service, served_model_name=MODEL, chat_template=TEMPLATE)


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def lines_of(path: Path) -> list[str]:
    """The file's lines split at "\\n" only, each with its newline (a cut last line without).
    Not ``str.splitlines``: a result written with ``ensure_ascii=False`` may hold U+2028 or U+0085
    (JSON leaves them unescaped), which it would take for line ends."""
    text = path.read_text()
    *whole, cut = text.split("\n")
    return [part + "\n" for part in whole] + ([cut] if cut else [])


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in lines_of(path)]


def test_mixed_file_one_result_per_line_in_order(app, tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    summary = run_batch.run_file(app, write(tmp_path / "in.jsonl", MIXED), out, concurrency=4)
    results = read(out)
    assert [(r["custom_id"], r["response"] and r["response"]["status_code"], r["error"] and r["error"]["code"])
            for r in results] == EXPECTED  # fmt: skip
    assert (summary.total, summary.done, summary.failed, summary.skipped) == (12, 12, 8, 0)
    assert len({r["id"] for r in results}) == 12 and all(r["id"].startswith("batch_req_") for r in results)
    by_id = {r["custom_id"]: r["response"] for r in results if r["response"]}
    chat_1, chat_2, cmpl_1 = by_id["chat-1"]["body"], by_id["chat-2"]["body"], by_id["cmpl-1"]["body"]
    assert chat_1["object"] == "chat.completion" and chat_1["model"] == MODEL
    assert by_id["chat-1"]["request_id"] == chat_1["id"] and chat_1["id"].startswith("chatcmpl-")
    assert 1 <= chat_1["usage"]["completion_tokens"] <= 6 and len(chat_2["choices"]) == 2
    assert cmpl_1["object"] == "text_completion" and cmpl_1["usage"]["completion_tokens"] <= 5
    # Failed requests carry the server's own OpenAI-shaped error body.
    assert by_id["emb-1"]["body"]["error"]["code"] == "model_not_supported"
    assert by_id["cmpl-2"]["body"]["error"]["param"] == "max_tokens"
    assert by_id["wrong-model"]["body"]["error"]["code"] == "model_not_found"
    usage = [r["response"]["body"].get("usage", {}) for r in results if r["response"]]
    assert summary.completion_tokens == sum(u.get("completion_tokens", 0) for u in usage) > 0
    # The same greedy request sent alone gives the same text.
    alone = tmp_path / "alone.jsonl"
    run_batch.run_file(app, write(tmp_path / "one.jsonl", [MIXED[1]]), alone, concurrency=1)
    assert read(alone)[0]["response"]["body"]["choices"][0]["text"] == cmpl_1["choices"][0]["text"]


def test_concurrency_fills_the_engine(app, tiny_service, tmp_path: Path) -> None:
    lines = [completion(f"c{i}", prompt=[30 + i, 31, 32], max_tokens=24, ignore_eos=True) for i in range(40)]
    seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.005):
            seen.append(tiny_service.stats().running)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        config = load_config(None, [*TINY_ENGINE, "engine.num_pages=256"])  # tiny_service's
        concurrency = run_batch.default_concurrency(config)
        out = tmp_path / "out.jsonl"
        run_batch.run_file(app, write(tmp_path / "in.jsonl", lines), out, concurrency=concurrency)
    finally:
        stop.set()
        watcher.join()
    assert concurrency == 2 * config.engine.max_num_seqs == 16
    assert max(seen) == config.engine.max_num_seqs  # every sequence slot was busy
    results = read(out)
    assert [r["custom_id"] for r in results] == [f"c{i}" for i in range(40)]
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 24 for r in results)


def test_resume_skips_the_lines_already_written(app, tiny_service, tmp_path: Path, monkeypatch) -> None:
    lines = [completion(f"r{i}", prompt=[100 + i, 7], max_tokens=4, temperature=0) for i in range(10)]
    lines[3] = "garbage"
    inp = write(tmp_path / "in.jsonl", lines)
    full = tmp_path / "full.jsonl"
    run_batch.run_file(app, inp, full, concurrency=8)
    done = lines_of(full)
    out = tmp_path / "out.jsonl"
    # Killed while writing line 7: six whole lines and a piece of the seventh.
    out.write_text("".join(done[:6]) + done[6][:25])
    submitted: list[str] = []
    submit = tiny_service.submit

    def counting(prompt_ids, params, request_id=None):
        submitted.append(request_id)
        return submit(prompt_ids, params, request_id)

    monkeypatch.setattr(tiny_service, "submit", counting)
    summary = run_batch.run_file(app, inp, out, concurrency=8)
    assert len(submitted) == 4 and (summary.skipped, summary.done) == (6, 4)  # lines 7-10, once each
    again = lines_of(out)
    assert again[:6] == done[:6]  # untouched
    assert [r["custom_id"] for r in read(out)] == [r["custom_id"] for r in read(full)]
    # Finished: a rerun sends nothing.
    assert run_batch.run_file(app, inp, out, concurrency=8).done == 0 and len(submitted) == 4


def test_an_output_of_another_file_is_refused(tmp_path: Path) -> None:
    lines = run_batch.read_input(write(tmp_path / "in.jsonl", [completion("a"), completion("b")]))
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"custom_id": "b", "response": None, "error": None}) + "\n")
    with pytest.raises(run_batch.BatchFileError, match="line 1 is not the result of request line 1"):
        run_batch.resume_point(out, lines)
    out.write_text("".join(json.dumps({"custom_id": c}) + "\n" for c in "abc"))
    with pytest.raises(run_batch.BatchFileError):
        run_batch.resume_point(out, lines)  # more results than requests
    out.write_text(json.dumps({"custom_id": "a"}) + "\n" + '{"custom_id": "b", "resp')
    assert run_batch.resume_point(out, lines) == 1 and out.read_text().count("\n") == 1


KILL_TOKENS = 48
"""Tokens per generated line of the killed run: long enough that the kill lands halfway."""
"""Lines of the file the CLI test kills halfway: enough that the tiny model is still busy."""


@pytest.mark.slow
def test_cli_killed_halfway_resumes(tiny_checkpoints, tmp_path: Path) -> None:
    """The real command (engine core in its own process, as serve runs it) on 200 lines mixing chat,
    completions, embeddings and 3 malformed lines, SIGKILLed while it writes, then run again: the
    lines written before the kill stay as they were and the rest follow, 200 results in order."""
    from myserve.bundled import bundled_gguf_path

    checkpoint = tiny_checkpoints["llama3"]
    tale = {"max_tokens": KILL_TOKENS, "ignore_eos": True}
    kinds = [
        lambda i: ("/v1/chat/completions", {"messages": [{"role": "user", "content": chr(65 + i % 26)}], **tale}),
        lambda i: ("/v1/completions", {"prompt": [i % 200 + 3, 4], **tale}),
        lambda i: ("/v1/embeddings", {"input": [i % 200 + 3, 5, 6]}),
    ]
    bodies = [kinds[i % 3](i) for i in range(197)]
    lines = [
        json.dumps({"custom_id": f"q{i}", "method": "POST", "url": url, "body": {"model": MODEL, **body}})
        for i, (url, body) in enumerate(bodies)
    ]
    malformed = {1: "oops", 100: "[1, 2, 3]", 150: json.dumps({"url": "/v1/completions", "body": {}})}
    for at, text in malformed.items():
        lines.insert(at, text)
    assert len(lines) == 200
    inp, out = write(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    sets = [f"model.chat_template={tmp_path / 'chat.jinja'}", f"model.tokenizer={bundled_gguf_path()}"]
    sets += ["model.dtype=float32", "engine.num_pages=256", "model.task=generate+embed", *TINY_ENGINE]
    cmd = [sys.executable, "-m", "myserve.run_batch", "-i", str(inp), "-o", str(out)]
    cmd += ["--hf-checkpoint", str(checkpoint), "--served-model-name", MODEL]
    cmd += [arg for s in sets for arg in ("--set", s)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}

    log = tmp_path / "first.log"
    with open(log, "w") as f:
        first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f, env=env)
    deadline = time.monotonic() + 300
    while not (out.exists() and out.read_text().count("\n") >= 50):
        assert first.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "no output after 300 s"
        time.sleep(0.02)
    first.kill()
    first.wait(timeout=30)
    kept = lines_of(out)
    kept = kept if kept[-1].endswith("\n") else kept[:-1]  # a line cut by the kill is redone
    assert 50 <= len(kept) < len(lines), "the run was not killed halfway"

    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert lines_of(out)[: len(kept)] == kept  # not redone
    results = read(out)
    ids = [f"q{i}" for i in range(len(bodies))]
    for at in malformed:
        ids.insert(at, None)
    assert len(results) == 200 and [r["custom_id"] for r in results] == ids
    assert [r["error"]["code"] for r in results if r["error"]] == [
        "invalid_json",
        "invalid_request",
        "missing_custom_id",
    ]
    answered = [r["response"] for r in results if r["response"]]
    assert len(answered) == 197 and all(r["status_code"] == 200 for r in answered)
    bodies_out = [r["body"] for r in answered]
    assert all(len(b["data"][0]["embedding"]) == 64 for b in bodies_out[2::3])  # the tiny model's width
    assert all(b["usage"]["completion_tokens"] == KILL_TOKENS for i, b in enumerate(bodies_out) if i % 3 != 2)
    done = len(lines) - len(kept)
    assert "tok/s" in proc.stderr and f"{done} lines done" in proc.stderr
    assert f"{len(kept)} already in the output" in proc.stderr
    # Everything is done: a rerun loads nothing and changes nothing.
    before = out.read_text()
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert again.returncode == 0 and "already have results" in again.stderr and out.read_text() == before
    bad = subprocess.run([*cmd[:3], "-i", str(tmp_path / "none.jsonl"), "-o", str(out)], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("error: cannot read")


def test_overloaded_lines_are_retried_and_a_dead_engine_stops_the_run(tmp_path: Path) -> None:
    """On a stand-in app (no model): a 429 is sent again; once the engine is dead nothing more is
    written, and a rerun starts after the lines that were."""

    class Engine:
        dead: BaseException | None = None

    engine, seen = Engine(), []
    app = FastAPI()
    app.state.context = type("Context", (), {"engine": engine})()

    @app.post("/v1/completions")
    async def complete(request: Request):  # noqa: ANN202
        prompt = (await request.json())["prompt"]
        seen.append(prompt)
        if prompt == "busy" and seen.count("busy") == 1:
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=429)
        if prompt == "die" and engine.dead is None and seen.count("die") == 1:
            engine.dead = RuntimeError("boom")
            return JSONResponse({"error": {"message": "boom", "code": "engine_error"}}, status_code=500)
        return {"id": f"cmpl-{prompt}", "usage": {"prompt_tokens": 1, "completion_tokens": 2}}

    inp = write(tmp_path / "in.jsonl", [completion(f"l{i}", prompt=p) for i, p in enumerate(["a", "busy", "die", "b"])])
    out = tmp_path / "out.jsonl"
    with pytest.raises(BaseExceptionGroup) as caught:
        run_batch.run_file(app, inp, out, concurrency=1)
    assert caught.group_contains(run_batch.EngineDied)
    assert [r["response"]["request_id"] for r in read(out)] == ["cmpl-a", "cmpl-busy"]
    assert seen == ["a", "busy", "busy", "die"]
    engine.dead = None  # a restarted engine
    summary = run_batch.run_file(app, inp, out, concurrency=1)
    assert (summary.skipped, summary.done, summary.failed) == (2, 2, 0)
    assert [r["response"]["request_id"] for r in read(out)] == ["cmpl-a", "cmpl-busy", "cmpl-die", "cmpl-b"]
