"""The decoder of every supported family (Llama 2/3.x, TinyLlama, SmolLM2, Mistral, Qwen2, Qwen3,
Gemma 2, Gemma 3 text, and the Mixture-of-Experts Mixtral, Qwen2-MoE, Qwen3-MoE) over a paged KV cache.

Equinox modules whose weights are haliax ``NamedArray``s: every weight carries logical axis names
(``embed``, ``kv_heads``, ``qkv``, ``head_size``, ``mlp``, ``vocab``...), and ``models/sharding.py``
maps those names to mesh axes in one table.

Layers are a tuple of separate modules. A ``lax.scan`` over weights stacked along a ``layers``
axis would compile one layer, but XLA:CPU then copies every layer's weights out of the stack on
every step (a dynamic-slice is not an aliasable buffer for its dot kernels): measured 1.9x slower
for a single-sequence decode of SmolLM2. Unrolling the layers in one trace avoids the copy but
compiles 30 layers (~8 s per shape). So the block is a free function of one layer's weights
(``decoder_block``): the serving runtime jits it once per shape and calls it per layer.

Projections that read the same input are fused into one matmul (fewer, larger kernels):

- ``qkv_proj`` (embed, kv_heads, qkv, head_size): for each KV head, its ``q_per_kv`` query heads,
  then its key, then its value (``qkv = q_per_kv + 2``). Grouping by KV head means sharding
  ``kv_heads`` over the ``model`` mesh axis keeps every query head with the KV head it reads.
- ``gate_up_proj`` (embed, gate_up, mlp): gate and up, sharded together along ``mlp``.

The families differ only by flags on ``ModelSpec``: q/k/v bias (Qwen2), q/k RMSNorm (Qwen3,
Gemma 3), rotary scaling, tied embeddings, and Gemma's: GeGLU, scaled embeddings, ``1 + w`` norms
(folded into the weights at load), sandwich norms around attention and MLP, soft-capped attention
scores and logits, per-layer sliding windows and rotary tables (``LayerKind``). In a MoE model
every layer's MLP is a ``MoeBlock`` instead (``models/moe.py``).
"""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from haliax import Axis, NamedArray
from jax.sharding import NamedSharding

from myserve.models import lora as lora_ops
from myserve.models.axes import BATCH, POS, ModelAxes
from myserve.models.dense_dot import dense_dot
from myserve.models.lora import LoraLayer
from myserve.models.moe import MoeBlock, moe_mlp
from myserve.models.narrow import NarrowWeight
from myserve.models.quant import QuantizedWeight, linear
from myserve.models.rope import apply_rope, inverse_frequencies
from myserve.models.row_head import one_row
from myserve.models.spec import LayerKind, ModelSpec
from myserve.ops.attention import paged_attention
from myserve.ops.paged_cache import KernelKVCache, KVCache
from myserve.ops.ragged_batch import RaggedBatch
from myserve.ops.reductions import fused_mean


def rms_norm(x: NamedArray, weight: NamedArray, axis: Axis, eps: float, scale_f32: bool = False) -> NamedArray:
    """RMSNorm over ``axis``, computed in float32 like transformers, returned in x's dtype.

    Llama casts the normalized x to its dtype, then scales; Gemma (``scale_f32``, its weight held in
    float32 with the 1 of ``1 + w`` added) scales in float32, then casts. Equal in float32."""
    xf = x.astype(jnp.float32)
    sq = xf * xf
    var = hax.named(fused_mean(sq.array, sq.axis_indices(axis)), hax.eliminate_axes(sq.axes, axis))
    if scale_f32:
        return (xf * hax.rsqrt(var + eps) * weight.astype(jnp.float32)).astype(x.dtype)
    normed = (xf * hax.rsqrt(var + eps)).astype(x.dtype)
    return normed * weight


type Weight = NamedArray | QuantizedWeight | NarrowWeight
"""A matmul weight: float, W8A8 (``model.quantization: w8a8``), or narrow codes with group scales
(``int8``, ``int4``: ``models/narrow.py``)."""


class DecoderLayer(eqx.Module):
    """One pre-norm transformer block (with Gemma's sandwich norms, post-norms too)."""

    attn_norm: NamedArray  # (embed)
    qkv_proj: Weight  # (embed, kv_heads, qkv, head_size)
    o_proj: Weight  # (kv_heads, q_per_kv, head_size, embed)
    mlp_norm: NamedArray  # (embed): the MLP's input norm
    gate_up_proj: Weight | None = None  # (embed, gate_up, mlp); None in a MoE layer
    down_proj: Weight | None = None  # (mlp, embed); None in a MoE layer
    qkv_bias: NamedArray | None = None  # (kv_heads, qkv, head_size)
    o_bias: NamedArray | None = None  # (embed)
    q_norm: NamedArray | None = None  # (head_size)
    k_norm: NamedArray | None = None  # (head_size)
    gate_up_bias: NamedArray | None = None  # (gate_up, mlp)
    down_bias: NamedArray | None = None  # (embed)
    post_attn_norm: NamedArray | None = None  # (embed): on the attention output (sandwich norms)
    post_mlp_norm: NamedArray | None = None  # (embed): on the MLP output (sandwich norms)
    moe: MoeBlock | None = None  # the experts of a MoE layer (models/moe.py), instead of gate_up/down
    lora: LoraLayer | None = None  # adapter stacks, when the engine serves LoRA adapters (models/lora.py)


