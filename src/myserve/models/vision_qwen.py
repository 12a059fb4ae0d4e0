"""Qwen2.5-VL's vision tower in JAX (transformers' ``Qwen2_5_VisionTransformerPretrainedModel``):
one image's patches to the language model's embeddings at its ``<|image_pad|>`` positions.

Unlike the LLaVA and Gemma 3 towers (``vision.py``), each image keeps its own size: the processor
resizes it to a multiple of ``patch_size * merge_size`` a side and cuts it into ``grid_h x grid_w``
patches of ``temporal_patch_size`` frames (an image is its own frame twice), listed block by block
(each ``merge_size x merge_size`` block of patches, which becomes one token, contiguous). The tower:
a Conv3d patch embedding (no bias, here one matmul), pre-RMSNorm blocks whose attention rotates
queries and keys by the patch's (row, column) (2D rotary, in float32), SwiGLU MLPs with biases,
then the merger: an RMSNorm, each block's patches concatenated, a two-layer MLP with exact GELU.

Attention is windowed in every layer outside ``full_layers``: transformers permutes the merged
tokens so that each window of ``window_size`` pixels a side is contiguous, runs the blocks in that
order, and undoes the permutation after the merger. The order matters only to the float sums, and
matching it keeps the results identical; which patches attend to which is set by window segment
ids. All that depends on the grid alone is computed on the host (``grid_arrays``), so a jitted
encoder is compiled once per grid shape. The windowed layers gather each window's patches (padded
to the largest window) and attend within it, so their cost is linear in the image's patches; only
the few full layers are quadratic.

The tower is small beside the language model and runs once per distinct image, so its weights are
plain arrays replicated on the mesh, as ``vision.py``'s are.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from myserve.errors import CheckpointError
from myserve.models.vision import Tower, TowerSource
from myserve.models.vision_spec import VisionSpec

_PREFIXES = ("visual.", "model.visual.")
"""transformers 5 saves ``visual.*`` (its legacy layout); in memory the tower is ``model.visual.*``."""


def read_qwen_tower(source: TowerSource, spec: VisionSpec, dtype: Any) -> Tower:
    """The tower's and merger's weights from a checkpoint (either naming), as host arrays of
    ``dtype`` with each projection transposed to [in, out]."""
    prefix = next((p for p in _PREFIXES if source.has(p + "patch_embed.proj.weight")), None)
    if prefix is None:
        raise CheckpointError(
            f"the checkpoint has no vision weights (looked for {_PREFIXES[0]}patch_embed.proj.weight)"
        )

    def get(name: str) -> np.ndarray:
        return np.asarray(source.read(prefix + name), np.float32).astype(dtype)

    def linear(name: str) -> dict[str, np.ndarray]:
        return {"w": get(f"{name}.weight").T, "b": get(f"{name}.bias")}

    patch = get("patch_embed.proj.weight")  # [hidden, C, T, p, p]
    layers = [
        {
            "norm1": get(f"blocks.{i}.norm1.weight"),
            "qkv": linear(f"blocks.{i}.attn.qkv"),
            "proj": linear(f"blocks.{i}.attn.proj"),
            "norm2": get(f"blocks.{i}.norm2.weight"),
            "gate": linear(f"blocks.{i}.mlp.gate_proj"),
            "up": linear(f"blocks.{i}.mlp.up_proj"),
            "down": linear(f"blocks.{i}.mlp.down_proj"),
        }
        for i in range(spec.num_layers)
    ]
    merger = {"norm": get("merger.ln_q.weight"), "fc1": linear("merger.mlp.0"), "fc2": linear("merger.mlp.2")}
    # [C * T * p * p, hidden]: a row of pixel_values is (channel, frame, row, column), as the kernel.
    return {"patch": patch.reshape(patch.shape[0], -1).T, "layers": layers, "merger": merger}


def grid_arrays(spec: VisionSpec, grid_h: int, grid_w: int) -> dict[str, np.ndarray]:
    """What the encoder needs of a ``grid_h x grid_w`` patch grid (one frame), as numpy arrays:

    - ``perm`` [N]: the patches in window order (transformers' ``window_index``, each merged
      token's ``merge_size**2`` patches kept together): row i of the permuted sequence is
      ``pixel_values`` row ``perm[i]``;
    - ``unperm`` [N / merge_size**2]: the merged tokens back in the processor's (row-major) order;
    - ``pos`` [N, 2]: each permuted patch's (row, column) in the patch grid, for the 2D rotary;
    - ``windows`` [W, S]: each window's patches (indices of the permuted sequence, consecutive),
      padded with N to the largest window's S patches: the windowed layers attend per window;
    - ``slots`` [N]: where each permuted patch sits in ``windows`` flattened (``w * S + j``).
    """
    m = spec.merge_size
    if grid_h % m or grid_w % m:
        raise ValueError(f"a {grid_h}x{grid_w} patch grid is not made of {m}x{m} blocks")
    side = spec.window_size // m // spec.patch_size  # merged tokens per window side
    if side < 1:
        raise ValueError(f"window_size {spec.window_size} is smaller than a merged token")
    unit = m * m
    rows, cols = np.divmod(np.arange((grid_h // m) * (grid_w // m)), grid_w // m)  # merged tokens, row-major
    windows_per_row = -(-(grid_w // m) // side)
    window = (rows // side) * windows_per_row + cols // side
    # transformers' order: windows row-major, each window's tokens row-major (lexsort: last key first).
    window_index = np.lexsort((cols, rows, window))
    perm = (window_index[:, None] * unit + np.arange(unit)).reshape(-1)
    # Patch k of the processor's order: block k // unit (row-major), (row, column) k % unit within it.
    block_rows, block_cols = rows.repeat(unit), cols.repeat(unit)
    inner_rows, inner_cols = np.divmod(np.tile(np.arange(unit), len(rows)), m)
    pos = np.stack([block_rows * m + inner_rows, block_cols * m + inner_cols], axis=-1)
    segment = window[window_index].repeat(unit)  # each permuted patch's window (consecutive runs)
    _, starts, sizes = np.unique(segment, return_index=True, return_counts=True)
    most = int(sizes.max())
    offsets = np.arange(most)
    windows = np.where(offsets < sizes[:, None], starts[:, None] + offsets, len(segment))
    slots = np.arange(len(segment)) - starts.repeat(sizes) + np.arange(len(starts)).repeat(sizes) * most
    return {
        "perm": perm.astype(np.int32),
        "unperm": np.argsort(window_index).astype(np.int32),
        "pos": pos[perm].astype(np.int32),
        "windows": windows.astype(np.int32),
        "slots": slots.astype(np.int32),
    }


def encode_qwen_image(spec: VisionSpec, tower: Tower, patches: jax.Array, arrays: dict[str, jax.Array]) -> jax.Array:
    """One image's patches [N, C * T * p * p] (the processor's ``pixel_values`` rows of the image,
    float32) to its token embeddings [N / merge_size**2, text_hidden_size] in the tower's dtype
    (inside a jit; ``arrays`` is ``grid_arrays`` of the image's grid).

    The windowed layers attend window by window ([W, S, S] scores: linear in N); the full layers
    attend over the whole image ([N, N] scores per head: a few layers of the tower)."""
    dtype = tower["patch"].dtype
    x = patches.astype(dtype)[arrays["perm"]] @ tower["patch"]  # the Conv3d: kernel = stride = the patch
    cos, sin = _rotary(spec, arrays["pos"])
    for i, layer in enumerate(tower["layers"]):
        x = _block(spec, layer, x, cos, sin, None if i in spec.full_layers else arrays)
    merger = tower["merger"]
    h = _rms_norm(x, merger["norm"], spec.layer_norm_eps)
    h = h.reshape(-1, spec.merge_size**2 * h.shape[-1])  # each merged token's patches, concatenated
    h = _linear(jax.nn.gelu(_linear(h, merger["fc1"]), approximate=False), merger["fc2"])
    return h[arrays["unperm"]]


def _rotary(spec: VisionSpec, pos: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin [N, head_dim] (float32) of the patches' 2D rotary: head_dim / 4 frequencies over
    the row, as many over the column, [rows, columns] repeated twice (``rotate_half``'s halves)."""
    dim = spec.hidden_size // spec.num_heads // 2
    inv_freq = 1.0 / (spec.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    freqs = (pos.astype(jnp.float32)[..., None] * inv_freq).reshape(pos.shape[0], -1)  # [N, (row, column) x dim / 2]
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def _block(
    spec: VisionSpec, layer: Tower, x: jax.Array, cos: jax.Array, sin: jax.Array, windows: dict[str, jax.Array] | None
) -> jax.Array:
    """One pre-norm block: attention (within each window of ``windows``, ``grid_arrays``'; None:
    over the whole image), then the SwiGLU MLP."""
    n, d = x.shape
    heads, hd = spec.num_heads, d // spec.num_heads
    h = _rms_norm(x, layer["norm1"], spec.layer_norm_eps)
    q, k, v = jnp.moveaxis(_linear(h, layer["qkv"]).reshape(n, 3, heads, hd), 1, 0)
    q, k = (_rotate(t, cos, sin) for t in (q, k))
    if windows is None:
        out = _attention(q, k, v, None)
    else:  # each window's patches gathered ([W, S, heads, hd], padding rows past N), then scattered back
        rows = windows["windows"]
        q, k, v = (jnp.concatenate([t, jnp.zeros((1, heads, hd), t.dtype)])[rows] for t in (q, k, v))
        out = _attention(q, k, v, rows < n).reshape(-1, heads, hd)[windows["slots"]]
    x = x + _linear(out.reshape(n, d), layer["proj"])
    h = _rms_norm(x, layer["norm2"], spec.layer_norm_eps)
    return x + _linear(_activation(_linear(h, layer["gate"]), spec.hidden_act) * _linear(h, layer["up"]), layer["down"])


def _attention(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array | None) -> jax.Array:
    """Softmax attention (float32 scores) of queries over keys [..., T, heads, hd], keys masked by
    ``valid`` [..., T] (None: all); every query sees at least itself or a valid key."""
    hd = q.shape[-1]
    scores = jnp.einsum("...qhd,...khd->...hqk", q, k, preferred_element_type=jnp.float32) * hd**-0.5
    if valid is not None:
        scores = jnp.where(valid[..., None, None, :], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("...hqk,...khd->...qhd", weights, v)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """The rotary on [N, heads, head_dim] in float32 (``rotate_half``: the halves swapped, the first negated)."""
    xf = x.astype(jnp.float32)
    half = xf.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).astype(x.dtype)


def _rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Qwen2_5_VLRMSNorm: normalized in float32, cast back to x's dtype, then scaled by ``w``."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * normed.astype(x.dtype)


def _linear(x: jax.Array, weights: Tower) -> jax.Array:
    return x @ weights["w"] + weights["b"]


def _activation(x: jax.Array, name: str) -> jax.Array:
    if name == "silu":
        return jax.nn.silu(x)
    if name == "quick_gelu":
        return x * jax.nn.sigmoid(1.702 * x)
    return jax.nn.gelu(x, approximate=name == "gelu_pytorch_tanh")
