"""Tiny random HF checkpoints of each supported architecture, and transformers' answers on them
(the parity reference). Built with transformers and torch, imported lazily: only tests need them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY_COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)

# name -> (config class name, extra config). Each exercises one family's differences.
TINY_ARCHES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": (
        "LlamaConfig",
        dict(
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "llama_tied": ("LlamaConfig", dict(tie_word_embeddings=True, num_key_value_heads=4)),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=1)),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
    # Mixture-of-Experts: 8 experts (shardable 2 and 4 ways), top-2; Qwen3-MoE renormalises the
    # top-k weights, Qwen2-MoE does not and adds a gated shared expert.
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, head_dim=16),
    ),
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32)),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48),
    ),
    # Sliding windows of 16 (the parity prompts are 45 tokens, the served ones up to 150), a score
    # scale off 1/sqrt(head_dim), and soft caps low enough to bend these tiny models' scores and logits.
    "gemma2": (
        "Gemma2Config",
        dict(
            head_dim=16,
            sliding_window=16,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=5.0,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            head_dim=16,
            sliding_window=16,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters=dict(
                sliding_attention=dict(rope_type="default", rope_theta=1000.0),
                full_attention=dict(rope_type="linear", factor=4.0, rope_theta=100000.0),
            ),
        ),
    ),
    "mistral_window": ("MistralConfig", dict(sliding_window=16)),
}


# A tiny-model engine with small buckets, so warmup stays short on 2 cores (config overrides).
TINY_ENGINE: tuple[str, ...] = (
    "model.max_model_len=512",
    "engine.page_size=8",
    "engine.max_num_seqs=8",
    "engine.max_num_batched_tokens=64",
    "engine.token_buckets=[1,8,64]",
    "engine.context_buckets=[512]",  # one context bucket (the CPU deployment's 128 would double the builds)
)


WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
"""The parameters of the tool-calling tests' get_weather function (bounded, so a forced call ends)."""


NESTED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
"""A nested JSON schema whose documents are bounded (objects, arrays, enums, required fields,
bounded integers, a pattern): every constrained generation of it can finish."""


def make_tiny_checkpoint(
    arch: str,
    directory: Path,
    *,
    seed: int = 0,
    dtype: str = "float32",
    vocab_size: int | None = None,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Save a tiny random model of ``arch`` (a key of TINY_ARCHES) with transformers; return the dir.

    ``vocab_size`` overrides the tiny 256 (e.g. SmolLM2's 49152, so chat-templated prompts fit);
    ``overrides``, any other config value (e.g. head counts).
    """
    import torch
    import transformers

    cls_name, extra = TINY_ARCHES[arch]
    sizes = {} if vocab_size is None else {"vocab_size": vocab_size}
    config = getattr(transformers, cls_name)(**{**TINY_COMMON, **extra, **sizes, **(overrides or {})})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    # Norms scale by about 1: by w ~ 1, or for Gemma (whose norms scale by 1 + w) by w ~ 0.
    scale_random_weights(model, unit=0.0 if config.model_type.startswith("gemma") else 1.0)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(directory)
    return directory


def scale_random_weights(model: Any, *, unit: float = 1.0, embeddings: tuple[str, ...] = ()) -> None:
    """Random init uses std 0.02, which makes every logit ~0 (and every image alike); larger weights
    make parity meaningful: norms ``unit`` + N(0, 0.1), parameters named in ``embeddings`` N(0, 0.5),
    the rest N(0, 0.2)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(unit + 0.1 * torch.randn_like(p))
            elif any(e in name for e in embeddings):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.2)


def hf_logits(directory: Path, token_ids: list[int]):
    """Full-sequence float32 logits [T, vocab] from transformers, as numpy."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor([token_ids]))
    return out.logits[0].float().numpy()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_ids: tuple[int, ...]) -> list[int]:
    """transformers greedy ``generate`` for one prompt alone; the new token ids (EOS included)."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=list(eos_ids),
            pad_token_id=eos_ids[0],
        )
    return out[0, len(prompt_ids) :].tolist()
