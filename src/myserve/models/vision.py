"""Vision towers of vision-language checkpoints, in JAX: what turns an image into the language
model's input embeddings at the image's placeholder positions.

LLaVA (``model_type: llava``): a CLIP vision transformer (patch embedding, class token, learned
positions, pre-norm encoder layers with ``quick_gelu`` MLPs), whose hidden states after layer
``vision_feature_layer`` (-2: the one before the last; the final norm is not applied) are taken
without the class token (``vision_feature_select_strategy: default``; ``full`` keeps it), then a
two-layer MLP projector (``linear_1``, GELU, ``linear_2``) into the text model's width.

Gemma 3 (``model_type: gemma3``): a SigLIP vision transformer (patch embedding with a bias, learned
positions, no class token, the same pre-norm layers with tanh-GELU MLPs, a final LayerNorm), its
patch grid average-pooled to ``mm_tokens_per_image`` tokens, then Gemma's RMSNorm (``1 + w``, in
float32) and one projection (``mm_input_projection_weight``, already [in, out]).

The tower is small beside the language model and runs once per distinct image (the engine caches
its output by the image's content hash: ``runtime/image_encoder.py``), so its weights are plain
arrays replicated on the mesh, not haliax-named and sharded like the decoder's.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from myserve.errors import CheckpointError
from myserve.models.vision_spec import VisionSpec


class TowerSource(Protocol):
    """What the towers read a checkpoint's tensors through (``models/loading.py::SafetensorsSource``)."""

    def has(self, hf_name: str) -> bool: ...

    def read(self, hf_name: str) -> np.ndarray: ...


_TOWER_PREFIXES = (
    "vision_tower.vision_model.",
    "vision_tower.",
    "model.vision_tower.vision_model.",
    "model.vision_tower.",
)
_PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")
_PROJECTOR_PROBES = {"llava": "linear_1.weight", "gemma3": "mm_input_projection_weight"}

Tower = dict[str, Any]
"""A tower's weights as a pytree of arrays (here ``embed``, ``layers``, ``projector``; Qwen2.5-VL's:
``patch``, ``layers``, ``merger``, ``models/vision_qwen.py``)."""


def read_tower(source: TowerSource, spec: VisionSpec, dtype: Any) -> Tower:
    """The tower's and projector's weights from a checkpoint (either of transformers' namings), as
    host arrays of ``dtype`` with each projection transposed to [in, out]."""
    tower = _prefix(source, _TOWER_PREFIXES, "embeddings.patch_embedding.weight")
    projector = _prefix(source, _PROJECTOR_PREFIXES, _PROJECTOR_PROBES[spec.family])

    def get(name: str) -> np.ndarray:
        return np.asarray(source.read(name), np.float32).astype(dtype)

    def linear(name: str, bias: bool = True) -> dict[str, np.ndarray]:
        out = {"w": get(f"{name}.weight").T}
        if bias:
            out["b"] = get(f"{name}.bias")
        return out

    def norm(name: str) -> dict[str, np.ndarray]:
        return {"w": get(f"{name}.weight"), "b": get(f"{name}.bias")}

    patch = get(f"{tower}embeddings.patch_embedding.weight")  # [hidden, 3, p, p]
    layers = []
    for i in range(spec.layers_run):
        p = f"{tower}encoder.layers.{i}."
        layers.append(
            {
                "norm1": norm(p + "layer_norm1"),
                "q": linear(p + "self_attn.q_proj"),
                "k": linear(p + "self_attn.k_proj"),
                "v": linear(p + "self_attn.v_proj"),
                "o": linear(p + "self_attn.out_proj"),
                "norm2": norm(p + "layer_norm2"),
                "fc1": linear(p + "mlp.fc1"),
                "fc2": linear(p + "mlp.fc2"),
            }
        )
    embed: dict[str, Any] = {
        "patch": patch.reshape(patch.shape[0], -1).T,  # [3 * p * p, hidden], (channel, row, column) order
        "pos": get(f"{tower}embeddings.position_embedding.weight"),
    }
    if spec.family == "gemma3":  # SigLIP: a patch bias and a final norm; Gemma's projector
        embed["patch_bias"] = get(f"{tower}embeddings.patch_embedding.bias")
        embed["post_norm"] = norm(f"{tower}post_layernorm")
        projection: Tower = {
            "norm": np.asarray(source.read(f"{projector}mm_soft_emb_norm.weight"), np.float32) + 1.0,
            "w": get(f"{projector}mm_input_projection_weight"),
        }
    else:  # CLIP: a class token and a norm before the layers; LLaVA's MLP
        embed["cls"] = get(f"{tower}embeddings.class_embedding")
        embed["pre_norm"] = norm(f"{tower}pre_layrnorm")
        projection = {
            "linear_1": linear(f"{projector}linear_1", spec.projector_bias),
            "linear_2": linear(f"{projector}linear_2", spec.projector_bias),
        }
    return {"embed": embed, "layers": layers, "projector": projection}


