"""The named axes of a model's weights and activations, sized from its spec.

Every weight carries these logical names; ``models/sharding.py`` maps them to mesh axes in one
table. A module of its own so the sharding rules and the model code (which shards its expert
block by the rules) can both read it.
"""

from __future__ import annotations

import equinox as eqx
from haliax import Axis

from myserve.models.spec import ModelSpec

BATCH, POS = "batch", "position"


class ModelAxes(eqx.Module):
    """The named axes of one model, sized from its spec."""

    Embed: Axis
    KVHeads: Axis
    QPerKV: Axis
    QKV: Axis
    HeadSize: Axis
    GateUp: Axis
    Mlp: Axis
    Vocab: Axis
    Experts: Axis
    """Routed experts of a MoE layer (size 0 for a dense model)."""
    Routes: Axis
    """The router's output: one logit per expert. Named apart from ``experts`` so the small router
    stays replicated while the experts shard (every device routes every token)."""
    ExpertMlp: Axis
    """Hidden width of one routed expert."""
    SharedMlp: Axis
    """Hidden width of the shared expert (Qwen2-MoE; size 0 when none)."""

    @staticmethod
    def of(spec: ModelSpec) -> ModelAxes:
        """Axes for ``spec``."""
        return ModelAxes(
            Embed=Axis("embed", spec.hidden_size),
            KVHeads=Axis("kv_heads", spec.num_kv_heads),
            QPerKV=Axis("q_per_kv", spec.q_per_kv),
            QKV=Axis("qkv", spec.q_per_kv + 2),
            HeadSize=Axis("head_size", spec.head_dim),
            GateUp=Axis("gate_up", 2),
            Mlp=Axis("mlp", spec.intermediate_size),
            Vocab=Axis("vocab", spec.vocab_size),
            Experts=Axis("experts", spec.num_experts),
            Routes=Axis("routes", spec.num_experts),
            ExpertMlp=Axis("expert_mlp", spec.expert_intermediate_size),
            SharedMlp=Axis("shared_mlp", spec.shared_expert_intermediate_size),
        )
