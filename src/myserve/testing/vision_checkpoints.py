"""Tiny random vision-language checkpoints for tests, saved as a user's would be: weights, config,
the image processor's config and a tokenizer with the model's image token and a chat template that
renders image parts. Built with transformers and torch, imported lazily: only tests need them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

IMAGE_TOKEN = "<image>"

LLAVA_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | upper }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>\n{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
"""LLaVA-1.5's conversation shape: ``USER: <image>\\n...`` turns, then ``ASSISTANT:``."""

IMAGE_SIZE = 30
"""Pixels per side of the tiny towers' input (5 x 5 patches of 6)."""


def make_tiny_llava(directory: Path, *, seed: int = 0) -> Path:
    """A tiny random LLaVA (CLIP tower of 2 layers, hidden 32, 25 patches; Llama text model of 2
    layers, hidden 64) with SmolLM2's tokenizer plus ``<image>``, its CLIP image processor beside it."""
    import torch
    import transformers

    from myserve.bundled import bundled_gguf_path
    from myserve.tokenizer import Tokenizer

    hf_tokenizer = Tokenizer.load(bundled_gguf_path()).hf
    hf_tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_token_id = int(hf_tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))  # type: ignore[arg-type]
    hf_tokenizer.chat_template = LLAVA_TEMPLATE
    vision = transformers.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=6,
        projection_dim=32,
    )
    text = transformers.LlamaConfig(
        vocab_size=image_token_id + 8,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
    )
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token_id)
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config)
    _scale_weights(model, torch)
    model.save_pretrained(directory)
    hf_tokenizer.save_pretrained(directory)
    processor = transformers.CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor.save_pretrained(directory)
    return directory


def _scale_weights(model: Any, torch: Any) -> None:
    """Random init uses std 0.02 (every logit ~0, every image alike); larger weights make parity
    meaningful. Norms scale by about 1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "position_embedding" in name or "class_embedding" in name:
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.2)
