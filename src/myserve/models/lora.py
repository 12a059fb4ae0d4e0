"""LoRA adapters on the device: their stacks in each layer, and their low-rank updates applied per
token inside the one ragged step (``runtime/lora_files.py`` reads PEFT checkpoints into these layouts).

Each decoder layer of an engine serving adapters holds a ``LoraLayer``: for each of its four matmul
groups (the fused q/k/v projection, o, the fused gate/up projection, down) a stack ``A`` [slot, in,
rank] and ``B`` [slot, rank, out] with one slot per adapter resident on the device
(``engine.max_loras``). A token's update is ``(x @ A[s]) @ B[s]`` for its sequence's slot ``s``;
every slot's ``x @ A`` is computed for every token and masked by the token's one-hot slot before
``B`` (slots are few and ranks small: no gather, no data-dependent shape, nothing to compile when an
adapter moves in or out, and the stacks shard like the layers they modify: ``B``'s output axes are
the layer's). A token of the base model has no slot: its one-hot row is all zeros.

The fused groups concatenate their projections' ranks: q, k and v each get ``max_rank`` columns of
the q/k/v group's ``A`` (3 x max_rank) and write only their own part of the fused output through
``B``; gate and up likewise (2 x max_rank). An adapter of a smaller rank is zero-padded, and its
scaling (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA) is folded into ``B``.
"""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax.numpy as jnp
from haliax import Axis, NamedArray

from myserve.models.axes import BATCH, POS, ModelAxes
from myserve.models.spec import ModelSpec

SLOT, RANK = "lora_slot", "lora_rank"
"""The stacks' own axes (replicated: not in the sharding rules)."""
GROUPS = ("qkv", "o", "gate_up", "down")
"""The ``LoraLayer`` groups, in field order (``{group}_a``, ``{group}_b``)."""
FIELDS = tuple(f"{group}_{part}" for group in GROUPS for part in "ab")
"""``LoraLayer``'s fields, in order."""


class LoraLayer(eqx.Module):
    """One decoder layer's adapter stacks (every resident slot)."""

    qkv_a: NamedArray  # (lora_slot, embed, lora_rank = 3 R)
    qkv_b: NamedArray  # (lora_slot, lora_rank, kv_heads, qkv, head_size)
    o_a: NamedArray  # (lora_slot, kv_heads, q_per_kv, head_size, lora_rank = R)
    o_b: NamedArray  # (lora_slot, lora_rank, embed)
    gate_up_a: NamedArray  # (lora_slot, embed, lora_rank = 2 R)
    gate_up_b: NamedArray  # (lora_slot, lora_rank, gate_up, mlp)
    down_a: NamedArray  # (lora_slot, mlp, lora_rank = R)
    down_b: NamedArray  # (lora_slot, lora_rank, embed)


def stack_axes(spec: ModelSpec, slots: int, max_rank: int) -> dict[str, tuple[Axis, ...]]:
    """Each ``LoraLayer`` field's axes, for ``slots`` slots of adapters up to ``max_rank``."""
    ax = ModelAxes.of(spec)
    s = Axis(SLOT, slots)

    def r(n: int) -> Axis:
        return Axis(RANK, n * max_rank)

    return {
        "qkv_a": (s, ax.Embed, r(3)),
        "qkv_b": (s, r(3), ax.KVHeads, ax.QKV, ax.HeadSize),
        "o_a": (s, ax.KVHeads, ax.QPerKV, ax.HeadSize, r(1)),
        "o_b": (s, r(1), ax.Embed),
        "gate_up_a": (s, ax.Embed, r(2)),
        "gate_up_b": (s, r(2), ax.GateUp, ax.Mlp),
        "down_a": (s, ax.Mlp, r(1)),
        "down_b": (s, r(1), ax.Embed),
    }


def slot_mask(adapters: jnp.ndarray, slots: int, dtype: jnp.dtype) -> NamedArray:
    """(batch, position, lora_slot): 1 where a token's adapter slot (``adapters`` [1, T], -1: none) is."""
    onehot = (adapters[..., None] == jnp.arange(slots, dtype=adapters.dtype)).astype(dtype)
    return hax.named(onehot, (BATCH, POS, SLOT))


def delta(x: NamedArray, a: NamedArray, b: NamedArray, mask: NamedArray, axis: Axis | tuple[Axis, ...]) -> NamedArray:
    """The tokens' low-rank updates: ``x`` contracted over ``axis`` with each slot's ``a``, kept for
    each token's own slot only (``mask``), then through ``b``."""
    u = hax.dot(x, a, axis=axis) * mask  # (batch, position, lora_slot, lora_rank)
    return hax.dot(u, b, axis=(SLOT, RANK))
