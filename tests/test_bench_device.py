"""``python -m myserve.bench.device``: the whole command on CPU (tiny), and its parts."""

from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from myserve.bench.device import card_slug, roofline
from myserve.bench.device_plan import FULL, RUN_NAMES, TINY, config_variants
from myserve.bench.device_profile import summarize_trace

CONFIG_DIR = Path(__file__).resolve().parents[1] / "config"


@pytest.mark.slow
def test_device_command_runs_tiny_on_cpu(tmp_path: Path) -> None:
    """On CPU the command runs tiny by itself and writes the JSON other tools read: every named
    run measured, its roofline share its tokens/s over its roofline, the H100 deployment skipped
    with a reason."""
    output = tmp_path / "device.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "myserve.bench.device",
            "--workdir",
            str(tmp_path / "work"),
            "--output",
            str(output),
            "--set",
            "engine.seed=0",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(output.read_text())
    assert set(doc) == {"device", "jax", "ceilings", "overrides", "runs"}
    assert doc["overrides"] == ["engine.seed=0"]
    assert doc["device"] == "cpu" and doc["jax"]
    assert set(doc["ceilings"]) == {"copy_bytes_per_s", "matmul_flops_per_s"}
    assert all(v > 0 for v in doc["ceilings"].values())
    runs = {r["name"]: r for r in doc["runs"]}
    assert [r["name"] for r in doc["runs"]][: len(RUN_NAMES)] == list(RUN_NAMES)
    for name in RUN_NAMES:
        r = runs[name]
        assert {"concurrency", "prompt_tokens", "quantization", "tokens_per_s", "roofline_tokens_per_s"} <= set(r)
        assert r["concurrency"] == (1 if name.endswith("-c1") else TINY.concurrency)
        assert r["tokens_per_s"] > 0 and r["roofline_tokens_per_s"] > 0 and r["prompt_tokens"] > 0
        assert math.isclose(r["roofline_share"], r["tokens_per_s"] / r["roofline_tokens_per_s"], rel_tol=1e-9)
    assert runs["int4-c1"]["quantization"] == "int4" and runs["bf16-c64"]["quantization"] == "none"
    assert runs["bf16-4k-c64"]["prompt_tokens"] == runs["bf16-4k-c1"]["prompt_tokens"] == TINY.long_prompt
    # Many streams: the prefill and the decode apart (issue 46's figures).
    long = runs["bf16-4k-c64"]
    assert long["prefill_tokens_per_s"] > 0 and long["decode_tokens_per_s"] > 0
    assert 0 < long["prefill_s"] < long["seconds"]
    # int8 reads about a quarter of the float32 weights' bytes; the MoE only its routed experts' share
    assert runs["int8-c1"]["weight_read_bytes"] < 0.4 * runs["bf16-c1"]["weight_read_bytes"]
    assert "skipped" in runs["llama-3.1-8b-h100"] and runs["llama-3.1-8b-h100"]["tokens_per_s"] is None
    assert "bf16-4k-c64" in proc.stdout and "roofline" in proc.stdout


def test_roofline_is_concurrency_times_bandwidth_over_bytes_read() -> None:
    entry = {"concurrency": 4, "prompt_tokens": 100, "tokens_per_s": 50.0}
    entry |= {"weight_read_bytes": 1000, "kv_bytes_per_token": 2}
    roofline(entry, copy_bytes_per_s=1e6, max_tokens=20)
    assert entry["kv_read_bytes"] == 4 * (100 + 10) * 2
    assert entry["roofline_tokens_per_s"] == pytest.approx(4 * 1e6 / (1000 + 880))
    assert entry["roofline_share"] == pytest.approx(50.0 / entry["roofline_tokens_per_s"])
    failed = {"concurrency": 1, "prompt_tokens": 0, "tokens_per_s": None}
    roofline(failed, 1e6, 20)
    assert failed["roofline_tokens_per_s"] is None and failed["roofline_share"] is None


