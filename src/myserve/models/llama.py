"""The Llama-family decoder (Llama 2/3.x, TinyLlama, SmolLM2, Mistral, Qwen2, Qwen3) over a paged KV cache.

Equinox modules whose weights are haliax ``NamedArray``s: every weight carries logical axis names
(``embed``, ``heads``, ``kv_heads``, ``head_size``, ``mlp``, ``vocab``, ``layers``), and
``runtime/mesh.py`` maps those names to mesh axes in one table. Layers are stacked along ``layers``
and run with ``haliax.fold`` (a ``lax.scan``), so XLA compiles one layer, not ``num_layers``.

The families differ only by flags on ``ModelSpec``: q/k/v bias (Qwen2), q/k RMSNorm (Qwen3),
llama3 rotary scaling, tied embeddings.
"""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from haliax import Axis, NamedArray

from myserve.models.rope import apply_rope, inverse_frequencies
from myserve.models.spec import ModelSpec
from myserve.ops.paged_attention import PageBatch, paged_attention, write_kv

BATCH, POS = "batch", "position"


class ModelAxes(eqx.Module):
    """The named axes of one model, sized from its spec."""

    Embed: Axis
    Heads: Axis
    KVHeads: Axis
    HeadSize: Axis
    Mlp: Axis
    Vocab: Axis
    Layers: Axis

    @staticmethod
    def of(spec: ModelSpec) -> ModelAxes:
        """Axes for ``spec``."""
        return ModelAxes(
            Embed=Axis("embed", spec.hidden_size),
            Heads=Axis("heads", spec.num_heads),
            KVHeads=Axis("kv_heads", spec.num_kv_heads),
            HeadSize=Axis("head_size", spec.head_dim),
            Mlp=Axis("mlp", spec.intermediate_size),
            Vocab=Axis("vocab", spec.vocab_size),
            Layers=Axis("layers", spec.num_layers),
        )


def rms_norm(x: NamedArray, weight: NamedArray, axis: Axis, eps: float) -> NamedArray:
    """RMSNorm over ``axis``, computed in float32 like transformers, returned in x's dtype."""
    xf = x.astype(jnp.float32)
    var = hax.mean(xf * xf, axis=axis)
    normed = (xf * hax.rsqrt(var + eps)).astype(x.dtype)
    return normed * weight


class DecoderLayer(eqx.Module):
    """One pre-norm transformer block. In a model, every array has a leading ``layers`` axis."""

    attn_norm: NamedArray  # (embed)
    q_proj: NamedArray  # (embed, heads, head_size)
    k_proj: NamedArray  # (embed, kv_heads, head_size)
    v_proj: NamedArray  # (embed, kv_heads, head_size)
    o_proj: NamedArray  # (heads, head_size, embed)
    mlp_norm: NamedArray  # (embed)
    gate_proj: NamedArray  # (embed, mlp)
    up_proj: NamedArray  # (embed, mlp)
    down_proj: NamedArray  # (mlp, embed)
    q_bias: NamedArray | None = None  # (heads, head_size)
    k_bias: NamedArray | None = None  # (kv_heads, head_size)
    v_bias: NamedArray | None = None  # (kv_heads, head_size)
    o_bias: NamedArray | None = None  # (embed)
    q_norm: NamedArray | None = None  # (head_size)
    k_norm: NamedArray | None = None  # (head_size)
    gate_bias: NamedArray | None = None  # (mlp)
    up_bias: NamedArray | None = None  # (mlp)
    down_bias: NamedArray | None = None  # (embed)


def _add(x: NamedArray, bias: NamedArray | None) -> NamedArray:
    return x if bias is None else x + bias


def _raw(x: NamedArray, *axes: str) -> jax.Array:
    return x.rearrange(axes).array


