"""GGUF checkpoints: metadata to ModelSpec, and tensors dequantized one at a time under HF names.

The header is parsed by ``gguf_file.read_gguf`` over a memory map; the ``gguf`` package dequantizes
each tensor with numpy (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K and the other ggml types it
knows), so only one tensor is ever materialised as float32 on the host.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from myserve.errors import CheckpointError
from myserve.models.gguf_file import read_gguf
from myserve.models.spec import ModelSpec

# GGUF general.architecture -> HF model_type. llama.cpp files Mistral under "llama".
_GGUF_ARCHES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# HF per-layer suffix -> GGUF per-block name.
_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of Q/K projections (interleaved rotary -> HF's rotate-half)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFSource:
    """Tensors of a GGUF file, addressed by their HF names and returned in HF layout."""

    def __init__(self, path: Path):
        self.path = path
        self._file = read_gguf(path)
        self._tensors = self._file.tensors
        self.spec = self._spec()

    def field(self, key: str, default: Any = None) -> Any:
        """A metadata value, or ``default`` when absent."""
        return self._file.metadata.get(key, default)

    def _spec(self) -> ModelSpec:
        arch = self.field("general.architecture")
        if arch not in _GGUF_ARCHES:
            raise CheckpointError(
                f"{self.path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(_GGUF_ARCHES)}"
            )
        if "rope_freqs.weight" in self._tensors:
            raise CheckpointError(f"{self.path}: GGUF rope_freqs (llama3 rope scaling) is not supported yet")

        def get(key: str, default: Any = None) -> Any:
            value = self.field(f"{arch}.{key}", default)
            if value is None:
                raise CheckpointError(f"{self.path}: GGUF metadata {arch}.{key} is missing")
            return value

        hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
        if "token_embd.weight" not in self._tensors:
            raise CheckpointError(f"{self.path}: GGUF has no token_embd.weight tensor")
        vocab = self._tensors["token_embd.weight"].dims[-1]
        return ModelSpec(
            model_type=_GGUF_ARCHES[arch],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=int(get("attention.key_length", hidden // heads)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            max_position_embeddings=int(get("context_length")),
            tie_word_embeddings="output.weight" not in self._tensors,
            qkv_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
        )

    def _gguf_name(self, hf_name: str) -> str:
        if hf_name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[hf_name]
        m = _LAYER_RE.fullmatch(hf_name)
        if m and m.group(2) in _LAYER_NAMES:
            return f"blk.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
        return hf_name

    def has(self, hf_name: str) -> bool:
        """Whether the file holds this tensor."""
        return self._gguf_name(hf_name) in self._tensors

    def read(self, hf_name: str) -> np.ndarray:
        """Dequantize one tensor to float32 in HF layout ([out, in] for projections)."""
        name = self._gguf_name(hf_name)
        tensor = self._tensors.get(name)
        if tensor is None:
            raise CheckpointError(f"{self.path}: tensor {name} ({hf_name}) not found")
        import gguf

        qtype = gguf.GGMLQuantizationType(tensor.ggml_type)
        try:
            data = gguf.quants.dequantize(tensor.data, qtype)
        except NotImplementedError:
            raise CheckpointError(
                f"{self.path}: tensor {name} has ggml type {qtype.name}, which gguf cannot dequantize"
            ) from None
        w = np.asarray(data, dtype=np.float32).reshape(tensor.shape)
        if self.spec.model_type == "llama":  # only llama.cpp's llama converter permutes Q/K
            if name.endswith("attn_q.weight"):
                w = _unpermute_rotary(w, self.spec.num_heads)
            elif name.endswith("attn_k.weight"):
                w = _unpermute_rotary(w, self.spec.num_kv_heads)
        return w
