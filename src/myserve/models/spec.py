"""ModelSpec: the architecture hyperparameters one model needs, read from an HF ``config.json``.

The model code never looks at a transformers config object: loaders (safetensors or GGUF) turn
whatever they read into this one frozen, hashable dataclass, which is also what jitted functions
take as a static argument.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from myserve.errors import CheckpointError

# model_type -> family. Every family shares models/llama.py; the flags below say how they differ.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
"""Model types whose MLP is a Mixture-of-Experts block (``models/moe.py``)."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1-style frequency scaling of rotary embeddings (``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Hyperparameters of a Llama-family decoder (Llama 2/3.x, TinyLlama, SmolLM2, Mistral, Qwen2/3)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    """Bias on the q/k/v projections (Qwen2, or Llama with ``attention_bias``)."""
    o_bias: bool = False
    """Bias on the output projection (Llama with ``attention_bias``; not Qwen2)."""
    qk_norm: bool = False
    """RMSNorm over head_dim on q and k before rotary (Qwen3)."""
    mlp_bias: bool = False
    sliding_window: int | None = None
    num_experts: int = 0
    """Routed experts per MoE layer; 0 = a dense MLP (every layer of a MoE model is MoE)."""
    experts_per_token: int = 0
    """Experts each token is routed to (top-k of the router's softmax)."""
    expert_intermediate_size: int = 0
    """Hidden width of one routed expert's MLP."""
    norm_topk_prob: bool = True
    """Renormalise the top-k routing weights to sum to 1 (Mixtral always; Qwen as configured)."""
    shared_expert_intermediate_size: int = 0
    """Width of the always-on shared expert, gated by a sigmoid of one projection (Qwen2-MoE); 0 = none."""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def is_moe(self) -> bool:
        """Whether the MLPs are Mixture-of-Experts blocks."""
        return self.num_experts > 0

    @property
    def q_per_kv(self) -> int:
        """Query heads sharing one KV head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads


def _rope_params(cfg: Mapping[str, Any]) -> tuple[float, RopeScaling | None, str]:
    """Rotary theta and scaling from either the transformers>=5 ``rope_parameters`` or older keys."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None, rope_type
    if rope_type == "llama3":
        scaling = RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
        return theta, scaling, rope_type
    return theta, None, str(rope_type)


def spec_from_hf_config(cfg: Mapping[str, Any], source: str) -> ModelSpec:
    """Build a ModelSpec from a parsed ``config.json``; ``source`` names the file for error messages."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = cfg.get("architectures") or [model_type]
        raise CheckpointError(
            f"{source}: unsupported architecture {archs[0]!r} (model_type={model_type!r}); "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{source}: unsupported hidden_act {cfg.get('hidden_act')!r} (only silu)")
    theta, scaling, rope_type = _rope_params(cfg)
    if rope_type not in ("default", "llama3"):
        raise CheckpointError(f"{source}: unsupported rope type {rope_type!r} (supported: default, llama3)")
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        attention_bias = bool(cfg.get("attention_bias", False))
        sliding = cfg.get("sliding_window")
        if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not cfg.get("use_sliding_window", False):
            sliding = None  # Qwen configs carry a window size even when it is switched off
        return ModelSpec(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type in ("qwen2", "qwen2_moe") or attention_bias,
            o_bias=model_type not in ("qwen2", "qwen2_moe") and attention_bias,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=int(sliding) if sliding else None,
            **(_moe_fields(cfg, model_type, source) if model_type in MOE_MODEL_TYPES else {}),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: invalid or missing config field: {e}") from None


def _moe_fields(cfg: Mapping[str, Any], model_type: str, source: str) -> dict[str, Any]:
    """The Mixture-of-Experts fields of a MoE config. Mixtral's experts are ``intermediate_size``
    wide and always renormalise the top-k weights; Qwen's are ``moe_intermediate_size`` wide and
    renormalise when ``norm_topk_prob``. Configs with dense layers among the MoE ones
    (``mlp_only_layers``, ``decoder_sparse_step`` > 1) are refused: no released checkpoint uses them."""
    if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step") or 1) != 1:
        raise CheckpointError(
            f"{source}: MoE configs with dense layers (mlp_only_layers, decoder_sparse_step > 1) are not supported"
        )
    experts = cfg.get("num_local_experts") if model_type == "mixtral" else cfg.get("num_experts")
    experts = experts or cfg.get("num_local_experts") or cfg.get("num_experts")
    width = cfg["intermediate_size"] if model_type == "mixtral" else cfg["moe_intermediate_size"]
    fields = dict(
        num_experts=int(experts),
        experts_per_token=int(cfg["num_experts_per_tok"]),
        expert_intermediate_size=int(width),
        norm_topk_prob=model_type == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
    )
    if not 0 < fields["experts_per_token"] <= fields["num_experts"]:
        raise CheckpointError(
            f"{source}: num_experts_per_tok {fields['experts_per_token']} must be in 1..{fields['num_experts']}"
        )
    return fields


def check_max_len(spec: ModelSpec, max_model_len: int, source: str) -> None:
    """Refuse a context length this implementation would compute wrongly (no sliding window yet)."""
    if spec.sliding_window is not None and max_model_len > spec.sliding_window:
        raise CheckpointError(
            f"{source}: max_model_len {max_model_len} exceeds the sliding window {spec.sliding_window}; "
            f"sliding-window attention is not implemented, set model.max_model_len <= {spec.sliding_window}"
        )
