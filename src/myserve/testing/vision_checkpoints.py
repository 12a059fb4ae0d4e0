"""Tiny random vision-language checkpoints for tests, saved as a user's would be: weights, config,
the image processor's config and a tokenizer with the model's image token and a chat template that
renders image parts. Built with transformers and torch, imported lazily: only tests need them."""

from __future__ import annotations

from pathlib import Path

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
    from myserve.testing.checkpoints import TINY_COMMON, scale_random_weights
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
    text = transformers.LlamaConfig(**{**TINY_COMMON, "vocab_size": image_token_id + 8})
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token_id)
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config)
    scale_random_weights(model, embeddings=("position_embedding", "class_embedding"))
    model.save_pretrained(directory)
    hf_tokenizer.save_pretrained(directory)
    processor = transformers.CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor.save_pretrained(directory)
    return directory
