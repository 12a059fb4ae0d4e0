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


def tokenizer_with(tokens: dict[str, str], template: str) -> tuple[Any, dict[str, int]]:
    """SmolLM2's tokenizer (transformers') with a model's special ``tokens`` (attribute name ->
    text, e.g. ``image_token``) added, set as the attributes its processor reads, and ``template``
    as its chat template; and the tokens' ids by attribute name."""
    from myserve.bundled import bundled_gguf_path
    from myserve.tokenizer import Tokenizer

    hf_tokenizer = Tokenizer.load(bundled_gguf_path()).hf
    hf_tokenizer.add_special_tokens({"additional_special_tokens": list(tokens.values())})
    hf_tokenizer._set_model_specific_special_tokens(special_tokens=dict(tokens))
    ids = {key: int(hf_tokenizer.convert_tokens_to_ids(token)) for key, token in tokens.items()}  # type: ignore[arg-type]
    hf_tokenizer.chat_template = template
    return hf_tokenizer, ids


IMAGE_SIZE = 30
"""Pixels per side of the tiny towers' input (5 x 5 patches of 6)."""


def make_tiny_llava(directory: Path, *, seed: int = 0) -> Path:
    """A tiny random LLaVA (CLIP tower of 2 layers, hidden 32, 25 patches; Llama text model of 2
    layers, hidden 64) with SmolLM2's tokenizer plus ``<image>``, its CLIP image processor beside it."""
    import torch
    import transformers

    from myserve.testing.checkpoints import TINY_COMMON, scale_random_weights

    hf_tokenizer, ids = tokenizer_with({"image_token": IMAGE_TOKEN}, LLAVA_TEMPLATE)
    image_token_id = ids["image_token"]
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


GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
"""Gemma 3's turns: ``<start_of_turn>user\\n<start_of_image>...<end_of_turn>``, image parts as
``<start_of_image>`` (its processor expands each into the image's soft tokens)."""

GEMMA3_IMAGE_SIZE = 32
"""Pixels per side of the tiny Gemma 3 tower's input (8 x 8 patches of 4, pooled to 4 x 4 tokens)."""
GEMMA3_IMAGE_TOKENS = 16


def make_tiny_gemma3(directory: Path, *, seed: int = 0) -> Path:
    """A tiny random Gemma 3 (SigLIP tower of 2 layers, hidden 32, 64 patches pooled to 16 tokens;
    Gemma 3 text model of 2 layers, hidden 64, a sliding window of 24 on layer 0) with SmolLM2's
    tokenizer plus Gemma's three image tokens, and the processor (image processor, tokenizer,
    template) saved beside it."""
    import torch
    import transformers

    from myserve.testing.checkpoints import TINY_ARCHES, TINY_COMMON, scale_random_weights

    names = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    hf_tokenizer, ids = tokenizer_with(names, GEMMA3_TEMPLATE)
    vision = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=GEMMA3_IMAGE_SIZE,
        patch_size=4,
        vision_use_head=False,
    )
    text_extra = {**TINY_ARCHES["gemma3"][1], "sliding_window": 24}
    # An LM head of its own: tied to these random embeddings (scaled by sqrt(hidden) on the way in),
    # every greedy token would be the last prompt token again.
    text_extra |= {"vocab_size": ids["image_token"] + 8, "tie_word_embeddings": False}
    text = transformers.Gemma3TextConfig(**{**TINY_COMMON, **text_extra})
    config = transformers.Gemma3Config(
        vision_config=vision,
        text_config=text,
        mm_tokens_per_image=GEMMA3_IMAGE_TOKENS,
        boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"],
        image_token_index=ids["image_token"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config)
    scale_random_weights(model, unit=0.0, embeddings=("position_embedding",))  # Gemma's norms: 1 + w
    with torch.no_grad():  # SigLIP's LayerNorms scale by w
        for name, p in model.named_parameters():
            if "vision_tower" in name and "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(directory)
    image_processor = transformers.Gemma3ImageProcessorPil(
        size={"height": GEMMA3_IMAGE_SIZE, "width": GEMMA3_IMAGE_SIZE}
    )
    processor = transformers.Gemma3Processor(
        image_processor, hf_tokenizer, chat_template=GEMMA3_TEMPLATE, image_seq_length=GEMMA3_IMAGE_TOKENS
    )
    processor.save_pretrained(directory)
    return directory
