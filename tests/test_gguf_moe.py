"""Mixture-of-Experts GGUFs: tiny random Qwen3-MoE, Mixtral and Qwen2-MoE checkpoints converted to GGUF
the way llama.cpp's convert_hf_to_gguf.py does (experts stacked per layer, Mixtral's Q/K permuted)
load to the same ModelSpec and give transformers' logits through the served step."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import load_on_mesh
from test_model_parity import full_logits

from myserve.models.checkpoint import resolve_checkpoint
from myserve.models.loading import open_source
from myserve.testing import hf_logits

_EXPERT_RE = re.compile(r"model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (HF rotate-half -> interleaved rotary pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_to_gguf(src: Path, dst: Path, layout: str = "stacked", expert_qtype: str | None = None) -> Path:
    """Write ``src`` (an HF MoE checkpoint) as a GGUF file. ``layout``: "stacked" (``ffn_*_exps``,
    as llama.cpp writes today), "gate_up" (gate and up fused in ``ffn_gate_up_exps``) or "legacy"
    (one 2-D tensor per expert, Mixtral GGUFs of early 2024). ``expert_qtype``: a ggml type name
    for the 3-D expert tensors (F32 otherwise)."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((src / "config.json").read_text())
    arch = {"qwen3_moe": "QWEN3MOE", "qwen2_moe": "QWEN2MOE", "mixtral": "LLAMA"}[cfg["model_type"]]
    arch = gguf.MODEL_ARCH[arch]
    layers, heads, kv_heads = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(dst), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_block_count(layers)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("head_dim"):
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    writer.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])

    names = gguf.get_tensor_name_map(arch, layers)
    legacy = {"w1": "ffn_gate", "w2": "ffn_down", "w3": "ffn_up"}
    stacks: dict[tuple[int, str, str], dict[int, np.ndarray]] = {}
    out: dict[str, np.ndarray] = {}
    for name, w in load_file(src / "model.safetensors").items():
        m = _EXPERT_RE.fullmatch(name)
        if m and layout == "legacy":
            out[f"blk.{m.group(1)}.{legacy[m.group(4)]}.{m.group(3)}.weight"] = w
            continue
        if m:
            stacks.setdefault((int(m.group(1)), m.group(2), m.group(4)), {})[int(m.group(3))] = w
            continue
        if arch == gguf.MODEL_ARCH.LLAMA and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = _permute(w, heads if "q_proj" in name else kv_heads)
        out[names.get_name(name, try_suffixes=(".weight", ".bias"))] = w
    for (layer, prefix, part), per_expert in sorted(stacks.items()):
        merged = names.get_name(f"model.layers.{layer}.{prefix}.experts.{part}.weight", try_suffixes=(".weight",))
        out[merged] = np.stack([per_expert[j] for j in range(len(per_expert))])  # [experts, out, in]
    if layout == "gate_up":
        for layer in range(layers):
            gate, up = out.pop(f"blk.{layer}.ffn_gate_exps.weight"), out.pop(f"blk.{layer}.ffn_up_exps.weight")
            out[f"blk.{layer}.ffn_gate_up_exps.weight"] = np.concatenate([gate, up], axis=1)
    for name, w in out.items():
        if expert_qtype and w.ndim == 3:
            qtype = gguf.GGMLQuantizationType[expert_qtype]
            writer.add_tensor(name, gguf.quants.quantize(w.astype(np.float32), qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, w.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


CASES = [
    ("qwen3_moe", "stacked"),
    ("qwen3_moe", "gate_up"),
    ("mixtral", "stacked"),
    ("mixtral", "legacy"),
    ("qwen2_moe", "stacked"),
]


@pytest.mark.parametrize(("arch", "layout"), CASES)
def test_moe_gguf_logits_match_transformers(arch: str, layout: str, tiny_checkpoints, tmp_path: Path) -> None:
    path = hf_to_gguf(tiny_checkpoints[arch], tmp_path / f"{arch}.gguf", layout)
    ids = [int(t) for t in np.random.RandomState(7).randint(0, 256, size=45)]
    ours = full_logits(*load_on_mesh(path), ids)
    ref = hf_logits(tiny_checkpoints[arch], ids)
    assert np.abs(ref).max() > 1.0
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_moe_gguf_spec_matches_config(arch: str, tiny_checkpoints, tmp_path: Path) -> None:
    """Metadata gives the spec config.json gives (eps goes through float32 in GGUF)."""
    gguf_spec = open_source(resolve_checkpoint(hf_to_gguf(tiny_checkpoints[arch], tmp_path / "m.gguf"))).spec
    hf_spec = open_source(resolve_checkpoint(tiny_checkpoints[arch])).spec
    assert gguf_spec.rms_norm_eps == pytest.approx(hf_spec.rms_norm_eps)
    assert dataclasses.replace(gguf_spec, rms_norm_eps=hf_spec.rms_norm_eps) == hf_spec
    assert gguf_spec.is_moe and gguf_spec.norm_topk_prob == (arch != "qwen2_moe")


def test_quantized_expert_stacks_read_as_gguf_reader_dequantizes(tiny_checkpoints, tmp_path: Path) -> None:
    """3-D Q8_0 expert tensors come back under the fused HF names exactly as gguf.GGUFReader
    dequantizes them: [experts, 2 * width, embed] with gate before up, and [experts, embed, width]."""
    import gguf

    path = hf_to_gguf(tiny_checkpoints["qwen3_moe"], tmp_path / "q8.gguf", expert_qtype="Q8_0")
    source = open_source(resolve_checkpoint(path))
    theirs = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}

    def dequantized(name: str) -> np.ndarray:
        t = theirs[name]
        assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0
        return gguf.quants.dequantize(t.data, t.tensor_type)

    assert source.has("model.layers.1.mlp.experts.gate_up_proj")
    assert not source.has("model.layers.1.mlp.experts.0.gate_proj.weight")
    gate_up = source.read("model.layers.1.mlp.experts.gate_up_proj")
    assert gate_up.shape == (8, 64, 64)
    expected = np.concatenate([dequantized("blk.1.ffn_gate_exps.weight"), dequantized("blk.1.ffn_up_exps.weight")], 1)
    np.testing.assert_array_equal(gate_up, expected)
    down = source.read("model.layers.1.mlp.experts.down_proj")
    assert down.shape == (8, 64, 32)
    np.testing.assert_array_equal(down, dequantized("blk.1.ffn_down_exps.weight"))
