"""What a vision-language checkpoint's ``config.json`` says of its vision tower and projector,
read without JAX (the front end needs the placeholder token and the tokens per image too)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from myserve.errors import CheckpointError

VISION_MODEL_TYPES = ("llava",)
"""``config.json`` model types whose checkpoints take images."""

_ACTIVATIONS = ("quick_gelu", "gelu", "gelu_pytorch_tanh")


@dataclasses.dataclass(frozen=True)
class VisionSpec:
    """A checkpoint's vision tower and projector, from its ``config.json``."""

    image_size: int
    """Pixels per side of the tower's input (the processor resizes and crops to it)."""
    patch_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layer_norm_eps: float
    hidden_act: str
    """The encoder MLP's activation (CLIP: ``quick_gelu``)."""
    feature_layer: int
    """Which hidden state feeds the projector: an index into (embeddings, layer 1, ..., layer L)."""
    keep_class_token: bool
    """``vision_feature_select_strategy: full``: the class token's feature is an image token too."""
    projector_act: str
    projector_bias: bool
    text_hidden_size: int
    image_token_id: int
    """The placeholder token the prompt carries at each of an image's positions."""

    @property
    def num_patches(self) -> int:
        """Patches per image (the tower's sequence, the class token aside)."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_image(self) -> int:
        """Placeholder tokens (and embeddings) of one image in the prompt."""
        return self.num_patches + int(self.keep_class_token)

    @property
    def layers_run(self) -> int:
        """Encoder layers whose output reaches the projector (those after ``feature_layer`` are skipped)."""
        return self.feature_layer % (self.num_layers + 1)


def vision_spec_from_hf_config(cfg: Mapping[str, Any], source: str) -> VisionSpec | None:
    """The vision tower of a parsed ``config.json`` (None for a text-only model)."""
    if cfg.get("model_type") not in VISION_MODEL_TYPES:
        return None
    try:
        vision = dict(cfg["vision_config"])
        if vision.get("model_type", "clip_vision_model") != "clip_vision_model":
            raise CheckpointError(
                f"{source}: LLaVA with a {vision.get('model_type')!r} vision tower is not supported (CLIP only)"
            )
        text = dict(cfg.get("text_config") or {})
        layer = cfg.get("vision_feature_layer", -2)
        if not isinstance(layer, int):
            raise CheckpointError(f"{source}: vision_feature_layer {layer!r}: only one layer is supported")
        strategy = cfg.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise CheckpointError(f"{source}: unknown vision_feature_select_strategy {strategy!r}")
        act, projector_act = vision.get("hidden_act", "quick_gelu"), cfg.get("projector_hidden_act", "gelu")
        for name in (act, projector_act):
            if name not in _ACTIVATIONS:
                raise CheckpointError(f"{source}: unsupported vision activation {name!r}")
        num_layers = int(vision.get("num_hidden_layers", 12))
        if not -(num_layers + 1) <= layer <= num_layers:
            raise CheckpointError(f"{source}: vision_feature_layer {layer} is outside the tower's {num_layers} layers")
        return VisionSpec(
            image_size=int(vision.get("image_size", 224)),
            patch_size=int(vision.get("patch_size", 32)),
            hidden_size=int(vision.get("hidden_size", 768)),
            intermediate_size=int(vision.get("intermediate_size", 3072)),
            num_layers=num_layers,
            num_heads=int(vision.get("num_attention_heads", 12)),
            layer_norm_eps=float(vision.get("layer_norm_eps", 1e-5)),
            hidden_act=act,
            feature_layer=layer,
            keep_class_token=strategy == "full",
            projector_act=projector_act,
            projector_bias=bool(cfg.get("multimodal_projector_bias", True)),
            text_hidden_size=int(text.get("hidden_size", 4096)),
            image_token_id=int(cfg.get("image_token_index", cfg.get("image_token_id", 32000))),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: invalid or missing vision config field: {e}") from None
