"""ModelSpec: the architecture hyperparameters one model needs, read from an HF ``config.json``.

The model code never looks at a transformers config object: loaders (safetensors or GGUF) turn
whatever they read into this one frozen, hashable dataclass, which is also what jitted functions
take as a static argument.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from myserve.errors import CheckpointError
from myserve.models.vision_spec import VISION_MODEL_TYPES

# model_type -> family. Every family shares models/llama.py; the flags below say how they differ.
SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3_text",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
)
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
"""Model types whose MLP is a Mixture-of-Experts block (``models/moe.py``)."""

HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
"""MLP gate activations: SwiGLU's silu, and GeGLU's GELU with the tanh approximation (Gemma)."""

LAYER_TYPES = ("full", "sliding")
"""Per-layer attention: over the whole context, or over the last ``sliding_window`` positions."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1-style frequency scaling of rotary embeddings (``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class LinearRopeScaling:
    """Linear position interpolation (``rope_type: linear``): every inverse frequency divided by
    ``factor`` (Gemma 3's global layers use factor 8)."""

    factor: float


Scaling = RopeScaling | LinearRopeScaling


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """What may differ between one model's layers: the attention window and the rotary table.

    Hashable, so the step traces one layer function per distinct kind (``runtime/model_step.py``):
    Gemma's sliding and global layers are two kinds, every layer of a Llama one."""

    window: int | None
    """A query at position p sees keys at positions k with p - window < k <= p; None: all k <= p."""
    rope_theta: float
    rope_scaling: Scaling | None = None


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Hyperparameters of a decoder of the Llama family (Llama 2/3.x, TinyLlama, SmolLM2, Mistral,
    Qwen2/3) or of Gemma 2/3 (text). Every field after ``tie_word_embeddings`` defaults to Llama's
    behaviour."""

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
    rope_scaling: Scaling | None = None
    """Scaling of the rotary frequencies (of the global layers, where local ones differ)."""
    qkv_bias: bool = False
    """Bias on the q/k/v projections (Qwen2, or Llama with ``attention_bias``)."""
    o_bias: bool = False
    """Bias on the output projection (Llama with ``attention_bias``; not Qwen2)."""
    qk_norm: bool = False
    """RMSNorm over head_dim on q and k before rotary (Qwen3, Gemma 3)."""
    mlp_bias: bool = False
    sliding_window: int | None = None
    """The window of the layers ``layer_types`` marks ``sliding``."""
    layer_types: tuple[str, ...] = ()
    """Per layer, ``full`` or ``sliding`` attention; empty: every layer full."""
    local_rope_theta: float | None = None
    """Rotary theta of the sliding layers, unscaled (Gemma 3); None: they share the global rotary."""
    hidden_act: str = "silu"
    """The MLP's gate activation, one of ``HIDDEN_ACTS``."""
    embed_scale: float | None = None
    """Embeddings are multiplied by this, rounded to float32 then to the model dtype as
    transformers does (Gemma: sqrt(hidden_size)); None: not scaled."""
    norm_unit_offset: bool = False
    """Gemma's RMSNorm scales by ``1 + w``, in float32 before the cast to the model dtype. The loader
    adds the 1 to every norm weight and keeps them float32 (``models/loading.py``)."""
    sandwich_norms: bool = False
    """Gemma 2/3: RMSNorms on the attention output and on the MLP output before each residual add."""
    attn_softcap: float | None = None
    """Attention scores (after scaling) become ``cap * tanh(s / cap)`` before masking (Gemma 2)."""
    final_softcap: float | None = None
    """Logits become ``cap * tanh(logits / cap)`` (Gemma 2, and Gemma 3 when its config sets it)."""
    query_scale: float | None = None
    """The attention's score scale; None: ``1 / sqrt(head_dim)`` (Gemma: ``query_pre_attn_scalar ** -0.5``)."""
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
    bidirectional_images: bool = False
    """An image's tokens attend to each other both ways, the rest causally (Gemma 3's language model
    under its vision tower): a step holding image tokens masks by each token's last visible position."""
    mrope_section: tuple[int, ...] = ()
    """M-RoPE (Qwen2.5-VL): the rotary frequencies split in sections read the temporal, height and
    width position streams in turn; empty: one position per token (``RaggedBatch.rope_positions``)."""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"{len(self.layer_types)} layer_types for {self.num_layers} layers")
        if not set(self.layer_types) <= set(LAYER_TYPES):
            raise ValueError(f"layer_types {sorted(set(self.layer_types))} not in {LAYER_TYPES}")
        if "sliding" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding layers need a sliding_window")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act {self.hidden_act!r} not in {HIDDEN_ACTS}")

    @property
    def is_moe(self) -> bool:
        """Whether the MLPs are Mixture-of-Experts blocks."""
        return self.num_experts > 0

    @property
    def q_per_kv(self) -> int:
        """Query heads sharing one KV head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    @property
    def sm_scale(self) -> float:
        """The attention's score scale (``query_scale``, else ``1 / sqrt(head_dim)``)."""
        return self.query_scale if self.query_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def layer_kind(self, layer: int) -> LayerKind:
        """Layer ``layer``'s attention window and rotary table."""
        if self.layer_types and self.layer_types[layer] == "sliding":
            if self.local_rope_theta is not None:
                return LayerKind(self.sliding_window, self.local_rope_theta)
            return LayerKind(self.sliding_window, self.rope_theta, self.rope_scaling)
        return LayerKind(None, self.rope_theta, self.rope_scaling)

    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """Every layer's kind, in order."""
        return tuple(self.layer_kind(i) for i in range(self.num_layers))