class LlamaModel(eqx.Module):
    """A decoder-only LM whose attention reads and writes a paged KV cache."""

    spec: ModelSpec = eqx.field(static=True)
    attention_backend: str = eqx.field(static=True)
    embed: NamedArray  # (vocab, embed)
    layers: DecoderLayer  # stacked over (layers, ...)
    final_norm: NamedArray  # (embed)
    lm_head: NamedArray | None  # (embed, vocab); None when tied to `embed`

    @property
    def axes(self) -> ModelAxes:
        """Named axes of this model."""
        return ModelAxes.of(self.spec)

    def __call__(self, tokens: jax.Array, batch: PageBatch, kv_cache: jax.Array) -> tuple[NamedArray, jax.Array]:
        """Run the new tokens of a batch of sequences through the model.

        Args:
            tokens: int32 [B, T], padded rows of new tokens (see ``PageBatch``).
            batch: positions, lengths and page table of the step.
            kv_cache: [layers, pages, page_size, 2 * kv_heads, head_dim]; this step's K/V are written.
        Returns:
            Final hidden states (batch, position, embed), after the final norm, and the new cache.
        """
        ax = self.axes
        named_tokens = hax.named(tokens, (BATCH, POS))
        x = self.embed.take(ax.Vocab, named_tokens)
        inv_freq = inverse_frequencies(self.spec)

        def block(carry: tuple[NamedArray, jax.Array], layer: DecoderLayer, layer_idx: jax.Array):
            x, cache = carry
            h = rms_norm(x, layer.attn_norm, ax.Embed, self.spec.rms_norm_eps)
            attn, cache = self._attention(layer, h, batch, cache, layer_idx, inv_freq)
            x = x + attn
            h = rms_norm(x, layer.mlp_norm, ax.Embed, self.spec.rms_norm_eps)
            x = x + self._mlp(layer, h)
            return x, cache

        layer_ids = jnp.arange(self.spec.num_layers, dtype=jnp.int32)
        x, kv_cache = hax.fold(block, ax.Layers)((x, kv_cache), self.layers, layer_ids)
        return rms_norm(x, self.final_norm, ax.Embed, self.spec.rms_norm_eps), kv_cache

    def logits(self, hidden: NamedArray) -> NamedArray:
        """Project hidden states (..., embed) to float32 logits (..., vocab)."""
        ax = self.axes
        head = self.embed if self.lm_head is None else self.lm_head
        return hax.dot(hidden, head, axis=ax.Embed, preferred_element_type=jnp.float32)

    def _attention(
        self,
        layer: DecoderLayer,
        h: NamedArray,
        batch: PageBatch,
        cache: jax.Array,
        layer_idx: jax.Array,
        inv_freq,
    ) -> tuple[NamedArray, jax.Array]:
        ax, spec = self.axes, self.spec
        q = _add(hax.dot(h, layer.q_proj, axis=ax.Embed), layer.q_bias)
        k = _add(hax.dot(h, layer.k_proj, axis=ax.Embed), layer.k_bias)
        v = _add(hax.dot(h, layer.v_proj, axis=ax.Embed), layer.v_bias)
        if layer.q_norm is not None and layer.k_norm is not None:
            q = rms_norm(q, layer.q_norm, ax.HeadSize, spec.rms_norm_eps)
            k = rms_norm(k, layer.k_norm, ax.HeadSize, spec.rms_norm_eps)
        # The paged op works on raw arrays in a fixed layout, like the kernels it can dispatch to.
        q_raw = apply_rope(_raw(q, BATCH, POS, "heads", "head_size"), batch.positions, inv_freq)
        k_raw = apply_rope(_raw(k, BATCH, POS, "kv_heads", "head_size"), batch.positions, inv_freq)
        v_raw = _raw(v, BATCH, POS, "kv_heads", "head_size")
        cache = write_kv(cache, layer_idx, k_raw, v_raw, batch)
        out = paged_attention(q_raw, cache, layer_idx, batch, backend=self.attention_backend)  # type: ignore[arg-type]
        out_named = hax.named(out, (h.resolve_axis(BATCH), h.resolve_axis(POS), ax.Heads, ax.HeadSize))
        o = hax.dot(out_named, layer.o_proj, axis=(ax.Heads, ax.HeadSize))
        return _add(o, layer.o_bias), cache

    def _mlp(self, layer: DecoderLayer, h: NamedArray) -> NamedArray:
        ax = self.axes
        gate = _add(hax.dot(h, layer.gate_proj, axis=ax.Embed), layer.gate_bias)
        up = _add(hax.dot(h, layer.up_proj, axis=ax.Embed), layer.up_bias)
        return _add(hax.dot(hax.nn.silu(gate) * up, layer.down_proj, axis=ax.Mlp), layer.down_bias)
