"""``python -m myserve.run_batch -i requests.jsonl -o results.jsonl``: an OpenAI Batch API file, offline.

Each input line is a request in the Batch API's format, ``{"custom_id", "method", "url", "body"}``;
each output line, in input order, is its result: ``{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error": null}``, the body being exactly what the server would have answered
(errors included, e.g. a 400 for an invalid field), or ``"response": null`` and ``"error": {"code",
"message"}`` for a line that is not a request at all (not JSON, no ``custom_id``, no ``url``...).

No HTTP socket: every line's body goes through the server's own app in this process (the ASGI
interface), with the engine loaded as ``serve`` loads it (``--config``, ``--hf-checkpoint``, ``--set``
and serve's model flags), many requests in flight at once so that the engine's batch stays full.
Each result is written and flushed as soon as the lines before it are: an interrupted run is resumed
by running the same command again (the lines already in the output are kept and skipped).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys
import time
import uuid
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from myserve.entrypoints.hub import fetch_checkpoints
from myserve.entrypoints.serve import add_config_flags, config_from_args, load_engine, served_model_names
from myserve.errors import ConfigError, MyserveError
from myserve.frontend.front_end_process import GIL_SWITCH_INTERVAL_S

if TYPE_CHECKING:
    from fastapi import FastAPI

logger = logging.getLogger("myserve.run_batch")

OVERLOADED_RETRY_S = 0.05
"""A line answered 429 (the engine's waiting queue is full) is sent again after this long."""


ENGINE_DEATH_WAITS = 20
"""A 5xx answer waits up to this many tenths of a second to learn whether the engine died (then the
line is left for a rerun rather than written as an error)."""


class BatchFileError(MyserveError):
    """The input or output file cannot be used (one line, user-facing)."""


class EngineDied(RuntimeError):
    """The engine stopped mid-run: the lines not yet written stay for a rerun."""


@dataclasses.dataclass
class Line:
    """One request line of the input, parsed (or the reason it cannot be sent)."""

    number: int
    """Its line number in the input file (1-based, blank lines counted)."""
    custom_id: str | None = None
    method: str = "POST"
    url: str = ""
    body: Any = None
    error: dict[str, str] | None = None
    """``{"code", "message"}`` when the line is not a request: it becomes the result's ``error``."""


@dataclasses.dataclass
class Summary:
    """What a run did."""

    total: int
    """Request lines in the input."""
    skipped: int = 0
    """Lines already in the output when the run started (resumed)."""
    done: int = 0
    """Lines written by this run."""
    failed: int = 0
    """Of those, lines whose result is an error (an ``error`` object or a status other than 200)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0

    def line(self) -> str:
        """One line for the end of the run."""
        rate = self.completion_tokens / self.seconds if self.seconds else 0.0
        return (
            f"{self.done} lines done ({self.failed} errors, {self.skipped} already in the output) in "
            f"{self.seconds:.1f}s: {self.prompt_tokens} prompt + {self.completion_tokens} generated tokens, "
            f"{rate:.1f} generated tokens/s"
        )


def parse_line(number: int, text: str) -> Line:
    """A Batch API request line, or a ``Line`` carrying the error that line's result will be."""
    try:
        obj = json.loads(text)
    except ValueError as e:
        return Line(number, error=_error("invalid_json", f"line {number} is not valid JSON: {e}"))
    if not isinstance(obj, dict):
        return Line(number, error=_error("invalid_request", f"line {number} is not a JSON object"))
    custom_id = obj.get("custom_id")
    line = Line(number, custom_id if isinstance(custom_id, str) else None)
    method, url, body = obj.get("method", "POST"), obj.get("url"), obj.get("body")
    if line.custom_id is None:
        line.error = _error("missing_custom_id", f"line {number}: custom_id must be a string")
    elif not isinstance(method, str) or not method:
        line.error = _error("invalid_method", f"line {number}: method must be a string such as POST")
    elif not isinstance(url, str) or not url.startswith("/"):
        line.error = _error("invalid_url", f"line {number}: url must be a path such as /v1/chat/completions")
    elif not isinstance(body, dict):
        line.error = _error("invalid_body", f"line {number}: body must be a JSON object")
    elif body.get("stream"):
        line.error = _error("invalid_body", f"line {number}: stream is not supported in a batch")
    else:
        line.method, line.url, line.body = method.upper(), url, body
    return line


def _error(code: str, message: str) -> dict[str, str]:
    return {"code": code, "message": message}


def read_input(path: str | Path) -> list[Line]:
    """The request lines of ``path`` (blank lines are not requests)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return [parse_line(n, text) for n, text in enumerate(f, 1) if text.strip()]
    except OSError as e:
        raise BatchFileError(f"cannot read {path}: {e.strerror or e}") from None


def resume_point(path: str | Path, lines: Sequence[Line]) -> int:
    """How many results ``path`` already holds (0 if it does not exist). They must be the results of
    the first input lines, in order; a last line cut short by a kill is removed from the file."""
    path = Path(path)
    if not path.exists():
        return 0
    data = path.read_bytes()
    kept, offset = 0, 0
    for raw in data.split(b"\n")[:-1]:  # the bytes after the last newline are a partial line
        try:
            record = json.loads(raw)
        except ValueError:
            break  # cut short by a kill while it was written
        if not isinstance(record, dict) or kept >= len(lines) or record.get("custom_id") != lines[kept].custom_id:
            raise BatchFileError(
                f"{path} line {kept + 1} is not the result of request line {kept + 1} of the input "
                "(another input file's output?); remove it or choose another output file"
            )
        kept += 1
        offset += len(raw) + 1
    if offset < len(data):
        with open(path, "r+b") as f:
            f.truncate(offset)
    return kept


async def call_app(app: FastAPI, method: str, url: str, body: bytes, api_key: str | None) -> tuple[int, bytes]:
    """One request through the app's ASGI interface, as uvicorn would hand it over: (status, body)."""
    path, _, query = url.partition("?")
    headers = [(b"host", b"run-batch"), (b"content-type", b"application/json")]
    headers.append((b"content-length", str(len(body)).encode()))
    if api_key:
        headers.append((b"authorization", f"Bearer {api_key}".encode()))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 0),
        "server": ("run-batch", 0),
        "state": {},
    }
    finished = asyncio.Event()
    sent = False
    status, chunks = 500, []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await finished.wait()  # the client stays until the whole answer came
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                finished.set()

    try:
        await app(scope, receive, send)
    finally:
        finished.set()
    return status, b"".join(chunks)


