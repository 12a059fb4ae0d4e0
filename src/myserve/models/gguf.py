"""GGUF checkpoints: metadata to ModelSpec, and tensors dequantized one at a time under HF names.

The header is parsed by ``gguf_file.read_gguf`` over a memory map; the ``gguf`` package dequantizes
each tensor with numpy (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K and the other ggml types it
knows), so only one tensor is ever materialised as float32 on the host.

Mixture-of-Experts files (``qwen3moe``, ``qwen2moe``, and Mixtral filed under ``llama`` with an
``expert_count``) stack each layer's experts in 3-D tensors. llama.cpp's converter ``torch.stack``s
the HF ``[out, in]`` matrices, so the numpy shape (ggml dims reversed) is ``[experts, out, in]``:
exactly transformers 5's fused layout. The source answers the fused HF names from them
(``experts.gate_up_proj`` = gate and up concatenated on axis 1, or the fused ``ffn_gate_up_exps``;
``experts.down_proj``), so the loader's fused path reads a layer's experts in two reads.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from myserve.errors import CheckpointError
from myserve.models.gguf_blocks import Blocks, read_blocks
from myserve.models.gguf_file import GGUFTensorInfo, read_gguf
from myserve.models.narrow_host import BlockLayout
from myserve.models.spec import ModelSpec

# GGUF general.architecture -> HF model_type. llama.cpp files Mistral under "llama", and Mixtral
# too (with {arch}.expert_count: model_type "mixtral").
_GGUF_ARCHES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
_MOE_ARCHES = ("qwen2moe", "qwen3moe")

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
# HF suffix after a MoE layer's "mlp." (Mixtral: "block_sparse_moe.") -> GGUF per-block name.
_MOE_NAMES = {
    "gate.weight": "ffn_gate_inp.weight",
    "experts.down_proj": "ffn_down_exps.weight",
    "shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_MOE_RE = re.compile(r"(?:mlp|block_sparse_moe)\.(.+)")
# Mixtral GGUFs converted before llama.cpp stacked experts (early 2024): one 2-D tensor per expert.
_LEGACY_EXPERT_RE = re.compile(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")
_LEGACY_EXPERT = {"w1": "ffn_gate", "w2": "ffn_down", "w3": "ffn_up"}

_F16, _F32 = np.dtype(np.float16), np.dtype(np.float32)
# ggml types kept narrow (models/gguf_blocks.py), by type id: bits, group, offset, scale dtype.
KEPT_LAYOUTS = {
    8: BlockLayout(8, 32, False, _F16),  # Q8_0
    2: BlockLayout(4, 32, True, _F16),  # Q4_0
    3: BlockLayout(4, 32, True, _F16),  # Q4_1
    12: BlockLayout(4, 32, True, _F32),  # Q4_K
    14: BlockLayout(8, 16, False, _F32),  # Q6_K
}


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
        moe = self._moe_fields(arch, get)
        return ModelSpec(
            model_type="mixtral" if moe and arch == "llama" else _GGUF_ARCHES[arch],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length", moe.get("expert_intermediate_size"))),
            num_layers=int(get("block_count")),
            num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=int(get("attention.key_length", hidden // heads)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            max_position_embeddings=int(get("context_length")),
            tie_word_embeddings="output.weight" not in self._tensors,
            qkv_bias=arch in ("qwen2", "qwen2moe"),
            qk_norm=arch in ("qwen3", "qwen3moe"),
            **moe,
        )

    def _moe_fields(self, arch: str, get: Any) -> dict[str, Any]:
        """The MoE fields of ModelSpec ({} for a dense file), as llama.cpp reads them: an expert's
        width is ``expert_feed_forward_length``, else ``feed_forward_length`` (Mixtral, ``llama``)
        or that over ``expert_used_count`` (Qwen). llama.cpp renormalises the top-k routing weights
        for qwen3moe and Mixtral whatever the HF config said, never for qwen2moe."""
        experts = int(self.field(f"{arch}.expert_count", 0) or 0)
        if not experts:
            if arch in _MOE_ARCHES:
                raise CheckpointError(f"{self.path}: GGUF metadata {arch}.expert_count is missing")
            return {}
        used = int(get("expert_used_count"))
        if not 0 < used <= experts:
            raise CheckpointError(f"{self.path}: GGUF {arch}.expert_used_count {used} must be in 1..{experts}")
        width = self.field(f"{arch}.expert_feed_forward_length")
        if width is None:
            width = int(get("feed_forward_length")) // (1 if arch == "llama" else used)
        shared = 0
        if arch == "qwen2moe":
            shared = self.field(f"{arch}.expert_shared_feed_forward_length") or get("feed_forward_length")
        return dict(
            num_experts=experts,
            experts_per_token=used,
            expert_intermediate_size=int(width),
            norm_topk_prob=arch != "qwen2moe",
            shared_expert_intermediate_size=int(shared),
        )

    def _gguf_names(self, hf_name: str) -> tuple[str, ...]:
        """The GGUF tensor(s) an HF name is read from: one, or gate and up for a fused gate_up."""
        if hf_name in _GLOBAL_NAMES:
            return (_GLOBAL_NAMES[hf_name],)
        m = _LAYER_RE.fullmatch(hf_name)
        if not m:
            return (hf_name,)
        blk, suffix = f"blk.{m.group(1)}.", m.group(2)
        if suffix in _LAYER_NAMES:
            return (blk + _LAYER_NAMES[suffix],)
        moe = _MOE_RE.fullmatch(suffix)
        if moe and moe.group(1) == "experts.gate_up_proj":
            if blk + "ffn_gate_up_exps.weight" in self._tensors:  # llama.cpp's own fused form, gate first
                return (blk + "ffn_gate_up_exps.weight",)
            return (blk + "ffn_gate_exps.weight", blk + "ffn_up_exps.weight")
        if moe and moe.group(1) in _MOE_NAMES:
            return (blk + _MOE_NAMES[moe.group(1)],)
        legacy = _LEGACY_EXPERT_RE.fullmatch(suffix)
        if legacy:
            return (f"{blk}{_LEGACY_EXPERT[legacy.group(2)]}.{legacy.group(1)}.weight",)
        return (hf_name,)

    def has(self, hf_name: str) -> bool:
        """Whether the file holds this tensor (a fused one: all its parts)."""
        return all(name in self._tensors for name in self._gguf_names(hf_name))

    def read(self, hf_name: str) -> np.ndarray:
        """Dequantize one tensor to float32 in HF layout ([out, in] for projections; stacked experts
        [experts, out, in], a fused gate_up [experts, 2 * width, in])."""
        parts = [self._dequantize(name, hf_name) for name in self._gguf_names(hf_name)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)

    def narrowest(self) -> str:
        """The quantization that keeps this file's matrices as stored: ``int4`` when any is a kept
        4-bit block type, ``int8`` when some are kept 8-bit ones, else ``none`` (a float file)."""
        kept = {KEPT_LAYOUTS[t.ggml_type].bits for t in self._tensors.values() if t.ggml_type in KEPT_LAYOUTS}
        return "int4" if 4 in kept else "int8" if kept else "none"

    def block_layout(self, hf_name: str) -> BlockLayout | None:
        """The narrow layout of an HF name's tensor from the header alone: that of its GGUF
        tensor(s) when they are one kept block type (``KEPT_LAYOUTS``), else None."""
        types = {self._tensor(name, hf_name).ggml_type for name in self._gguf_names(hf_name)}
        return KEPT_LAYOUTS.get(types.pop()) if len(types) == 1 else None

    def read_blocks(self, hf_name: str) -> Blocks | None:
        """An HF name's tensor as its quantized blocks, not widened, rows in HF order (Q/K
        un-permuted and fused parts concatenated, like ``read``); None unless ``block_layout`` is one."""
        if self.block_layout(hf_name) is None:
            return None
        parts: list[Blocks] = []
        for name in self._gguf_names(hf_name):
            t = self._tensor(name, hf_name)
            b = read_blocks(t.data, t.ggml_type, t.shape)
            assert b is not None, f"{name}: a kept type must repack"
            heads = self._permuted_heads(name)
            if heads:
                offset = None if b.offset is None else _unpermute_rotary(b.offset, heads)
                b = Blocks(
                    _unpermute_rotary(b.codes, heads), _unpermute_rotary(b.scale, heads), offset, b.group, b.bits
                )
            parts.append(b)
        if len(parts) == 1:
            return parts[0]
        # Gate and up of stacked experts (one ggml type): their rows concatenated, as read() does.
        offsets = [p.offset for p in parts]
        return Blocks(
            np.concatenate([p.codes for p in parts], axis=1),
            np.concatenate([p.scale for p in parts], axis=1),
            None if offsets[0] is None else np.concatenate(offsets, axis=1),  # type: ignore[arg-type]
            parts[0].group,
            parts[0].bits,
        )

    def _permuted_heads(self, name: str) -> int:
        """Heads whose rows llama.cpp's llama converter permuted in this tensor (0: none)."""
        if self.spec.model_type not in ("llama", "mixtral"):
            return 0
        if name.endswith("attn_q.weight"):
            return self.spec.num_heads
        return self.spec.num_kv_heads if name.endswith("attn_k.weight") else 0

    def _tensor(self, name: str, hf_name: str) -> GGUFTensorInfo:
        tensor = self._tensors.get(name)
        if tensor is None:
            raise CheckpointError(f"{self.path}: tensor {name} ({hf_name}) not found")
        return tensor

    def _dequantize(self, name: str, hf_name: str) -> np.ndarray:
        tensor = self._tensor(name, hf_name)
        import gguf

        qtype = gguf.GGMLQuantizationType(tensor.ggml_type)
        try:
            data = gguf.quants.dequantize(tensor.data, qtype)
        except NotImplementedError:
            raise CheckpointError(
                f"{self.path}: tensor {name} has ggml type {qtype.name}, which gguf cannot dequantize"
            ) from None
        w = np.asarray(data, dtype=np.float32).reshape(tensor.shape)
        heads = self._permuted_heads(name)  # only llama.cpp's llama converter permutes Q/K
        return _unpermute_rotary(w, heads) if heads else w


def resolve_quantization(value: str, source: object, where: str) -> str:
    """``model.quantization`` for a checkpoint (its tensor source) on platform ``where``: as
    configured unless ``auto``, which is ``none`` on CPU (XLA:CPU widens a narrow weight in memory
    on every step, several times slower than reading float32: docs/performance.md) and on TPU/GPU a
    GGUF file's blocks as stored (``int4`` / ``int8``); a float checkpoint stays in the model dtype."""
    if value != "auto":
        return value
    if where == "cpu" or not isinstance(source, GGUFSource):
        return "none"
    return source.narrowest()
