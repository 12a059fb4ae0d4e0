"""Serving on a device mesh gives the same greedy tokens as one device (8 fake CPU devices, in a
subprocess): 8 concurrent requests through a GenerationService on meshes (data x model) 1x1, 1x2,
1x4 and 2x2 (two data-parallel replicas of model=2), for the tiny random Llama and Qwen3 and for
SmolLM2."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("mesh_worker.py")
MESHES = ("1x1", "1x2", "1x4", "2x2")


def served_tokens(checkpoint: str, env: dict[str, str] | None = None) -> dict:
    proc = subprocess.run(
        [sys.executable, str(WORKER), checkpoint, *MESHES],
        capture_output=True,
        text=True,
        timeout=900,
        env=None if env is None else {**os.environ, **env},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_identical(result: dict, vocab: int) -> None:
    one_device = result["1x1"]
    assert all(len(t) == 8 for t in one_device["tokens"])
    for mesh in MESHES:
        assert result[mesh]["tokens"] == one_device["tokens"], mesh
        # The 8 requests really shared decode steps: all in one call, or 4 per data-parallel replica.
        data = int(mesh.split("x")[0])
        assert result[mesh]["max_decode_batch"] == 8 // data, mesh
        # No step reshards the cache: it keeps its sharding, and the only collectives of an 8-token
        # step are the layers' tensor-parallel all-reduces of [1, 8, hidden] activations and the
        # sampler's over the vocabulary-sharded logits: at most its 8 rows of logits (the draw and
        # logprobs branches gather them), or one row (the per-row sort a top-p row may fall back to).
        assert result[mesh]["cache_kept"], (mesh, result[mesh]["cache_spec"])
        for c in result[mesh]["decode_collectives"]:
            dims = [int(x) for x in re.findall(r"\d+", c.split("[", 1)[1])]
            sampler = (dims[0] == 8 and math.prod(dims) <= 8 * vocab) or dims == [vocab]
            assert c.startswith("all-reduce f32[1,8,") or sampler, (mesh, c)
    assert result["1x2"]["decode_collectives"], "model=2 must really split the layers"


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_tiny_models_serve_identically_on_every_mesh(arch: str, tiny_checkpoints) -> None:
    # Both tiny models have 2 KV heads: the cache shards on model=2, is replicated on model=4.
    result = served_tokens(str(tiny_checkpoints[arch]))
    check_identical(result, vocab=256)
    assert "'model'" in result["1x2"]["cache_spec"] and "'model'" not in result["1x4"]["cache_spec"]


@pytest.mark.slow
def test_smollm2_serves_identically_on_every_mesh() -> None:
    result = served_tokens("bundled")
    check_identical(result, vocab=49152)
    assert all("'model'" not in r["cache_spec"] for r in result.values())  # 3 KV heads: replicated


def test_the_tpu_kernel_path_serves_identically_on_every_mesh(tiny_checkpoints) -> None:
    """The TPU kernel's path (``tests/kernel_contract.py`` in the kernel's place): its cache layout
    splits the combined K/V heads over model=2 and the kernel runs per device under shard_map, with
    the same tokens on every mesh and no collective but the layers' all-reduces and the sampler's."""
    result = served_tokens(str(tiny_checkpoints["llama3"]), env={"KERNEL_CONTRACT": "1"})
    check_identical(result, vocab=256)
    assert all(r["cache_layout"] == "KernelKVCache" for r in result.values())
    assert result["1x2"]["cache_spec"] == "P(None, None, None, 'model')"  # the combined K/V heads


def test_the_gpu_kernel_path_serves_identically_on_every_mesh(tiny_checkpoints) -> None:
    """The GPU decode kernel's path (JAX's kernel run by Pallas's interpreter): the reference cache
    layout with its KV heads split over model=2, the kernel per device under shard_map on the
    decode rows, the same tokens on every mesh and no collective beyond the reference path's."""
    result = served_tokens(str(tiny_checkpoints["llama3"]), env={"GPU_KERNEL_INTERPRET": "1"})
    check_identical(result, vocab=256)
    assert all(r["cache_layout"] == "KVCache" for r in result.values())
    assert result["1x2"]["cache_spec"] == "P(None, 'model')"  # [layers, kv_heads, ...]: heads split