def _add(x: NamedArray, bias: NamedArray | None) -> NamedArray:
    return x if bias is None else x + bias


def _raw(x: NamedArray, *axes: str) -> jax.Array:
    return x.rearrange(axes).array


class LlamaModel(eqx.Module):
    """A decoder-only LM whose attention reads and writes a paged KV cache."""

    spec: ModelSpec = eqx.field(static=True)
    attention_backend: str = eqx.field(static=True)
    embed: NamedArray | NarrowWeight  # (vocab, embed) float, or narrow (embed | vocab): also the tied head
    layers: tuple[DecoderLayer, ...]
    final_norm: NamedArray  # (embed)
    lm_head: Weight | None  # (embed, vocab) float, or quantized; None when tied to `embed`
    row_head: NamedArray | None = None
    """(embed, vocab): a copy of a tied float table that one-row logits read on a CPU (``models/row_head.py``); None
    elsewhere."""

    @property
    def axes(self) -> ModelAxes:
        """Named axes of this model."""
        return ModelAxes.of(self.spec)

    @property
    def dtype(self) -> jnp.dtype:
        """The model dtype (of activations and float weights)."""
        return self.embed.dtype if isinstance(self.embed, NarrowWeight) else jnp.dtype(self.embed.array.dtype)

    @property
    def is_abstract(self) -> bool:
        """Whether the weights are shapes and shardings only (nothing read)."""
        table = self.embed.codes if isinstance(self.embed, NarrowWeight) else self.embed
        return isinstance(table.array, jax.ShapeDtypeStruct)

    def embed_tokens(self, tokens: jax.Array) -> NamedArray:
        """Embeddings (batch, position, embed) of int32 tokens [B, T], scaled by ``spec.embed_scale``."""
        ids = hax.named(tokens, (BATCH, POS))
        if isinstance(self.embed, NarrowWeight):
            x = self.embed.take(self.axes.Vocab, ids).rearrange((BATCH, POS, self.axes.Embed.name))
        else:
            x = self.embed.take(self.axes.Vocab, ids)
        if self.spec.embed_scale is None:
            return x
        # As transformers: the scale is a float32 tensor cast to the weights' dtype (55.4 -> 55.5 in bf16).
        return x * jnp.asarray(np.float32(self.spec.embed_scale), dtype=x.dtype)

    def norm(self, x: NamedArray) -> NamedArray:
        """The final RMSNorm."""
        return rms_norm(x, self.final_norm, self.axes.Embed, self.spec.rms_norm_eps, self.spec.norm_unit_offset)

    def logits(self, hidden: NamedArray) -> NamedArray:
        """Project hidden states (..., embed) to float32 logits (..., vocab), soft-capped by
        ``spec.final_softcap`` when set."""
        ax = self.axes
        head = self.embed if self.lm_head is None else self.lm_head
        if self.row_head is not None and one_row(hidden, ax.Embed):
            head = self.row_head
        if isinstance(head, NarrowWeight):
            logits = head.matmul(hidden, ax.Embed, out_dtype=jnp.dtype(jnp.float32))
        elif isinstance(head, QuantizedWeight):
            logits = head.matmul(hidden, ax.Embed)
        else:
            logits = dense_dot(hidden, head, ax.Embed, preferred_element_type=jnp.float32)
        cap = self.spec.final_softcap
        return logits if cap is None else cap * hax.tanh(logits / cap)


