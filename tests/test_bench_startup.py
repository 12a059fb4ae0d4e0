"""``python -m myserve.bench.startup`` on the host-bound yardstick (a tiny random Llama with SmolLM2's
tokenizer): a cold then a warm start of the real
server, the requests after the warm ``ready`` and after ``primed``; the warm start compiles
nothing (every executable, the small ops included, comes from the step cache)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from myserve.bench import startup
from myserve.bench.random_checkpoint import make_random_llama
from myserve.testing import TINY_ENGINE


def test_startup_bench_times_a_cold_and_a_warm_start_and_the_first_requests(tmp_path: Path) -> None:
    checkpoint = make_random_llama("tiny-llama", tmp_path / "llama")  # the yardstick: SmolLM2's tokenizer
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve = ["--hf-checkpoint", str(checkpoint), "--served-model-name", "SmolLM2-135M-Instruct"]
    for setting in (*TINY_ENGINE, "engine.num_pages=64", "engine.decode_steps=4"):
        serve += ["--set", setting]
    out_file = tmp_path / "startup.json"
    argv = ["--port", str(port), "--cache-dir", str(tmp_path / "cache"), "--requests", "2", "--timeout", "300"]
    argv += [f"--serve-arg={a}" for a in serve] + ["--output", str(out_file)]
    assert startup.main(argv) == 0
    out = json.loads(out_file.read_text())
    assert out["cold_ready_s"] > 0 and out["warm_ready_s"] > 0
    assert "0 loaded" in out["cold_warmup"] and "(0 compiled" in out["warm_warmup"], out
    assert len(out["first_s"]) == len(out["primed_s"]) == 2 and out["first_over_primed"] > 0
    assert out["peak_mappings"] > 0 and out["cold_exited"] is None and out["warm_exited"] is None


def test_startup_bench_stops_with_the_log_when_the_server_exits(tmp_path: Path) -> None:
    """A server that exits before ``ready`` ends the benchmark at once, with what it said last."""
    argv = ["--cache-dir", str(tmp_path / "cache"), "--timeout", "120", "--serve-arg=--hf-checkpoint"]
    argv += [f"--serve-arg={tmp_path / 'missing'}"]
    with pytest.raises(SystemExit, match="exited .* before ready .cold.") as raised:
        startup.main(argv)
    assert "missing" in str(raised.value)
