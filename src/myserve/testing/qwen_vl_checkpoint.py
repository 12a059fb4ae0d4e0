"""A tiny random Qwen2.5-VL checkpoint for tests, saved as a user's would be: weights, config, a
tokenizer with Qwen's vision tokens and a chat template that renders image parts, and the processor
(Qwen2-VL's image processor, PIL backend, so serving needs no torch). Built with transformers and
torch, imported lazily: only tests need them."""

from __future__ import annotations

from pathlib import Path

QWEN_VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen's ChatML turns, simplified (no default system prompt): an image part is
``<|vision_start|><|image_pad|><|vision_end|>``; the processor repeats ``<|image_pad|>`` once per
token of the image."""

QWEN_VL_TOKENS = {
    "vision_start_token": "<|vision_start|>",
    "vision_end_token": "<|vision_end|>",
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
}
"""Qwen2.5-VL's vision tokens, by the tokenizer attribute (and config ``*_id`` field) naming each."""

PATCH_SIZE = 4
MERGE_SIZE = 2
MIN_PIXELS = 24 * 24
"""The processor's ``size["shortest_edge"]``: smaller images are upscaled to at least 6 x 6 patches."""
MAX_PIXELS = 40 * (PATCH_SIZE * MERGE_SIZE) ** 2
"""The processor's ``size["longest_edge"]``: larger images are downscaled to at most 40 tokens."""


def make_tiny_qwen2_5_vl(directory: Path, *, seed: int = 0) -> Path:
    """A tiny random Qwen2.5-VL (vision tower of 2 layers, hidden 32, patches of 4 merged 2 x 2,
    windows of 2 x 2 merged tokens in layer 0 and full attention in layer 1, out 64; Qwen2.5-VL
    text model of 2 layers, hidden 64, M-RoPE sections [2, 3, 3]) with SmolLM2's tokenizer plus
    Qwen's four vision tokens, and the processor (image processor, tokenizer, template) beside it.
    Images of about 30-70 pixels a side take 6 x 6 to 16 x 16 patches (9 to 40 tokens)."""
    import torch
    import transformers

    from myserve.testing.checkpoints import TINY_COMMON, scale_random_weights
    from myserve.testing.vision_checkpoints import tokenizer_with

    hf_tokenizer, ids = tokenizer_with(QWEN_VL_TOKENS, QWEN_VL_TEMPLATE)  # (image_token etc. as attributes)
    vision = transformers.Qwen2_5_VLVisionConfig(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        patch_size=PATCH_SIZE,
        temporal_patch_size=2,
        spatial_merge_size=MERGE_SIZE,
        window_size=16,  # pixels: 16 // 4 // 2 = windows of 2 x 2 merged tokens (16 patches)
        fullatt_block_indexes=[1],
        out_hidden_size=TINY_COMMON["hidden_size"],
    )
    # An LM head of its own, as the Gemma 3 builder's (tied to random embeddings, greedy tokens repeat).
    text = transformers.Qwen2_5_VLTextConfig(
        **{
            **TINY_COMMON,
            "vocab_size": max(ids.values()) + 8,
            "head_dim": 16,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            "tie_word_embeddings": False,
            "bos_token_id": hf_tokenizer.bos_token_id,
            "eos_token_id": hf_tokenizer.eos_token_id,
            "pad_token_id": hf_tokenizer.pad_token_id,
        }
    )
    config = transformers.Qwen2_5_VLConfig(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        image_token_id=ids["image_token"],
        video_token_id=ids["video_token"],
        vision_start_token_id=ids["vision_start_token"],
        vision_end_token_id=ids["vision_end_token"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    scale_random_weights(model)
    model.save_pretrained(directory)
    image_processor = transformers.Qwen2VLImageProcessorPil(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        patch_size=PATCH_SIZE,
        temporal_patch_size=2,
        merge_size=MERGE_SIZE,
    )
    # Saved part by part, as Qwen's own repositories are (no processor_config.json): building a
    # Qwen2_5_VLProcessor needs a video processor, and that needs torchvision, which serving lacks.
    # Serving reads the image processor alone (AutoImageProcessor, backend="pil"); where torchvision
    # is installed, AutoProcessor builds the whole processor from these parts (not with
    # backend="pil": the video processor has no PIL backend).
    hf_tokenizer._set_processor_class("Qwen2_5_VLProcessor")
    image_processor.save_pretrained(directory)
    hf_tokenizer.save_pretrained(directory)
    return directory