def _prefix(source: TowerSource, prefixes: tuple[str, ...], probe: str) -> str:
    for prefix in prefixes:
        if source.has(prefix + probe):
            return prefix
    raise CheckpointError(f"the checkpoint has no vision weights (looked for {prefixes[0]}{probe} and others)")


def encode_images(spec: VisionSpec, tower: Tower, pixels: jax.Array) -> jax.Array:
    """Images [N, 3, S, S] (the processor's normalized pixels) to their token embeddings
    [N, tokens_per_image, text_hidden_size] in the tower's dtype (inside a jit)."""
    n, c, s, _ = pixels.shape
    p = spec.patch_size
    g = s // p
    dtype = tower["embed"]["patch"].dtype
    # Non-overlapping patches: the stride-p convolution as one matmul over (channel, row, column).
    patches = pixels.astype(dtype).reshape(n, c, g, p, g, p).transpose(0, 2, 4, 1, 3, 5).reshape(n, g * g, c * p * p)
    embed = tower["embed"]
    x = patches @ embed["patch"]
    if spec.family == "gemma3":
        x = x + embed["patch_bias"] + embed["pos"][None]
    else:
        cls = jnp.broadcast_to(embed["cls"], (n, 1, x.shape[-1]))
        x = jnp.concatenate([cls, x], axis=1) + embed["pos"][None]
        x = _layer_norm(x, embed["pre_norm"], spec.layer_norm_eps)
    for layer in tower["layers"]:
        x = _encoder_layer(spec, layer, x)
    proj = tower["projector"]
    if spec.family == "gemma3":
        return _gemma3_projector(spec, proj, _layer_norm(x, embed["post_norm"], spec.layer_norm_eps), g)
    features = x if spec.keep_class_token else x[:, 1:]
    h = _activation(_linear(features, proj["linear_1"]), spec.projector_act)
    return _linear(h, proj["linear_2"])


def _gemma3_projector(spec: VisionSpec, proj: Tower, x: jax.Array, grid: int) -> jax.Array:
    """Gemma 3's: patches [N, grid * grid, D] (row-major) average-pooled in squares to
    ``pooled_tokens``, RMS-normalized (float32, ``1 + w`` already added at load), projected."""
    n, _, d = x.shape
    side = math.isqrt(spec.pooled_tokens)
    k = grid // side
    pooled = x.astype(jnp.float32).reshape(n, side, k, side, k, d).mean(axis=(2, 4)).reshape(n, side * side, d)
    normed = pooled * jax.lax.rsqrt(jnp.mean(pooled * pooled, axis=-1, keepdims=True) + spec.layer_norm_eps)
    normed = (normed * proj["norm"]).astype(x.dtype)
    return normed @ proj["w"]


def _encoder_layer(spec: VisionSpec, layer: Tower, x: jax.Array) -> jax.Array:
    """One pre-norm CLIP encoder layer: full (bidirectional) attention over the image's tokens, then the MLP."""
    n, t, d = x.shape
    heads, hd = spec.num_heads, d // spec.num_heads
    h = _layer_norm(x, layer["norm1"], spec.layer_norm_eps)
    q, k, v = (_linear(h, layer[name]).reshape(n, t, heads, hd) for name in ("q", "k", "v"))
    scores = jnp.einsum("nqhd,nkhd->nhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(hd)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    attn = jnp.einsum("nhqk,nkhd->nqhd", weights, v).reshape(n, t, d)
    x = x + _linear(attn, layer["o"])
    h = _layer_norm(x, layer["norm2"], spec.layer_norm_eps)
    return x + _linear(_activation(_linear(h, layer["fc1"]), spec.hidden_act), layer["fc2"])


def _linear(x: jax.Array, weights: Tower) -> jax.Array:
    y = x @ weights["w"]
    return y + weights["b"] if "b" in weights else y


def _layer_norm(x: jax.Array, weights: Tower, eps: float) -> jax.Array:
    """LayerNorm in float32 (as transformers' on float32 inputs), returned in x's dtype."""
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = ((xf - mean) ** 2).mean(-1, keepdims=True)
    out = (xf - mean) * jax.lax.rsqrt(var + eps) * weights["w"].astype(jnp.float32) + weights["b"].astype(jnp.float32)
    return out.astype(x.dtype)


def _activation(x: jax.Array, name: str) -> jax.Array:
    if name == "quick_gelu":  # CLIP's: x * sigmoid(1.702 x)
        return x * jax.nn.sigmoid(1.702 * x)
    return jax.nn.gelu(x, approximate=name == "gelu_pytorch_tanh")