class _Progress:
    """The stderr progress bar (requests done of the file, generated tokens/s) and the counts."""

    def __init__(self, summary: Summary, show: bool) -> None:
        from tqdm import tqdm

        self.summary, self.t0 = summary, time.perf_counter()
        self.bar = tqdm(
            total=summary.total, initial=summary.skipped, unit="req", file=sys.stderr, disable=not show, smoothing=0.1
        )

    def count(self, result: dict[str, Any]) -> None:
        s = self.summary
        response = result["response"]
        body = response["body"] if response is not None else None
        usage = body.get("usage") if isinstance(body, dict) else None
        if isinstance(usage, dict):
            s.prompt_tokens += int(usage.get("prompt_tokens") or 0)
            s.completion_tokens += int(usage.get("completion_tokens") or 0)
        s.done += 1
        s.failed += result["error"] is not None or response["status_code"] != 200
        s.seconds = time.perf_counter() - self.t0
        rate = s.completion_tokens / s.seconds if s.seconds else 0.0
        self.bar.set_postfix_str(f"{rate:.0f} tok/s, {s.failed} errors", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.summary.seconds = time.perf_counter() - self.t0
        self.bar.close()


async def process(
    app: FastAPI,
    lines: Sequence[Line],
    start: int,
    out: IO[str],
    *,
    concurrency: int,
    api_key: str | None = None,
    progress: bool = False,
) -> Summary:
    """Send ``lines[start:]`` through ``app``, at most ``concurrency`` at once, and write each result
    to ``out`` (flushed) once every line before it is written. Raises ``EngineDied`` if the engine
    stops: the lines not yet written are left for a rerun."""
    summary = Summary(total=len(lines), skipped=start)
    bar = _Progress(summary, progress)
    engine = app.state.context.engine
    slots = asyncio.Semaphore(concurrency)
    results: dict[int, dict[str, Any]] = {}
    next_out = start
    written = asyncio.Event()
    window = max(16 * concurrency, 1024)  # results held for an earlier, slower line

    async def one(i: int) -> None:
        nonlocal next_out
        try:
            results[i] = await answer(lines[i])
        finally:
            slots.release()
        while next_out in results:
            result = results.pop(next_out)
            out.write(json.dumps(result, ensure_ascii=False) + "\n")
            out.flush()
            bar.count(result)
            next_out += 1
        written.set()

    async def answer(line: Line) -> dict[str, Any]:
        result: dict[str, Any] = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id}
        if line.error is not None:
            return {**result, "response": None, "error": line.error}
        payload = json.dumps(line.body).encode()
        while True:
            status, raw = await call_app(app, line.method, line.url, payload, api_key)
            for _ in range(ENGINE_DEATH_WAITS if status >= 500 else 0):
                if engine.dead is not None:  # (set just after the open requests were failed)
                    break
                await asyncio.sleep(0.1)
            if engine.dead is not None:
                raise EngineDied(f"the engine stopped: {engine.dead!r}")
            if status != 429:
                break
            await asyncio.sleep(OVERLOADED_RETRY_S)  # the waiting queue is full: send it again
        try:
            body = json.loads(raw)
        except ValueError:
            body = {"error": {"message": raw.decode("utf-8", "replace"), "type": "invalid_response"}}
        request_id = body.get("id") if isinstance(body, dict) and isinstance(body.get("id"), str) else None
        response = {"status_code": status, "request_id": request_id or f"req_{uuid.uuid4().hex}", "body": body}
        return {**result, "response": response, "error": None}

    try:
        async with app.router.lifespan_context(app), asyncio.TaskGroup() as tasks:
            for i in range(start, len(lines)):
                await slots.acquire()
                while i - next_out >= window:
                    written.clear()
                    await written.wait()
                tasks.create_task(one(i))
    finally:
        bar.close()
    return summary


