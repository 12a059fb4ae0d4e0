"""The Llama-family decoder (Llama 2/3.x, TinyLlama, SmolLM2, Mistral, Qwen2, Qwen3) over a paged KV cache.

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

The families differ only by flags on ``ModelSpec``: q/k/v bias (Qwen2), q/k RMSNorm (Qwen3),
llama3 rotary scaling, tied embeddings.
"""

from __future__ import annotations

import math
from typing import TypeAlias

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from haliax import Axis, NamedArray
from jax.sharding import NamedSharding

from myserve.models.axes import BATCH, POS, ModelAxes
from myserve.models.moe import MoeBlock, moe_mlp
from myserve.models.quant import QuantizedWeight, linear
from myserve.models.rope import apply_rope, inverse_frequencies
from myserve.models.spec import ModelSpec
from myserve.ops.attention import paged_attention
from myserve.ops.paged_cache import KernelKVCache, KVCache
from myserve.ops.ragged_batch import RaggedBatch


def rms_norm(x: NamedArray, weight: NamedArray, axis: Axis, eps: float) -> NamedArray:
    """RMSNorm over ``axis``, computed in float32 like transformers, returned in x's dtype."""
    xf = x.astype(jnp.float32)
    var = hax.mean(xf * xf, axis=axis)
    normed = (xf * hax.rsqrt(var + eps)).astype(x.dtype)
    return normed * weight


Weight: TypeAlias = NamedArray | QuantizedWeight
"""A matmul weight: float, or int8 with scales (``model.quantization: int8``)."""


class DecoderLayer(eqx.Module):
    """One pre-norm transformer block."""

    attn_norm: NamedArray  # (embed)
    qkv_proj: Weight  # (embed, kv_heads, qkv, head_size)
    o_proj: Weight  # (kv_heads, q_per_kv, head_size, embed)
    mlp_norm: NamedArray  # (embed)
    gate_up_proj: Weight | None = None  # (embed, gate_up, mlp); None in a MoE layer
    down_proj: Weight | None = None  # (mlp, embed); None in a MoE layer
    qkv_bias: NamedArray | None = None  # (kv_heads, qkv, head_size)
    o_bias: NamedArray | None = None  # (embed)
    q_norm: NamedArray | None = None  # (head_size)
    k_norm: NamedArray | None = None  # (head_size)
    gate_up_bias: NamedArray | None = None  # (gate_up, mlp)
    down_bias: NamedArray | None = None  # (embed)
    moe: MoeBlock | None = None  # the experts of a MoE layer (models/moe.py), instead of gate_up/down


def _add(x: NamedArray, bias: NamedArray | None) -> NamedArray:
    return x if bias is None else x + bias


def _raw(x: NamedArray, *axes: str) -> jax.Array:
    return x.rearrange(axes).array


class LlamaModel(eqx.Module):
    """A decoder-only LM whose attention reads and writes a paged KV cache."""

    spec: ModelSpec = eqx.field(static=True)
    attention_backend: str = eqx.field(static=True)
    embed: NamedArray  # (vocab, embed)
    layers: tuple[DecoderLayer, ...]
    final_norm: NamedArray  # (embed)
    lm_head: Weight | None  # (embed, vocab) float, or quantized (vocab, embed); None when tied to `embed`

    @property
    def axes(self) -> ModelAxes:
        """Named axes of this model."""
        return ModelAxes.of(self.spec)

    def embed_tokens(self, tokens: jax.Array) -> NamedArray:
        """Embeddings (batch, position, embed) of int32 tokens [B, T]."""
        return self.embed.take(self.axes.Vocab, hax.named(tokens, (BATCH, POS)))

    def norm(self, x: NamedArray) -> NamedArray:
        """The final RMSNorm."""
        return rms_norm(x, self.final_norm, self.axes.Embed, self.spec.rms_norm_eps)

    def logits(self, hidden: NamedArray) -> NamedArray:
        """Project hidden states (..., embed) to float32 logits (..., vocab)."""
        ax = self.axes
        head = self.embed if self.lm_head is None else self.lm_head
        if isinstance(head, QuantizedWeight):
            return head.matmul(hidden, ax.Embed)
        return hax.dot(hidden, head, axis=ax.Embed, preferred_element_type=jnp.float32)


def decoder_block(
    spec: ModelSpec,
    layer: DecoderLayer,
    x: NamedArray,
    batch: RaggedBatch,
    cache: KVCache | KernelKVCache,
    layer_idx: int | jax.Array,
    cache_sharding: NamedSharding | None = None,
) -> tuple[NamedArray, KVCache | KernelKVCache]:
    """One pre-norm transformer block on a ragged step's hidden states (batch=1, position=T,
    embed); writes its K/V into layer ``layer_idx`` of the cache.

    A free function of the layer's weights (not of the whole model), so the runtime can jit it
    once and call it for every layer with that layer's arrays and index. ``cache_sharding``: the
    KV cache's sharding. The cache's layout picks the attention (``ops/attention.py``).
    """
    ax, eps = ModelAxes.of(spec), spec.rms_norm_eps
    h = rms_norm(x, layer.attn_norm, ax.Embed, eps)
    qkv = _add(linear(h, layer.qkv_proj, ax.Embed), layer.qkv_bias)
    qkv_raw = _raw(qkv, BATCH, POS, "kv_heads", "qkv", "head_size")  # [B, T, KVH, G + 2, D]
    b, t, kvh, _, d = qkv_raw.shape
    g = spec.q_per_kv
    q = qkv_raw[:, :, :, :g].reshape(b, t, kvh * g, d)  # head kvh_i * g + j reads KV head kvh_i
    k, v = qkv_raw[:, :, :, g], qkv_raw[:, :, :, g + 1]
    if layer.q_norm is not None and layer.k_norm is not None:
        q = _rms_norm_raw(q, layer.q_norm.array, eps)
        k = _rms_norm_raw(k, layer.k_norm.array, eps)
    inv_freq = inverse_frequencies(spec)
    # The paged op works on raw arrays in a fixed layout, like the kernels it can dispatch to.
    q, k = apply_rope(q, batch.positions, inv_freq), apply_rope(k, batch.positions, inv_freq)
    out, cache = paged_attention(
        q[0], k, v, cache, layer_idx, batch, sm_scale=1.0 / math.sqrt(d), cache_sharding=cache_sharding
    )
    out = out[None]  # the step's one row of T tokens
    out_axes = (h.resolve_axis(BATCH), h.resolve_axis(POS), ax.KVHeads, ax.QPerKV, ax.HeadSize)
    o = linear(hax.named(out.reshape(b, t, kvh, g, d), out_axes), layer.o_proj, (ax.KVHeads, ax.QPerKV, ax.HeadSize))
    x = x + _add(o, layer.o_bias)
    h = rms_norm(x, layer.mlp_norm, ax.Embed, eps)
    if layer.moe is not None:
        return x + moe_mlp(spec, layer.moe, h, None if cache_sharding is None else cache_sharding.mesh), cache
    assert layer.gate_up_proj is not None and layer.down_proj is not None
    gate_up = _add(linear(h, layer.gate_up_proj, ax.Embed), layer.gate_up_bias)
    gate, up = gate_up[ax.GateUp, 0], gate_up[ax.GateUp, 1]
    return x + _add(linear(hax.nn.silu(gate) * up, layer.down_proj, ax.Mlp), layer.down_bias), cache


def _rms_norm_raw(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis of a raw array (Qwen3's per-head q/k norm), float32 inside."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * weight
