"""What a vision-language checkpoint's ``config.json`` says of its vision tower and projector,
read without JAX (the front end needs the placeholder token and the tokens per image too)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from myserve.errors import CheckpointError

VISION_MODEL_TYPES = ("llava", "gemma3")
"""``config.json`` model types whose checkpoints take images."""

_ACTIVATIONS = ("quick_gelu", "gelu", "gelu_pytorch_tanh")
_TOWERS = {"llava": "clip_vision_model", "gemma3": "siglip_vision_model"}


@dataclasses.dataclass(frozen=True)
class VisionSpec:
    """A checkpoint's vision tower and projector, from its ``config.json``.

    Two families: ``llava`` (a CLIP tower with a class token, the hidden states of one layer, a
    two-layer MLP projector) and ``gemma3`` (a SigLIP tower, its final norm, the patches average-pooled
    to ``pooled_tokens``, Gemma's RMSNorm and one projection; its image tokens attend to each other
    both ways in the language model)."""

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

    @property
    def num_patches(self) -> int:
        """Patches per image (the tower's sequence, the class token aside)."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_image(self) -> int:
        """Placeholder tokens (and embeddings) of one image in the prompt."""
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

    def prompt_text(self, token: Callable[[int], str]) -> tuple[str, str]:
        """(what the chat template writes for an image, the text that replaces it: the image's
        tokens and the family's markers around them), as the checkpoint's processor expands it;
        ``token`` names a token id."""
        tokens = token(self.image_token_id) * self.tokens_per_image
        if self.family == "gemma3":
            begin, end = token(self.placeholder_token_id), token(self.end_token_id)
            return begin, f"\n\n{begin}{tokens}{end}\n\n"
        return token(self.placeholder_token_id), tokens


def vision_spec_from_hf_config(cfg: Mapping[str, Any], source: str) -> VisionSpec | None:
    """The vision tower of a parsed ``config.json`` (None for a text-only model)."""
    family = cfg.get("model_type")
    if family not in VISION_MODEL_TYPES:
        return None
    try:
        vision = dict(cfg["vision_config"])
        tower = vision.get("model_type", _TOWERS[family])
        if tower != _TOWERS[family]:
            raise CheckpointError(f"{source}: {family} with a {tower!r} vision tower is not supported")
        text = dict(cfg.get("text_config") or {})
        num_layers = int(vision.get("num_hidden_layers", 12))
        fields: dict[str, Any] = dict(
            family=family,
            image_size=int(vision.get("image_size", 224)),
            patch_size=int(vision.get("patch_size", 32)),
            hidden_size=int(vision.get("hidden_size", 768)),
            intermediate_size=int(vision.get("intermediate_size", 3072)),
            num_layers=num_layers,
            num_heads=int(vision.get("num_attention_heads", 12)),
            layer_norm_eps=float(vision.get("layer_norm_eps", 1e-5 if family == "llava" else 1e-6)),
            text_hidden_size=int(text.get("hidden_size", 4096 if family == "llava" else 2304)),
        )
        fields |= _llava_fields(cfg, vision, num_layers, source) if family == "llava" else _gemma3_fields(cfg, fields)
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