def default_concurrency(config: Any) -> int:
    """Requests in flight: twice the engine's sequences, every replica's (the next ones queued and
    tokenized while the batch runs), within what its waiting queue takes."""
    seqs = config.engine.max_num_seqs * config.mesh.data
    return max(1, min(2 * seqs, seqs + config.engine.max_waiting))


def run_file(
    app: FastAPI,
    input_file: str | Path,
    output_file: str | Path,
    *,
    concurrency: int,
    api_key: str | None = None,
    progress: bool = False,
) -> Summary:
    """Run a whole batch file through ``app`` (whose engine is started), resuming ``output_file``."""
    lines = read_input(input_file)
    start = resume_point(output_file, lines)
    with open(output_file, "a", encoding="utf-8") as out:
        return asyncio.run(process(app, lines, start, out, concurrency=concurrency, api_key=api_key, progress=progress))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line: the files, then serve's model and engine flags."""
    p = argparse.ArgumentParser(
        prog="python -m myserve.run_batch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("-i", "--input-file", required=True, help="requests, one JSON object a line")
    p.add_argument("-o", "--output-file", required=True, help="results (appended to: an existing one is resumed)")
    p.add_argument("--concurrency", type=int, help="requests in flight (default: 2 x engine.max_num_seqs x mesh.data)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="default: warning")
    add_config_flags(p)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the file; 0 when every line has a result, 1 if the engine died, 2 on bad arguments."""
    from myserve.frontend.core_client import EngineClient
    from myserve.frontend.http_server import app_for

    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = fetch_checkpoints(config_from_args(args))
        if config.models:
            raise ConfigError("run_batch runs one model: a config with models (several) is for the server")
        if args.log_level:
            logging.getLogger().setLevel(config.server.log_level.upper())
        if args.concurrency is not None and args.concurrency < 1:
            raise BatchFileError("--concurrency must be at least 1")
        if Path(args.input_file).resolve() == Path(args.output_file).resolve():
            raise BatchFileError("the output file must not be the input file")
        lines = read_input(args.input_file)
        start = resume_point(args.output_file, lines)  # before loading anything: a wrong file fails fast
        if start == len(lines):
            print(f"all {len(lines)} lines already have results in {args.output_file}", file=sys.stderr)
            return 0
        loaded = load_engine(config)
    except MyserveError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if isinstance(loaded, int):
        return loaded  # a multi-host follower's exit status
    service = loaded
    code = 0
    try:
        service.start()  # warmup: compiles (or loads) the step executables
        app = app_for(config, service, served_model_names(config))
        concurrency = args.concurrency or default_concurrency(config)
        with open(args.output_file, "a", encoding="utf-8") as out:
            run = process(
                app,
                lines,
                start,
                out,
                concurrency=concurrency,
                api_key=config.server.api_key,
                progress=not args.no_progress,
            )
            summary = asyncio.run(run)
        print(summary.line(), file=sys.stderr)
    except* EngineDied as group:
        logger.error("%s; rerun the same command to finish the file", group.exceptions[0])
        code = 1
    except* KeyboardInterrupt:
        print("interrupted; rerun the same command to finish the file", file=sys.stderr)
        code = 130
    finally:
        service.shutdown()
        if not isinstance(service, EngineClient):
            from myserve.runtime import multihost

            multihost.shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
