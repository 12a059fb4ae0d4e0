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


# Full-size shapes for benchmarks on accelerators (random weights; no download needed).
BENCH_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-3.2-1b": (
        "LlamaConfig",
        dict(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=32.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
            tie_word_embeddings=True,
        ),
    ),
}


def make_random_checkpoint(shape: str, directory: Path, *, dtype: str = "bfloat16", device: str = "cpu") -> Path:
    """Save a random-weight model of a full-size ``shape`` (a key of BENCH_SHAPES); return the dir.

    Weights are drawn on ``device`` (``cuda`` makes a 1B model in a second) with transformers'
    std 0.02, so logits are near uniform: right for timing, meaningless as text.
    """
    import torch
    import transformers

    cls_name, extra = BENCH_SHAPES[shape]
    config = getattr(transformers, cls_name)(**extra)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(directory)
    return directory


def make_tiny_checkpoint(
    arch: str, directory: Path, *, seed: int = 0, dtype: str = "float32", vocab_size: int | None = None
) -> Path:
    """Save a tiny random model of ``arch`` (a key of TINY_ARCHES) with transformers; return the dir.

    ``vocab_size`` overrides the tiny 256 (e.g. SmolLM2's 49152, so chat-templated prompts fit).
    """
    import torch
    import transformers

    cls_name, extra = TINY_ARCHES[arch]
    sizes = {} if vocab_size is None else {"vocab_size": vocab_size}
    config = getattr(transformers, cls_name)(**{**TINY_COMMON, **extra, **sizes})
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


def start_service(checkpoint: Path | None, *overrides: str):
    """A started GenerationService (float32, warmed up) for ``checkpoint`` (None = bundled SmolLM2).

    Tiny random checkpoints carry no tokenizer, so they borrow the bundled SmolLM2 one (their
    token ids are all inside its vocabulary). ``overrides`` are config ``section.key=value`` strings.
    """
    from myserve.bundled import bundled_gguf_path
    from myserve.config import load_config
    from myserve.engine.service import GenerationService
    from myserve.runtime.deployment import Deployment

    base = ["model.dtype=float32"]
    if checkpoint is not None:
        base += [f"model.checkpoint={checkpoint}", f"model.tokenizer={bundled_gguf_path()}"]
    config = load_config(None, [*base, *overrides])
    service = GenerationService.from_deployment(Deployment.load(config))
    service.start()
    return service


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
