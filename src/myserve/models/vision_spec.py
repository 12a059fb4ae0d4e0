"""What a vision-language checkpoint's ``config.json`` says of its vision tower and projector,
read without JAX (the front end needs the placeholder token and the tokens per image too)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from myserve.errors import CheckpointError

VISION_MODEL_TYPES = ("llava", "gemma3", "qwen2_5_vl")
"""``config.json`` model types whose checkpoints take images."""

_ACTIVATIONS = ("quick_gelu", "gelu", "gelu_pytorch_tanh", "silu")
_TOWERS = {"llava": "clip_vision_model", "gemma3": "siglip_vision_model", "qwen2_5_vl": "qwen2_5_vl_vision"}


@dataclasses.dataclass(frozen=True)
class VisionSpec:
    """A checkpoint's vision tower and projector, from its ``config.json``.

    Three families: ``llava`` (a CLIP tower with a class token, the hidden states of one layer, a
    two-layer MLP projector), ``gemma3`` (a SigLIP tower, its final norm, the patches average-pooled
    to ``pooled_tokens``, Gemma's RMSNorm and one projection; its image tokens attend to each other
    both ways in the language model) and ``qwen2_5_vl`` (its own ViT over a grid of patches that
    follows each image's size and shape, window attention in most layers, 2D rotary positions, each
    ``merge_size`` x ``merge_size`` patches merged into one token by an MLP; the language model
    places an image's tokens by M-RoPE's three position streams)."""

    family: str
    image_size: int
    """Pixels per side of the tower's input (the processor resizes and crops to it)."""
    patch_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layer_norm_eps: float
    hidden_act: str
    """The encoder MLP's activation (CLIP: ``quick_gelu``; SigLIP: ``gelu_pytorch_tanh``)."""
    feature_layer: int
    """Which hidden state feeds the projector: an index into (embeddings, layer 1, ..., layer L)."""
    keep_class_token: bool
    """``vision_feature_select_strategy: full``: the class token's feature is an image token too."""
    projector_act: str
    projector_bias: bool
    text_hidden_size: int
    image_token_id: int
    """The token the prompt carries at each of an image's positions."""
    placeholder_token_id: int
    """The token a chat template writes for an image (LLaVA: the image token; Gemma 3: ``<start_of_image>``)."""
    end_token_id: int = -1
    """Gemma 3's ``<end_of_image>`` after an image's tokens (-1: none)."""
    pooled_tokens: int = 0
    """Gemma 3: tokens per image after pooling the patches (a square); 0: one per patch."""
    temporal_patch_size: int = 1
    """Qwen2.5-VL: frames per patch (an image is its own frame twice)."""
    merge_size: int = 1
    """Qwen2.5-VL: patches per side merged into one token."""
    window_size: int = 0
    """Qwen2.5-VL: pixels per side of an attention window (its layers outside ``full_layers``)."""
    full_layers: tuple[int, ...] = ()
    """Qwen2.5-VL: the encoder layers that attend over the whole image."""
    rope_theta: float = 10000.0
    """Qwen2.5-VL: the tower's 2D rotary base."""

    @property
    def num_patches(self) -> int:
        """Patches per image (the tower's sequence, the class token aside)."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def variable_size(self) -> bool:
        """Whether each image keeps its own size (Qwen2.5-VL: a grid of patches, and as many tokens,
        per image), rather than being resized to ``image_size``."""
        return self.family == "qwen2_5_vl"

    @property
    def tokens_per_image(self) -> int:
        """Placeholder tokens (and embeddings) of one image in the prompt (0: it depends on the
        image's grid, ``variable_size``)."""
        if self.variable_size:
            return 0
        if self.pooled_tokens:
            return self.pooled_tokens
        return self.num_patches + int(self.keep_class_token)

    @property
    def layers_run(self) -> int:
        """Encoder layers whose output reaches the projector (those after ``feature_layer`` are skipped)."""
        return self.feature_layer % (self.num_layers + 1)

    @property
    def bidirectional(self) -> bool:
        """Whether an image's tokens attend to each other both ways in the language model (Gemma 3,
        as transformers masks them), so a prefill chunk must hold an image's tokens whole."""
        return self.family == "gemma3"

    def prompt_text(self, token: Callable[[int], str]) -> tuple[str, str, str, str]:
        """How the checkpoint's processor expands what the chat template writes for an image: (that
        mark, the text before the image's tokens, the image token, the text after them); ``token``
        names a token id. The image token is repeated once per token of the image."""
        if self.family == "gemma3":
            begin, end = token(self.placeholder_token_id), token(self.end_token_id)
            return begin, f"\n\n{begin}", token(self.image_token_id), f"{end}\n\n"
        return token(self.placeholder_token_id), "", token(self.image_token_id), ""


def vision_spec_from_hf_config(cfg: Mapping[str, Any], source: str) -> VisionSpec | None:
    """The vision tower of a parsed ``config.json`` (None for a text-only model)."""
    family = cfg.get("model_type")
    if family not in VISION_MODEL_TYPES:
        return None
    try:
        vision = dict(cfg["vision_config"])
        tower = vision.get("model_type", _TOWERS[family])
        if tower != _TOWERS[family] and not (family == "qwen2_5_vl" and tower == family):  # (older Qwen configs)
            raise CheckpointError(f"{source}: {family} with a {tower!r} vision tower is not supported")
        text = dict(cfg.get("text_config") or {})
        num_layers = int(vision.get("num_hidden_layers") or vision.get("depth") or 12)
        fields: dict[str, Any] = dict(
            family=family,
            image_size=int(vision.get("image_size", 224)),
            patch_size=int(vision.get("patch_size", 32)),
            hidden_size=int(vision.get("hidden_size", 768)),
            intermediate_size=int(vision.get("intermediate_size", 3072)),
            num_layers=num_layers,
            num_heads=int(vision.get("num_attention_heads") or vision.get("num_heads") or 12),
            layer_norm_eps=float(vision.get("layer_norm_eps", 1e-5 if family == "llava" else 1e-6)),
            text_hidden_size=int(text.get("hidden_size", 4096 if family == "llava" else 2304)),
        )
        if family == "llava":
            fields |= _llava_fields(cfg, vision, num_layers, source)
        elif family == "gemma3":
            fields |= _gemma3_fields(cfg, fields)
        else:
            fields |= _qwen_fields(cfg, vision, num_layers)
        for name in (fields["hidden_act"], fields["projector_act"]):
            if name not in _ACTIVATIONS:
                raise CheckpointError(f"{source}: unsupported vision activation {name!r}")
        return VisionSpec(**fields)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: invalid or missing vision config field: {e}") from None


def _llava_fields(cfg: Mapping[str, Any], vision: Mapping[str, Any], num_layers: int, source: str) -> dict[str, Any]:
    layer = cfg.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise CheckpointError(f"{source}: vision_feature_layer {layer!r}: only one layer is supported")
    if not -(num_layers + 1) <= layer <= num_layers:
        raise CheckpointError(f"{source}: vision_feature_layer {layer} is outside the tower's {num_layers} layers")
    strategy = cfg.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise CheckpointError(f"{source}: unknown vision_feature_select_strategy {strategy!r}")
    image_token = int(cfg.get("image_token_index", cfg.get("image_token_id", 32000)))
    return dict(
        hidden_act=vision.get("hidden_act", "quick_gelu"),
        feature_layer=layer,
        keep_class_token=strategy == "full",
        projector_act=cfg.get("projector_hidden_act", "gelu"),
        projector_bias=bool(cfg.get("multimodal_projector_bias", True)),
        image_token_id=image_token,
        placeholder_token_id=image_token,
    )


def _gemma3_fields(cfg: Mapping[str, Any], common: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 3: every encoder layer and the final norm, pooled to ``mm_tokens_per_image`` (a square
    whose side divides the patch grid's)."""
    pooled = int(cfg.get("mm_tokens_per_image", 256))
    side, grid = round(pooled**0.5), common["image_size"] // common["patch_size"]
    if side * side != pooled or grid % side:
        raise ValueError(f"mm_tokens_per_image {pooled} does not pool a {grid}x{grid} patch grid")
    return dict(
        hidden_act=dict(cfg["vision_config"]).get("hidden_act", "gelu_pytorch_tanh"),
        feature_layer=-1,
        keep_class_token=False,
        projector_act="gelu",  # (no activation: Gemma's projector is a norm and one matmul)
        projector_bias=False,
        image_token_id=int(cfg.get("image_token_index", 262144)),
        placeholder_token_id=int(cfg.get("boi_token_index", 255999)),
        end_token_id=int(cfg.get("eoi_token_index", 256000)),
        pooled_tokens=pooled,
    )


def _qwen_fields(cfg: Mapping[str, Any], vision: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """Qwen2.5-VL: every encoder layer, RMSNorms, SwiGLU MLPs, the merger into ``out_hidden_size``."""
    full = tuple(int(i) for i in vision.get("fullatt_block_indexes", (7, 15, 23, 31)))
    rope = dict(vision.get("rope_parameters") or {})
    image_token = int(cfg.get("image_token_id", cfg.get("image_token_index", 151655)))
    return dict(
        image_size=0,
        text_hidden_size=int(vision.get("out_hidden_size", 3584)),
        layer_norm_eps=1e-6,
        hidden_act=vision.get("hidden_act", "silu"),
        feature_layer=-1,
        keep_class_token=False,
        projector_act="gelu",  # the merger's (exact) GELU
        projector_bias=True,
        image_token_id=image_token,
        placeholder_token_id=image_token,
        temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
        merge_size=int(vision.get("spatial_merge_size", 2)),
        window_size=int(vision.get("window_size", 112)),
        full_layers=tuple(i for i in full if i < num_layers),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
    )
