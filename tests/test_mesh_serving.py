"""Serving on a device mesh gives the same greedy tokens as one device (8 fake CPU devices, in a
subprocess): 8 concurrent requests through a GenerationService on meshes (data x model) 1x1, 1x2,
1x4 and 2x2 (two data-parallel replicas of model=2) for the tiny random Llama; 1x1, 1x4 and 2x2
for its two kernel paths; 1x1 and 2x2 for Qwen3 and for a Llama with SmolLM2's head counts. (Each
mesh is a build of its own: the lists are what each case adds, for the suite's time.)"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from myserve.testing import make_tiny_checkpoint

WORKER = Path(__file__).with_name("mesh_worker.py")
MESHES = ("1x1", "1x2", "1x4", "2x2")
KERNEL_MESHES = ("1x1", "1x4", "2x2")  # model=2 inside each data replica; model=4 over 2 KV heads


def served_tokens(checkpoint: str, env: dict[str, str] | None = None, meshes: tuple[str, ...] = MESHES) -> dict:
    proc = subprocess.run(
        [sys.executable, str(WORKER), checkpoint, *meshes],
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
    for mesh in result:
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
    assert result["2x2"]["decode_collectives"], "model=2 must really split the layers"


def test_tiny_llama_serves_identically_on_every_mesh(tiny_checkpoints) -> None:
    # 2 KV heads: the cache shards on model=2, is replicated on model=4.
    result = served_tokens(str(tiny_checkpoints["llama3"]))
    check_identical(result, vocab=256)
    assert "'model'" in result["1x2"]["cache_spec"] and "'model'" not in result["1x4"]["cache_spec"]


def test_tiny_qwen3_serves_identically_with_tensor_and_data_parallelism(tiny_checkpoints) -> None:
    """Qwen3's per-head q/k norms and its head_dim (32) that is not hidden / heads (16)."""
    result = served_tokens(str(tiny_checkpoints["qwen3"]), meshes=("1x1", "2x2"))
    check_identical(result, vocab=256)
    assert "'model'" in result["2x2"]["cache_spec"]


# data x expert x model: expert parallel 2 and 4, and EP x TP in each of 2 replicas (Mixtral, whose
# expert weights load from other names, on the last: the expert-parallel step is the same code).
MOE_MESHES = {"qwen3_moe": ("1x1x1", "1x2x1", "1x4x1", "2x2x2"), "mixtral": ("1x1x1", "1x2x1", "2x2x2")}


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_models_serve_identically_with_expert_parallelism(arch: str, tiny_checkpoints) -> None:
    """8 experts split 2 and 4 ways over the ``expert`` axis (and 2 x 2 with tensor parallelism, in
    each of 2 data-parallel replicas):
    the same greedy tokens as one device, nothing compiled after warmup as the routing changes
    from step to step, the expert weights never gathered (each device runs its own), and the
    experts combined by one all-reduce of the step's [8, hidden] partial sums per layer."""
    result = served_tokens(str(tiny_checkpoints[arch]), meshes=MOE_MESHES[arch])
    one_device = result["1x1x1"]["tokens"]
    assert all(len(t) == 8 for t in one_device)
    for mesh, r in result.items():
        assert r["tokens"] == one_device, mesh
        assert r["compiles_after_warmup"] == 0, mesh
        assert r["max_decode_batch"] == 8 // int(mesh[0]), mesh
        combines = [c for c in r["decode_collectives"] if c.startswith("all-reduce f32[8,64]")]
        assert len(combines) == (0 if mesh == "1x1x1" else 2), (mesh, r["decode_collectives"])  # one per layer
        # Nothing gathers the experts' weights (an expert's gate/up alone is 64 x 2 x 32): every
        # collective moves activations, routing or the sampler's logits (at most 8 x vocab).
        sizes = [math.prod(int(x) for x in re.findall(r"\d+", c.split("[", 1)[1])) for c in r["decode_collectives"]]
        assert max(sizes, default=0) <= 8 * 256, (mesh, r["decode_collectives"])
    # The 2 KV heads split over expert=2 (the expert-parallel devices share the attention and the
    # cache), and over model=2 where expert x model = 4 does not divide them.
    assert "'expert'" in result["1x2x1"]["cache_spec"]
    assert "'model'" in result["2x2x2"]["cache_spec"] and "'expert'" not in result["2x2x2"]["cache_spec"]


def test_heads_no_mesh_divides_are_replicated_while_the_mlp_and_vocabulary_shard(tmp_path: Path) -> None:
    """SmolLM2's head counts (9 query and 3 KV heads divide neither 2 nor 4) on a tiny Llama: its
    attention and cache are replicated while its MLP and vocabulary shard, on model=2 in each of two
    data-parallel replicas, with the same tokens as one device."""
    heads = {"hidden_size": 144, "num_attention_heads": 9, "num_key_value_heads": 3}
    checkpoint = make_tiny_checkpoint("llama3", tmp_path / "heads-9-3", overrides=heads)
    result = served_tokens(str(checkpoint), meshes=("1x1", "2x2"))
    check_identical(result, vocab=256)
    assert all("'model'" not in r["cache_spec"] for r in result.values())  # 3 KV heads: replicated
    layout = result["2x2"]["layout"]
    assert "'model'" in layout["mlp"] and "'model'" in layout["vocab"], layout
    assert "'model'" not in layout["heads"], layout


def test_the_tpu_kernel_path_serves_identically_on_every_mesh(tiny_checkpoints) -> None:
    """The TPU kernel's path (``tests/kernel_contract.py`` in the kernel's place): its cache layout
    splits the combined K/V heads over model=2 and the kernel runs per device under shard_map, with
    the same tokens on every mesh and no collective but the layers' all-reduces and the sampler's."""
    result = served_tokens(str(tiny_checkpoints["llama3"]), env={"KERNEL_CONTRACT": "1"}, meshes=KERNEL_MESHES)
    check_identical(result, vocab=256)
    assert all(r["cache_layout"] == "KernelKVCache" for r in result.values())
    assert result["2x2"]["cache_spec"] == "P(None, None, None, 'model')"  # the combined K/V heads


def test_the_gpu_kernel_path_serves_identically_on_every_mesh(tiny_checkpoints) -> None:
    """The GPU decode kernel's path (JAX's kernel run by Pallas's interpreter): the reference cache
    layout with its KV heads split over model=2, the kernel per device under shard_map on the
    decode rows, the same tokens on every mesh and no collective beyond the reference path's."""
    result = served_tokens(str(tiny_checkpoints["llama3"]), env={"GPU_KERNEL_INTERPRET": "1"}, meshes=KERNEL_MESHES)
    check_identical(result, vocab=256)
    assert all(r["cache_layout"] == "KVCache" for r in result.values())
    assert result["2x2"]["cache_spec"] == "P(None, 'model')"  # [layers, kv_heads, ...]: heads split


def test_the_gpu_ragged_kernel_path_serves_identically_on_every_mesh(tiny_checkpoints) -> None:
    """Our GPU ragged kernel's path (interpreted): both views on the kernel per device under
    shard_map with the KV heads split over model, the same tokens on every mesh."""
    result = served_tokens(str(tiny_checkpoints["llama3"]), env={"GPU_RAGGED_KERNEL": "1"}, meshes=KERNEL_MESHES)
    check_identical(result, vocab=256)
    assert all(r["attention_backend"] == "pallas_gpu_ragged" for r in result.values())
    assert result["2x2"]["cache_spec"] == "P(None, 'model')"
