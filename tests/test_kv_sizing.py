"""The KV pool sized from memory (``runtime/kv_sizing.py``), host only: a byte budget, the CPU
default and its cap, a GPU's share of its memory less the weights and activations, and the one-line
refusal of a context the pool cannot hold."""

from __future__ import annotations

import pytest

from myserve.config import EngineConfig
from myserve.errors import ConfigError
from myserve.models.spec import ModelSpec
from myserve.runtime.kv_sizing import (
    GIB,
    activation_bytes,
    device_budget,
    gpu_allocator_fraction,
    page_bytes,
    plan_pages,
)

SPEC = ModelSpec(
    model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
    num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=5e5,
    max_position_embeddings=131072, tie_word_embeddings=True,
)  # fmt: skip
"""Llama-3.2-1B's shape."""
PAGE = 16 * 2 * 8 * 16 * 64 * 2
"""Its page of 16 tokens in bfloat16: 512 KiB."""


def plan(engine: EngineConfig, **kw):
    args = dict(platform="cpu", itemsize=2, max_model_len=8192, token_budget=2048, env={})
    return plan_pages(engine, SPEC, **{**args, **kw})


def test_a_page_holds_k_and_v_of_every_layer() -> None:
    # 16 layers x K,V x 8 heads x 16 tokens x 64 x 2 bytes
    assert page_bytes(SPEC, 16, 2) == PAGE == 512 * 1024
    assert page_bytes(SPEC, 16, 2, model_shards=4) == PAGE // 4  # heads split over the model axis
    assert page_bytes(SPEC, 16, 2, model_shards=16) == PAGE // 8  # fewer heads than devices: replicated


def test_a_byte_budget_gives_its_pages_on_any_platform() -> None:
    engine = EngineConfig(kv_cache_memory_bytes=GIB)
    assert plan(engine).pages == GIB // PAGE == 2048
    assert plan(engine, platform="gpu", bytes_limit=80 * GIB).pages == 2048


def test_cpu_default_is_4_gib_at_most_a_quarter_and_capped_by_what_sequences_can_hold() -> None:
    engine = EngineConfig(max_num_seqs=4)
    # 4 sequences x 8192 / 16 pages each + 1: far below 4 GiB's 8192 pages
    assert plan(engine, host_available=64 * GIB).pages == 4 * 512 + 1
    many = EngineConfig(max_num_seqs=256)
    assert plan(many, host_available=64 * GIB).pages == 4 * GIB // PAGE
    assert plan(many, host_available=8 * GIB).pages == 2 * GIB // PAGE  # a quarter of what is free
    assert plan(many, env={"VLLM_CPU_KVCACHE_SPACE": "1"}).pages == GIB // PAGE  # vLLM's CPU variable


def test_gpu_share_less_weights_and_activations() -> None:
    engine = EngineConfig(gpu_memory_utilization=0.5)
    limit = 60 * GIB  # XLA's default 75 % of an 80 GiB card
    budget, source = device_budget(engine, "gpu", limit, env={})
    assert budget == 40 * GIB and "0.5 of 80.0 GiB" in source
    got = plan(engine, platform="gpu", bytes_limit=limit, weight_bytes=3 * GIB)
    reserve = activation_bytes(SPEC, 2048, 65, 2)
    assert got.pages == (40 * GIB - 3 * GIB - reserve) // PAGE
    assert 0.1 * GIB < reserve < 2 * GIB  # the score step's [2048, 128256] float32 logits dominate
    # Asked for more than XLA's allocator may hand out: capped at its limit.
    assert device_budget(EngineConfig(gpu_memory_utilization=0.95), "gpu", limit, env={})[0] == limit
    # With the fraction set to the utilization (what the core process does), the card is limit / fraction.
    env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}
    assert device_budget(EngineConfig(), "gpu", int(0.9 * 80 * GIB), env=env)[0] == pytest.approx(72 * GIB, rel=1e-6)
    assert device_budget(EngineConfig(gpu_memory_utilization=0.5), "tpu", 16 * GIB, env={})[0] == 8 * GIB


def test_the_allocator_fraction_follows_the_utilization_unless_set() -> None:
    assert gpu_allocator_fraction(EngineConfig(gpu_memory_utilization=0.8), env={}) == "0.8000"
    assert gpu_allocator_fraction(EngineConfig(), env={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}) is None
    assert gpu_allocator_fraction(EngineConfig(num_pages=64), env={}) is None
    assert gpu_allocator_fraction(EngineConfig(kv_cache_memory_bytes=GIB), env={}) is None


def test_a_context_the_pool_cannot_hold_is_refused_naming_both() -> None:
    with pytest.raises(ConfigError) as e:
        plan(EngineConfig(kv_cache_memory_bytes=GIB), max_model_len=131072)
    message = str(e.value)
    assert "max_model_len (131072 tokens)" in message and "32768 tokens" in message
    assert "--kv-cache-memory-bytes" in message and "--max-model-len" in message
    with pytest.raises(ConfigError, match="raise --gpu-memory-utilization or lower --max-model-len"):
        plan(EngineConfig(gpu_memory_utilization=0.1), platform="gpu", bytes_limit=8 * GIB, weight_bytes=GIB)
    with pytest.raises(ConfigError, match="does not report its memory"):
        plan(EngineConfig(), platform="tpu")


def test_the_peak_after_warmup_is_held_to_the_share() -> None:
    """The post-warmup line: the devices' largest peak against the allocator's limit (the share the
    core asked for); none on a CPU, which reports no peak."""
    from myserve.runtime.kv_sizing import peak_report

    assert peak_report([{}, {}], 0.9) is None
    devices = [{"peak_bytes_in_use": n * GIB, "bytes_limit": 72 * GIB} for n in (30, 40)]
    line, over = peak_report(devices, 0.9)
    assert not over and "peak 40.00 GiB of the 72.00 GiB gpu_memory_utilization 0.9 allows" in line
    line, over = peak_report([{"peak_bytes_in_use": 73 * GIB, "bytes_limit": 72 * GIB}], 0.9)
    assert over and "raise --gpu-memory-utilization" in line
