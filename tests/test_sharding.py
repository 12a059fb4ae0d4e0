"""Sharded meshes give the same logits as one device (8 fake CPU devices, in a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("sharding_worker.py")


def run_worker(checkpoint: str, *meshes: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(WORKER), checkpoint, *meshes], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_tiny_llama_sharded_heads_and_kv(tiny_checkpoints) -> None:
    # Tiny llama: 4 heads, 2 KV heads, mlp 128, vocab 256 -> everything shards on model=2.
    result = run_worker(str(tiny_checkpoints["llama3"]), "1x2", "1x4", "2x2")
    for mesh, r in result.items():
        assert r["max_abs_diff"] <= 1e-4, (mesh, r)
    two = result["1x2"]["layout"]
    assert "'model'" in two["heads"] and "'model'" in two["mlp"] and "'model'" in two["vocab"]
    assert "'model'" in two["kv_cache"]
    # 2 KV heads do not divide model=4: the cache (and the k/v projections) are replicated there.
    assert "'model'" not in result["1x4"]["layout"]["kv_cache"]
    assert result["1x4"]["layout"]["devices"] == 4


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_tiny_gemma_sharded(arch: str, tiny_checkpoints) -> None:
    """Gemma's sliding layers (the windowed loop on each shard's own KV heads), float32 norms and
    soft caps on a model=2 mesh give one device's logits."""
    result = run_worker(str(tiny_checkpoints[arch]), "1x2")
    assert result["1x2"]["max_abs_diff"] <= 1e-4, result
    assert "'model'" in result["1x2"]["layout"]["kv_cache"]