def _parse_rope(params: Mapping[str, Any], default_theta: float, source: str) -> tuple[float, Scaling | None]:
    """Theta and frequency scaling of one rotary table from its parameters (``rope_parameters``
    of transformers >= 5, or the older ``rope_scaling`` merged with ``rope_theta``)."""
    theta = float(params.get("rope_theta", default_theta))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in ("default", "mrope"):  # (M-RoPE's sections: ModelSpec.mrope_section)
        return theta, None
    if rope_type == "linear":
        return theta, LinearRopeScaling(float(params["factor"]))
    if rope_type == "llama3":
        scaling = RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
        return theta, scaling
    raise CheckpointError(f"{source}: unsupported rope type {rope_type!r} (supported: default, linear, llama3)")


def _rope_params(cfg: Mapping[str, Any], source: str) -> tuple[float, Scaling | None]:
    """The model's one rotary table, from the transformers>=5 ``rope_parameters`` or older keys."""
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    return _parse_rope(params, cfg.get("rope_theta", 10000.0), source)


# transformers' config-class defaults for the Gemma keys a config.json may leave out (older
# transformers saved only the values that differ from them).
_GEMMA_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": dict(
        head_dim=256, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=4096,
        final_logit_softcapping=30.0, attn_logit_softcapping=50.0, tie_word_embeddings=True,
    ),
    "gemma3_text": dict(
        head_dim=256, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=4096,
        tie_word_embeddings=True, rope_theta=1_000_000.0,
    ),
}  # fmt: skip


def _gemma_fields(cfg: Mapping[str, Any], model_type: str, hidden: int, source: str) -> dict[str, Any]:
    """The ModelSpec fields in which Gemma 2 and Gemma 3 (text) differ from Llama."""
    if cfg.get("use_bidirectional_attention"):
        raise CheckpointError(f"{source}: bidirectional attention (an embedding model) is not supported")
    fields: dict[str, Any] = dict(
        embed_scale=hidden**0.5,
        norm_unit_offset=True,
        sandwich_norms=True,
        query_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5,
        final_softcap=_cap(cfg.get("final_logit_softcapping")),
        # Gemma 3 configs carry attn_logit_softcapping, but transformers' Gemma3Attention never applies it.
        attn_softcap=_cap(cfg.get("attn_logit_softcapping")) if model_type == "gemma2" else None,
        qk_norm=model_type == "gemma3_text",
    )
    if model_type == "gemma3_text":
        fields.update(_gemma3_rope(cfg, source))
    return fields


def _cap(value: Any) -> float | None:
    return float(value) if value else None


def _gemma3_rope(cfg: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Gemma 3's two rotary tables: global layers ``rope_theta`` with ``rope_scaling`` (linear, factor
    8, on the larger checkpoints), sliding layers ``rope_local_base_freq`` unscaled; transformers >= 5
    nests them as ``rope_parameters[full_attention | sliding_attention]``."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    else:
        full, local = {**(cfg.get("rope_scaling") or {}), **params}, {}
    theta, scaling = _parse_rope(full, cfg["rope_theta"], source)
    local_theta, local_scaling = _parse_rope(local, cfg.get("rope_local_base_freq", 10000.0), source)
    if local_scaling is not None:
        raise CheckpointError(f"{source}: rope scaling on the sliding layers is not supported")
    return dict(rope_theta=theta, rope_scaling=scaling, local_rope_theta=local_theta)