def test_card_slug() -> None:
    assert card_slug("NVIDIA H200") == "nvidia-h200"
    assert card_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert card_slug("cpu") == "cpu" and card_slug("TPU v5 lite") == "tpu-v5-lite"


def test_h100_deployments_run_only_where_they_fit() -> None:
    """The shipped H100 config runs on random weights of Llama-3.1-8B's shape when weights plus KV
    pool fit the device; tiny mode and a small device skip it, saying why."""
    (fits,) = config_variants(FULL, CONFIG_DIR, memory_bytes=80 * 10**9)
    assert fits.name == "llama-3.1-8b-h100" and fits.shape == "llama-3.1-8b" and fits.skip is None
    assert fits.config and fits.config.endswith("llama-3.1-8b-h100.yaml")
    (small,) = config_variants(FULL, CONFIG_DIR, memory_bytes=24 << 30)
    assert small.skip and "GiB" in small.skip
    (tiny,) = config_variants(TINY, CONFIG_DIR, memory_bytes=80 * 10**9)
    assert tiny.skip and "tiny" in tiny.skip


def test_trace_summary(tmp_path: Path) -> None:
    """Busy time is the union of the device's intervals over the wall time; kernels and host time
    per step count the step's module and its executable calls."""
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/host:CPU"}},
    ]
    kernel = {"ph": "X", "pid": 1, "tid": 1, "args": {"hlo_module": "jit_model_step"}}
    events = [
        *meta,
        {**kernel, "name": "fusion_1", "ts": 0.0, "dur": 100.0},
        {**kernel, "tid": 2, "name": "fusion_2", "ts": 50.0, "dur": 100.0},  # overlaps: 150 us busy
        {**kernel, "name": "fusion_3", "ts": 1000.0, "dur": 50.0},
        {"ph": "X", "pid": 1, "tid": 3, "name": "MemcpyD2H", "ts": 1100.0, "dur": 10.0, "args": {}},
        {"ph": "X", "pid": 7, "tid": 9, "name": "CommonPjRtLoadedExecutable::Execute (jit_model_step)", "ts": 0.0,
         "dur": 2000.0},
        {"ph": "X", "pid": 7, "tid": 9, "name": "CommonPjRtLoadedExecutable::Execute (jit_model_step)", "ts": 900.0,
         "dur": 1000.0},
    ]  # fmt: skip
    path = tmp_path / "t.trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    s = summarize_trace(path, wall_s=0.01)
    assert s["available"] and s["steps"] == 2
    assert s["device_busy_s"] == pytest.approx(210e-6) and s["device_busy_share"] == pytest.approx(0.021)
    assert s["kernels_per_step"] == 1.5 and s["host_ms_in_execute_per_step"] == pytest.approx(1.5)
    assert s["host_ms_in_thunks_per_step"] is None
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": meta[1:]}).encode()))
    assert summarize_trace(path, wall_s=0.01)["available"] is False


def test_decode_read_bytes_counts_routed_experts_at_top_k(tmp_path: Path) -> None:
    """A MoE decode step reads k of E experts' weights; a dense one every weight."""
    from myserve.bench.device_worker import _nbytes, decode_read_bytes
    from myserve.bench.random_checkpoint import SHAPES, make_random_llama
    from myserve.config import load_config
    from myserve.runtime.deployment import Deployment

    directory = make_random_llama("tiny-moe", tmp_path / "moe")
    model = Deployment.load(load_config(None, [f"model.checkpoint={directory}"])).model
    total = _nbytes(model)
    routed = sum(_nbytes(layer.moe.gate_up) + _nbytes(layer.moe.down) for layer in model.layers)
    cfg = SHAPES["tiny-moe"]
    inactive = 1 - cfg["num_experts_per_tok"] / cfg["num_experts"]
    assert decode_read_bytes(model) == pytest.approx(total - inactive * routed, abs=len(model.layers))
    assert 0 < routed < total and decode_read_bytes(model) < total
