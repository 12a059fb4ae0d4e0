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


MAX_ASPECT = 200
"""The longest side over the shortest a Qwen2-VL image processor lets through (it refuses more)."""


def grid_arrays(spec: VisionSpec, grid_h: int, grid_w: int, patches: int | None = None) -> dict[str, np.ndarray]:
    """What the encoder needs of a ``grid_h x grid_w`` patch grid (one frame) of N patches, laid
    out for ``patches`` >= N (a bucket: the image's patch rows padded with zeros to it; None: N), as
    numpy arrays:

    - ``perm`` [P]: the patches in window order (transformers' ``window_index``, each merged
      token's ``merge_size**2`` patches kept together): row i of the permuted sequence is
      ``pixel_values`` row ``perm[i]`` (padding rows after the image's);
    - ``unperm`` [P / merge_size**2]: the merged tokens back in the processor's (row-major) order,
      the image's first;
    - ``pos`` [P, 2]: each permuted patch's (row, column) in the patch grid, for the 2D rotary;
    - ``windows`` [W, S]: each window's patches (indices of the permuted sequence, consecutive),
      padded with P to a whole window's S patches, then windows of P alone up to ``window_bound``:
      the windowed layers attend per window;
    - ``slots`` [P]: where each permuted patch sits in ``windows`` flattened (``w * S + j``; a
      padding patch: W * S, past them);
    - ``count`` []: N, the image's patches (the full layers' keys).
    """
    m = spec.merge_size
    if grid_h % m or grid_w % m:
        raise ValueError(f"a {grid_h}x{grid_w} patch grid is not made of {m}x{m} blocks")
    side = _window_side(spec)
    unit = m * m
    n = grid_h * grid_w
    total = n if patches is None else patches
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
    most = side * side * unit
    num_windows = len(starts) if patches is None else window_bound(spec, patches)
    if total < n or total % unit or num_windows < len(starts):
        raise ValueError(f"a {grid_h}x{grid_w} patch grid does not fit {total} patches")
    windows = np.full((num_windows, most), total)
    offsets = np.arange(most)
    windows[: len(starts)] = np.where(offsets < sizes[:, None], starts[:, None] + offsets, total)
    slots = np.full(total, num_windows * most)
    slots[:n] = np.arange(n) - starts.repeat(sizes) + np.arange(len(starts)).repeat(sizes) * most
    pad = np.arange(n, total)
    return {
        "perm": np.concatenate([perm, pad]).astype(np.int32),
        "unperm": np.concatenate([np.argsort(window_index), np.arange(n // unit, total // unit)]).astype(np.int32),
        "pos": np.concatenate([pos[perm], np.zeros((total - n, 2), np.int64)]).astype(np.int32),
        "windows": windows.astype(np.int32),
        "slots": slots.astype(np.int32),
        "count": np.asarray(n, np.int32),
    }


def _window_side(spec: VisionSpec) -> int:
    side = spec.window_size // spec.merge_size // spec.patch_size  # merged tokens per window side
    if side < 1:
        raise ValueError(f"window_size {spec.window_size} is smaller than a merged token")
    return side


def window_bound(spec: VisionSpec, patches: int) -> int:
    """The most windows a grid of at most ``patches`` patches (and at most ``MAX_ASPECT`` to one) has:
    an a x b grid of merged tokens has ceil(a / s) * ceil(b / s) <= ab / s**2 + (a + b) / s + 1."""
    side, tokens = _window_side(spec), patches // spec.merge_size**2
    perimeter = min(tokens + 1, int(np.sqrt((MAX_ASPECT + 1) * tokens)) + 2)
    return -(-tokens // (side * side)) + -(-perimeter // side) + 1


def patch_buckets(spec: VisionSpec, most: int) -> tuple[int, ...]:
    """Patch counts an image is padded up to (powers of two from a window's patches), the last
    holding ``most``: one executable per bucket instead of one per grid."""
    first = max(_window_side(spec) ** 2 * spec.merge_size**2, spec.merge_size**2)
    buckets = [1 << max(first - 1, 0).bit_length()]
    while buckets[-1] < most:
        buckets.append(buckets[-1] * 2)
    return tuple(buckets)


def encode_qwen_image(spec: VisionSpec, tower: Tower, patches: jax.Array, arrays: dict[str, jax.Array]) -> jax.Array:
    """One image's patches [N, C * T * p * p] (the processor's ``pixel_values`` rows of the image,
    float32) to its token embeddings [N / merge_size**2, text_hidden_size] in the tower's dtype
    (inside a jit; ``arrays`` is ``grid_arrays`` of the image's grid).

    The windowed layers attend window by window ([W, S, S] scores: linear in N); the full layers
    attend over the whole image ([N, N] scores per head: a few layers of the tower). Patches padded
    to a bucket (``grid_arrays``' ``patches``) give as many tokens; the image's are the first."""
    dtype = tower["patch"].dtype
    x = patches.astype(dtype)[arrays["perm"]] @ tower["patch"]  # the Conv3d: kernel = stride = the patch
    cos, sin = _rotary(spec, arrays["pos"])
    for i, layer in enumerate(tower["layers"]):
        x = _block(spec, layer, x, cos, sin, arrays, i not in spec.full_layers)
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
    spec: VisionSpec,
    layer: Tower,
    x: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    arrays: dict[str, jax.Array],
    windowed: bool,
) -> jax.Array:
    """One pre-norm block: attention (``windowed``: within each window of ``grid_arrays``'; else
    over the whole image), then the SwiGLU MLP."""
    n, d = x.shape
    heads, hd = spec.num_heads, d // spec.num_heads
    h = _rms_norm(x, layer["norm1"], spec.layer_norm_eps)
    q, k, v = jnp.moveaxis(_linear(h, layer["qkv"]).reshape(n, 3, heads, hd), 1, 0)
    q, k = (_rotate(t, cos, sin) for t in (q, k))
    count = arrays["count"]  # the image's patches (the rest pad it to its bucket)
    if windowed:  # each window's patches gathered ([W, S, heads, hd], padding slots past them), then put back
        rows = arrays["windows"]
        q, k, v = (jnp.concatenate([t, jnp.zeros((1, heads, hd), t.dtype)])[rows] for t in (q, k, v))
        out = _attention(q, k, v, rows < count).reshape(-1, heads, hd)
        out = jnp.concatenate([out, jnp.zeros((1, heads, hd), out.dtype)])[arrays["slots"]]
    else:
        out = _attention(q, k, v, jnp.arange(n) < count)
    x = x + _linear(out.reshape(n, d), layer["proj"])
    h = _rms_norm(x, layer["norm2"], spec.layer_norm_eps)
    return x + _linear(_activation(_linear(h, layer["gate"]), spec.hidden_act) * _linear(h, layer["up"]), layer["down"])


def _attention(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array | None) -> jax.Array:
    """Softmax attention (float32 scores) of queries over keys [..., T, heads, hd], keys masked by
    ``valid`` [..., T] (None: all); every query sees at least itself or a valid key."""
    hd = q.shape[-1]
    scores = jnp.einsum("...qhd,...khd->...hqk", q, k, preferred_element_type=jnp.float32) * hd**-0.5
    if valid is not None:
        # (Finite: a window of padding alone, whose rows nothing reads, stays free of NaN.)
        scores = jnp.where(valid[..., None, None, :], scores, -1e30)
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