def decoder_block(
    spec: ModelSpec,
    layer: DecoderLayer,
    x: NamedArray,
    batch: RaggedBatch,
    cache: KVCache | KernelKVCache,
    layer_idx: int | jax.Array,
    cache_sharding: NamedSharding | None = None,
    kind: LayerKind | None = None,
) -> tuple[NamedArray, KVCache | KernelKVCache]:
    """One pre-norm transformer block on a ragged step's hidden states (batch=1, position=T,
    embed); writes its K/V into layer ``layer_idx`` of the cache.

    A free function of the layer's weights (not of the whole model), so the runtime can jit it
    once per layer kind and call it for every layer of that kind with the layer's arrays and
    index. ``kind``: the layer's window and rotary table (``spec.layer_kind``; needed when
    ``layer_idx`` is traced). ``cache_sharding``: the KV cache's sharding. The cache's layout picks
    the attention (``ops/attention.py``).
    """
    if kind is None:
        assert isinstance(layer_idx, int), "a traced layer index needs its kind"
        kind = spec.layer_kind(layer_idx)
    ax, eps, f32 = ModelAxes.of(spec), spec.rms_norm_eps, spec.norm_unit_offset
    lora, mask = layer.lora, None
    if lora is not None and batch.adapters is not None:  # each token's adapter slot (none: all zeros)
        mask = lora_ops.slot_mask(batch.adapters, lora.qkv_a.axes[0].size, x.dtype)
    h = rms_norm(x, layer.attn_norm, ax.Embed, eps, f32)
    qkv = _add(linear(h, layer.qkv_proj, ax.Embed), layer.qkv_bias)
    if lora is not None and mask is not None:
        qkv = qkv + lora_ops.delta(h, lora.qkv_a, lora.qkv_b, mask, ax.Embed)
    qkv_raw = _raw(qkv, BATCH, POS, "kv_heads", "qkv", "head_size")  # [B, T, KVH, G + 2, D]
    b, t, kvh, _, d = qkv_raw.shape
    g = spec.q_per_kv
    q = qkv_raw[:, :, :, :g].reshape(b, t, kvh * g, d)  # head kvh_i * g + j reads KV head kvh_i
    k, v = qkv_raw[:, :, :, g], qkv_raw[:, :, :, g + 1]
    if layer.q_norm is not None and layer.k_norm is not None:
        q = _rms_norm_raw(q, layer.q_norm.array, eps, f32)
        k = _rms_norm_raw(k, layer.k_norm.array, eps, f32)
    inv_freq = inverse_frequencies(d, kind)
    # The paged op works on raw arrays in a fixed layout, like the kernels it can dispatch to.
    rope = batch.rope_positions(bool(spec.mrope_section))
    q, k = apply_rope(q, rope, inv_freq, spec.mrope_section), apply_rope(k, rope, inv_freq, spec.mrope_section)
    out, cache = paged_attention(
        q[0], k, v, cache, layer_idx, batch,
        sm_scale=spec.sm_scale, window=kind.window, soft_cap=spec.attn_softcap, cache_sharding=cache_sharding,
    )  # fmt: skip
    out = out[None]  # the step's one row of T tokens
    out_axes = (h.resolve_axis(BATCH), h.resolve_axis(POS), ax.KVHeads, ax.QPerKV, ax.HeadSize)
    heads = hax.named(out.reshape(b, t, kvh, g, d), out_axes)
    o = linear(heads, layer.o_proj, (ax.KVHeads, ax.QPerKV, ax.HeadSize))
    if lora is not None and mask is not None:
        o = o + lora_ops.delta(heads, lora.o_a, lora.o_b, mask, (ax.KVHeads, ax.QPerKV, ax.HeadSize))
    x = x + _post_norm(_add(o, layer.o_bias), layer.post_attn_norm, spec)
    h = rms_norm(x, layer.mlp_norm, ax.Embed, eps, f32)
    if layer.moe is not None:
        moe = moe_mlp(spec, layer.moe, h, None if cache_sharding is None else cache_sharding.mesh)
        return x + _post_norm(moe, layer.post_mlp_norm, spec), cache
    assert layer.gate_up_proj is not None and layer.down_proj is not None
    gate_up = _add(linear(h, layer.gate_up_proj, ax.Embed), layer.gate_up_bias)
    if lora is not None and mask is not None:
        gate_up = gate_up + lora_ops.delta(h, lora.gate_up_a, lora.gate_up_b, mask, ax.Embed)
    gate, up = gate_up[ax.GateUp, 0], gate_up[ax.GateUp, 1]
    inner = _activation(gate, spec.hidden_act) * up
    mlp = _add(linear(inner, layer.down_proj, ax.Mlp), layer.down_bias)
    if lora is not None and mask is not None:
        mlp = mlp + lora_ops.delta(inner, lora.down_a, lora.down_b, mask, ax.Mlp)
    return x + _post_norm(mlp, layer.post_mlp_norm, spec), cache


def _activation(gate: NamedArray, name: str) -> NamedArray:
    """The MLP's gate activation: silu (SwiGLU) or GELU's tanh approximation (Gemma's GeGLU, which
    transformers calls ``gelu_pytorch_tanh``)."""
    if name == "gelu_pytorch_tanh":
        return hax.nn.gelu(gate, approximate=True)
    return hax.nn.silu(gate)


def _post_norm(y: NamedArray, weight: NamedArray | None, spec: ModelSpec) -> NamedArray:
    """A sublayer's output through its post-norm (Gemma's sandwich norms), or as it is without one."""
    if weight is None:
        return y
    return rms_norm(y, weight, weight.axes[0], spec.rms_norm_eps, spec.norm_unit_offset)


def _rms_norm_raw(x: jax.Array, weight: jax.Array, eps: float, scale_f32: bool = False) -> jax.Array:
    """RMSNorm over the last axis of a raw array (the per-head q/k norm of Qwen3 and Gemma 3),
    float32 inside; ``scale_f32`` as in ``rms_norm``."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(fused_mean(xf * xf, axis=-1, keepdims=True) + eps)
    if scale_f32:
        return (normed * weight.astype(jnp.float32)).astype(x.dtype)
    return normed.astype(x.dtype) * weight