def _layer_types(cfg: Mapping[str, Any], model_type: str, num_layers: int, window: int | None) -> tuple[str, ...]:
    """Each layer's attention, ``full`` or ``sliding``: the config's ``layer_types`` where it has them,
    else each family's rule as transformers applies it to older configs."""
    if window is None:
        return ()
    named = cfg.get("layer_types")
    if named:
        kinds = {"full_attention": "full", "sliding_attention": "sliding"}
        unknown = sorted(set(named) - set(kinds))
        if unknown:
            raise ValueError(f"unsupported layer_types {unknown}")
        return tuple(kinds[t] for t in named)
    if model_type == "gemma2":  # even layers slide
        return tuple("sliding" if i % 2 == 0 else "full" for i in range(num_layers))
    if model_type == "gemma3_text":  # every N-th layer is global
        n = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
        return tuple("full" if (i + 1) % n == 0 else "sliding" for i in range(num_layers))
    if model_type in ("qwen2", "qwen3"):  # the layers from max_window_layers on slide
        first = int(cfg.get("max_window_layers", 28))
        return tuple("sliding" if i >= first else "full" for i in range(num_layers))
    return ("sliding",) * num_layers  # Mistral: every layer


def spec_from_hf_config(cfg: Mapping[str, Any], source: str) -> ModelSpec:
    """Build a ModelSpec from a parsed ``config.json``; ``source`` names the file for error messages."""
    model_type = cfg.get("model_type")
    if model_type in VISION_MODEL_TYPES:  # a vision-language checkpoint: the decoder is its text model
        text = dict(cfg.get("text_config") or {})
        default = {"gemma3": "gemma3_text", "qwen2_5_vl": "qwen2_5_vl_text"}.get(model_type, "llama")
        text_type = text.get("model_type", default)
        if text_type == "qwen2_5_vl_text":  # Qwen2's decoder, positioned by M-RoPE
            rope = {**(text.get("rope_scaling") or {}), **(text.get("rope_parameters") or {})}
            section = tuple(int(s) for s in rope.get("mrope_section", ()))
            spec = spec_from_hf_config({**text, "model_type": "qwen2"}, source)
            if sum(section) * 2 != spec.head_dim:
                raise CheckpointError(
                    f"{source}: mrope_section {list(section)} does not cover head_dim {spec.head_dim}"
                )
            return dataclasses.replace(spec, model_type="qwen2_5_vl_text", mrope_section=section)
        spec = spec_from_hf_config({**text, "model_type": text_type}, source)
        return dataclasses.replace(spec, bidirectional_images=model_type == "gemma3")
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = cfg.get("architectures") or [model_type]
        raise CheckpointError(
            f"{source}: unsupported architecture {archs[0]!r} (model_type={model_type!r}); "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    gemma = model_type in _GEMMA_DEFAULTS
    cfg = {**_GEMMA_DEFAULTS.get(model_type, {}), **cfg}
    act = cfg.get("hidden_activation") if gemma else cfg.get("hidden_act", "silu")
    if act not in HIDDEN_ACTS:
        raise CheckpointError(f"{source}: unsupported hidden activation {act!r} (supported: {', '.join(HIDDEN_ACTS)})")
    try:
        theta, scaling = _rope_params(cfg, source)
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        num_layers = int(cfg["num_hidden_layers"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        attention_bias = bool(cfg.get("attention_bias", False))
        sliding = cfg.get("sliding_window")
        if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not cfg.get("use_sliding_window", False):
            sliding = None  # Qwen configs carry a window size even when it is switched off
        window = int(sliding) if sliding else None
        fields = dict(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
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
            sliding_window=window,
            layer_types=_layer_types(cfg, model_type, num_layers, window),
            hidden_act=act,
            **(_moe_fields(cfg, model_type, source) if model_type in MOE_MODEL_TYPES else {}),
        )
        if gemma:
            fields.update(_gemma_fields(cfg, model_type, hidden, source))
        return ModelSpec(**fields)
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
    experts = experts or cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    width = cfg["intermediate_size"] if model_type == "mixtral" else cfg["moe_intermediate_size"]
    fields = dict(
        num_experts=int(experts),
        experts_per_token=int(cfg["num_experts_per_tok"]),
        expert_intermediate_size=int(width),
        norm_topk_prob=model_type == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
    )
    if not 0 < fields["experts_per_token"] <= fields["num_experts"]:  # also: no experts at all
        raise CheckpointError(
            f"{source}: num_experts_per_tok {fields['experts_per_token']} must be in 1..{fields['num_experts']}"
        )
    return fields
