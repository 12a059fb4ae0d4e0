"""``python -m myserve.bench.startup`` on a tiny random Llama: a cold then a warm start of the real
server, the requests after the warm ``ready`` and after ``primed``; the warm start compiles
nothing (every executable, the small ops included, comes from the step cache)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from myserve.bench import startup
from myserve.testing import TINY_ENGINE, make_tiny_checkpoint


def test_startup_bench_times_a_cold_and_a_warm_start_and_the_first_requests(tmp_path: Path) -> None:
    checkpoint = make_tiny_checkpoint("llama3", tmp_path / "llama")
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
