"""Shared fakes for tests: tiny random HF checkpoints of each supported architecture.

Built with transformers (and therefore torch), so only tests import this module.
"""

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
}


def make_tiny_checkpoint(arch: str, directory: Path, *, seed: int = 0, dtype: str = "float32") -> Path:
    """Save a tiny random model of ``arch`` (a key of TINY_ARCHES) with transformers; return the dir."""
    import torch
    import transformers

    cls_name, extra = TINY_ARCHES[arch]
    config = getattr(transformers, cls_name)(**{**TINY_COMMON, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    # Random init uses std 0.02, which makes every logit ~0; larger weights make parity meaningful.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(directory)
    return directory


def hf_logits(directory: Path, token_ids: list[int]):
    """Full-sequence float32 logits [T, vocab] from transformers, as numpy."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor([token_ids]))
    return out.logits[0].float().numpy()
