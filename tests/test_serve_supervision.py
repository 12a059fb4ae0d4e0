"""A dead engine does not linger: the served process answers its requests with the engine's error and
exits non-zero within seconds (so a supervisor restarts it), whether the engine dies while serving
or warmup fails. Faults are injected by a test-only launcher (``serve_with_fault.py``)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from serve_process import ServeProcess

from myserve.bundled import bundled_gguf_path
from myserve.testing import TINY_ENGINE

LAUNCHER = Path(__file__).with_name("serve_with_fault.py")
EXIT_WITHIN_S = 5.0


class Served(ServeProcess):
    """``python -m myserve.serve`` on a tiny model as a subprocess (through the fault launcher when
    a fault is named), its log lines with the time each arrived."""

    def __init__(self, checkpoint: Path, fault: str | None = None, args: tuple[str, ...] = (), env: dict | None = None):
        sets = [f"model.tokenizer={bundled_gguf_path()}", "model.dtype=float32", *TINY_ENGINE, "engine.num_pages=256"]
        entry = ["-m", "myserve.serve"] if fault is None else [str(LAUNCHER)]
        argv = ["--hf-checkpoint", str(checkpoint), "--served-model-name", "tiny", *args]
        argv += [arg for s in sets for arg in ("--set", s)]
        super().__init__(entry, argv, {**(env or {}), **({"MYSERVE_TEST_FAULT": fault} if fault is not None else {})})


@pytest.mark.slow
def test_engine_fault_errors_every_request_and_the_server_exits(tiny_checkpoints) -> None:
    # Fails once all 5 requests run. One token per call: at 8 a call, the tiny model's 300 tokens
    # took less time than the 5 requests took to arrive, and no step ever held all 5.
    served = Served(tiny_checkpoints["llama3"], "dispatch:5", args=("--set", "engine.decode_steps=1"))
    try:
        served.wait_ready()
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 300, "ignore_eos": True, "temperature": 0}
        results: dict[str, object] = {}
        got_error_at: list[float] = []

        def plain(i: int) -> None:
            r = httpx.post(f"{served.url}/v1/completions", json=body, timeout=120)
            got_error_at.append(time.monotonic())
            results[f"plain{i}"] = (r.status_code, r.json())

        def streamed(i: int) -> None:
            with httpx.stream("POST", f"{served.url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            got_error_at.append(time.monotonic())
            results[f"stream{i}"] = (r.status_code, [json.loads(e) for e in events if e != "[DONE]"], events)

        threads = [threading.Thread(target=plain, args=(i,)) for i in range(2)]
        threads += [threading.Thread(target=streamed, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert len(results) == 5, served.log[-3000:]
        for name, result in results.items():
            if name.startswith("plain"):
                status, error = result  # type: ignore[misc]
                assert status == 500 and error["error"]["code"] == "engine_error", result
                assert error["error"]["type"] == "internal_server_error"
                assert "injected device failure" in error["error"]["message"]
            else:
                status, payloads, events = result  # type: ignore[misc]
                assert status == 200 and "[DONE]" not in events
                assert payloads[-1]["error"]["code"] == "engine_error"
        code = served.proc.wait(timeout=30)
        exited = time.monotonic()
        assert code != 0
        assert exited - max(got_error_at) < EXIT_WITHIN_S
        log = served.log
        assert log.count("Traceback (most recent call last)") == 1, log[-4000:]  # logged once
        assert "injected device failure" in log and "exiting with status 1" in log
    finally:
        served.kill()


@pytest.mark.slow
def test_warmup_failure_exits_non_zero(tiny_checkpoints) -> None:
    served = Served(tiny_checkpoints["llama3"], "warmup")
    try:
        code = served.proc.wait(timeout=300)
        exited = time.monotonic()
        assert code != 0
        failed_at = next(t for t, line in served.lines if "warmup failed" in line)
        assert exited - failed_at < EXIT_WITHIN_S
        log = served.log
        assert log.count("Traceback (most recent call last)") == 1 and "injected warmup failure" in log, log[-4000:]
    finally:
        served.kill()
