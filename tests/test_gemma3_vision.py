"""Gemma 3 with images, served: transformers' greedy tokens and logprobs through the real HTTP app,
with its processor's prompt (the template's ``<start_of_image>`` expanded in the text) and its
mask (an image's tokens attend to each other both ways, on the sliding layers too); an image's
tokens are computed in one step even where the token budget would cut them; the same image is
encoded once and its pages come from the prefix cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import vision_chats
from test_llava import IMAGES
from test_server import LiveServer
from vision_chats import (
    check_concurrent_equal_alone,
    check_served_as,
    data_url,
    generate,
    image_chat,
    image_part,
    mesh_tokens,
    served,
    template_view,
)

from myserve.frontend.app import create_app
from myserve.testing import TINY_ENGINE, start_service
from myserve.testing.services import wait_primed
from myserve.testing.vision_checkpoints import GEMMA3_IMAGE_TOKENS, make_tiny_gemma3

LONG = "Look closely at the colours and the shapes, then say which one is larger and why you think so. " * 2
"""A text whose tokens push the image past the 64-token budget's first step (the step must stop before it)."""


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gemma3(tmp_path_factory.mktemp("gemma3") / "tiny-gemma3")


@pytest.fixture(scope="module")
def hf_gemma3(gemma3_dir: Path):
    import torch
    import transformers

    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(gemma3_dir, dtype=torch.float32)
    return model.eval(), transformers.AutoProcessor.from_pretrained(gemma3_dir, backend="pil")


@pytest.fixture(scope="module")
def gemma3_service(gemma3_dir: Path):
    svc = start_service(gemma3_dir, *TINY_ENGINE, "engine.num_pages=128", f"model.tokenizer={gemma3_dir}")
    yield svc
    svc.shutdown()


@pytest.fixture(scope="module")
def server(gemma3_service):
    live = LiveServer(create_app(gemma3_service, served_model_name="gemma3"))
    yield live
    live.stop()


def reference(
    hf_gemma3: Any, messages: list[dict[str, Any]], *, bidirectional: bool = True
) -> tuple[list[int], list[float], int]:
    """transformers' greedy tokens, their logprobs and the prompt's length for a chat of ``messages``
    (OpenAI shape), the prompt made by the checkpoint's processor; ``bidirectional=False`` drops the
    image tokens' types, so transformers masks them causally (what the tests must tell apart)."""
    model, processor = hf_gemma3
    template_messages, images = template_view(messages)
    text = processor.apply_chat_template(template_messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, images=images or None, return_tensors="pt", add_special_tokens=False)
    if not bidirectional:
        inputs.pop("token_type_ids", None)
    return generate(model, dict(inputs))


def chat(url: str, messages: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    return vision_chats.chat(url, "gemma3", messages, **extra)


def messages_with(*images: str, text: str = "What is in the picture?") -> list[dict[str, Any]]:
    return image_chat(IMAGES, *images, text=text)


CASES = {
    "no-image": [{"role": "user", "content": "Describe a picture."}],
    "one-image": messages_with("a"),
    "two-images": messages_with("a", "b", text="Which differs?"),
    # Text first: the first 64-token step would end inside the image; it stops before it instead.
    "image-after-long-text": [
        {"role": "user", "content": [{"type": "text", "text": LONG}, image_part(data_url(IMAGES["c"]))]}
    ],
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_and_logprobs_equal_transformers(case: str, server, hf_gemma3) -> None:
    messages = CASES[case]
    want = reference(hf_gemma3, messages)
    check_served_as(chat(server.url, messages), want)
    if case != "no-image":  # a test of the test: causal image tokens would answer otherwise
        _, causal_lps, _ = reference(hf_gemma3, messages, bidirectional=False)
        assert np.abs(np.asarray(causal_lps) - np.asarray(want[1])).max() > 1e-2


def test_serving_images_after_warmup_compiles_nothing(server, gemma3_service) -> None:
    wait_primed(gemma3_service)
    before = gemma3_service.stats().compile_count
    for images in (("d",), ("c", "d"), ("e", "c", "d")):
        assert chat(server.url, messages_with(*images, text="Again?")).status_code == 200
    assert gemma3_service.stats().compile_count == before


def test_the_same_image_again_is_neither_encoded_nor_prefilled(server, gemma3_service) -> None:
    messages = messages_with("d", text="And now?")
    first = chat(server.url, messages)
    encoded = gemma3_service.stats().images_encoded
    second = chat(server.url, messages)
    (tokens, lps), (again, again_lps) = served(first), served(second)
    assert again == tokens
    np.testing.assert_allclose(again_lps, lps, atol=1e-4)
    assert gemma3_service.stats().images_encoded == encoded
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= GEMMA3_IMAGE_TOKENS


def test_text_holding_the_image_marks_is_a_400(server) -> None:
    """The template's mark or the image token typed into a message's text: the images no longer
    match their places, a 400 naming the messages."""
    for text in ("<start_of_image> here", "<image_soft_token>"):
        response = chat(server.url, messages_with("a", text=text))
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "messages"
    assert chat(server.url, messages_with("a")).status_code == 200


def test_concurrent_text_and_image_chats_with_preemption_equal_each_alone(gemma3_dir: Path) -> None:
    """16 chats at once (one with n = 2), image steps cut around whole images by a shared 64-token
    budget, a pool (20 pages of 8) too small for all of them: each answer equals its chat's alone."""
    names = [(), ("a",), ("b", "c"), ("d",)]
    cases = [messages_with(*names[i % 4], text=f"Question {i}: what now?" + " Think." * (i % 3)) for i in range(16)]
    check_concurrent_equal_alone(gemma3_dir, "gemma3", cases, num_pages=20, max_model_len=160)


def test_images_on_a_tensor_parallel_mesh(gemma3_dir: Path) -> None:
    """4 concurrent image chats give the same greedy tokens on one device and on model=2 (the text
    model's KV heads split, the tower replicated; fake CPU devices, in a subprocess)."""
    result = mesh_tokens(gemma3_dir, "1x1", "1x2")
    assert all(len(tokens) == 8 for tokens in result["1x1"])
    assert result["1x2"] == result["1x1"]
