"""Qwen2.5-VL with images, served: transformers' greedy tokens and logprobs through the real HTTP
app for images of different sizes (each its own patch grid and token count), their tokens placed by
M-RoPE's three position streams (rows and columns; the text after an image earlier by the image's
tokens less its longer side), in prompt chunks that cut an image; the same image is encoded once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import vision_chats
from test_server import LiveServer
from vision_chats import (
    check_concurrent_equal_alone,
    check_served_as,
    data_url,
    generate,
    image_chat,
    image_part,
    mesh_tokens,
    png,
    served,
    template_view,
)

from myserve.frontend.app import create_app
from myserve.testing import TINY_ENGINE, start_service
from myserve.testing.qwen_vl_checkpoint import make_tiny_qwen2_5_vl

SIZES = {"square": (32, 32, 11), "wide": (64, 40, 12), "tall": (30, 70, 13), "big": (56, 56, 14)}
"""Width, height and colour seed of each image: each a patch grid of its own."""
IMAGES = {name: png(w, h, seed) for name, (w, h, seed) in SIZES.items()}
LONG = "Look closely at the colours and the shapes, then say which one is larger and why. " * 2


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen-vl") / "tiny-qwen2.5-vl")


@pytest.fixture(scope="module")
def hf_qwen(qwen_dir: Path):
    import torch
    import transformers

    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen_dir, dtype=torch.float32)
    # The PIL image processor, as the server's. (Qwen2_5_VLProcessor itself needs a video processor,
    # which needs torchvision: ``reference`` expands the prompt as it does, each image's pad token
    # once per token of the image's grid.)
    image_processor = transformers.AutoImageProcessor.from_pretrained(qwen_dir, backend="pil")
    return model.eval(), image_processor, transformers.AutoTokenizer.from_pretrained(qwen_dir)


@pytest.fixture(scope="module")
def qwen_service(qwen_dir: Path):
    svc = start_service(qwen_dir, *TINY_ENGINE, "engine.num_pages=128", f"model.tokenizer={qwen_dir}")
    yield svc
    svc.shutdown()


@pytest.fixture(scope="module")
def server(qwen_service):
    live = LiveServer(create_app(qwen_service, served_model_name="qwen-vl"))
    yield live
    live.stop()


def reference(hf_qwen: Any, messages: list[dict[str, Any]]) -> tuple[list[int], list[float], int]:
    """transformers' greedy tokens, their logprobs and the prompt's length, the prompt made by the
    checkpoint's processor (its M-RoPE positions by transformers' ``get_rope_index``)."""
    import torch

    model, image_processor, tokenizer = hf_qwen
    template_messages, images = template_view(messages)
    text = tokenizer.apply_chat_template(template_messages, add_generation_prompt=True, tokenize=False)
    inputs: dict[str, Any] = {}
    if images:
        processed = image_processor(images=images, return_tensors="pt")
        inputs = {"pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"]}
        pieces = text.split("<|image_pad|>")
        counts = [int(g.prod()) // 4 for g in processed["image_grid_thw"]]
        text = pieces[0] + "".join("<|image_pad|>" * n + piece for n, piece in zip(counts, pieces[1:], strict=True))
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    inputs |= {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": (ids == pad).int()}
    return generate(model, inputs)


def chat(url: str, messages: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    return vision_chats.chat(url, "qwen-vl", messages, **extra)


def messages_with(*images: str, text: str = "What is in the picture?") -> list[dict[str, Any]]:
    return image_chat(IMAGES, *images, text=text)


CASES = {
    "no-image": [{"role": "user", "content": "Describe a picture."}],
    "one-image": messages_with("square"),
    "two-images": messages_with("wide", "tall", text="Which differs?"),
    # Text first: the 64-token budget cuts the image's tokens between two steps.
    "image-after-long-text": [
        {"role": "user", "content": [{"type": "text", "text": LONG}, image_part(data_url(IMAGES["big"]))]}
    ],
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_and_logprobs_equal_transformers(case: str, server, hf_qwen) -> None:
    messages = CASES[case]
    check_served_as(chat(server.url, messages), reference(hf_qwen, messages))


def test_images_of_any_size_after_warmup_compile_nothing(server, qwen_service) -> None:
    """The tower's patch buckets up to the processor's largest image are built at warm-up: images of
    sizes never seen (each its own grid) compile nothing."""
    from myserve.testing.services import wait_primed

    wait_primed(qwen_service)
    before = qwen_service.stats().compile_count
    for i, (w, h) in enumerate([(20, 90), (77, 41), (48, 48), (100, 100)]):
        images = {"new": png(w, h, 40 + i)}
        assert chat(server.url, image_chat(images, "new", text="New?")).status_code == 200
    assert qwen_service.stats().compile_count == before


def test_images_of_other_sizes_take_other_token_counts(server) -> None:
    lengths = {
        name: chat(server.url, messages_with(name, text="Size?")).json()["usage"]["prompt_tokens"] for name in SIZES
    }
    assert len(set(lengths.values())) >= 3, lengths


def test_the_same_image_again_is_neither_encoded_nor_prefilled(server, qwen_service) -> None:
    messages = messages_with("tall", text="And now?")
    first = chat(server.url, messages)
    encoded = qwen_service.stats().images_encoded
    second = chat(server.url, messages)
    (tokens, lps), (again, again_lps) = served(first), served(second)
    assert again == tokens
    np.testing.assert_allclose(again_lps, lps, atol=1e-4)
    assert qwen_service.stats().images_encoded == encoded
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16


def test_concurrent_text_and_image_chats_with_preemption_equal_each_alone(qwen_dir: Path) -> None:
    """16 chats at once (one with n = 2) on a pool too small for all of them (decodes preempt):
    each answer equals its chat's alone; M-RoPE's offsets survive recompute."""
    names = [(), ("square",), ("wide", "square"), ("tall",)]
    cases = [messages_with(*names[i % 4], text=f"Question {i}?" + " More." * (i % 3)) for i in range(16)]
    check_concurrent_equal_alone(qwen_dir, "qwen-vl", cases, num_pages=20, max_model_len=160)


def test_chunked_mrope_positions_equal_transformers_rope_index(hf_qwen) -> None:
    """Host only: a prompt's three M-RoPE streams as the steps give them (each chunk's offset plus
    its image tokens' rows and columns, ``core/images.py``) equal transformers' ``get_rope_index``,
    however the prompt is cut into chunks."""
    import torch

    from myserve.core.images import ImageSpan, rope_offset, step_images

    model = hf_qwen[0]
    token = model.config.image_token_id
    grids = [(1, 4, 6), (1, 8, 4)]  # patch grids: 2x3 and 4x2 tokens
    layout = [5, None, 3, None, 7]  # text runs and images
    ids: list[int] = []
    images: list[ImageSpan] = []
    types: list[int] = []
    grid_iter = iter(grids)
    for part in layout:
        if part is None:
            _, h, w = next(grid_iter)
            n = h * w // 4
            images.append(
                ImageSpan(f"{len(ids):032x}", len(ids), n, np.zeros((n, 1), np.float32), grid=(h // 2, w // 2))
            )
            ids += [token] * n
            types += [1] * n
        else:
            ids += list(range(10, 10 + part))
            types += [0] * part
    want, _ = model.model.get_rope_index(torch.tensor([ids]), torch.tensor([types]), image_grid_thw=torch.tensor(grids))
    for cuts in ([0, len(ids)], [0, 7, len(ids)], [0, 3, 9, 12, 20, len(ids)]):
        got = np.zeros((3, len(ids)), np.int64)
        for start, stop in zip(cuts, cuts[1:], strict=False):
            n = stop - start
            extra = step_images([(images, start, n, 0)], n)
            positions = np.arange(start, stop) + rope_offset(images, start)
            got[:, start:stop] = positions + (0 if extra is None else extra[2])
        np.testing.assert_array_equal(got, want[:, 0].numpy(), err_msg=f"cut at {cuts}")


def test_images_on_a_tensor_parallel_mesh(qwen_dir: Path) -> None:
    """4 concurrent image chats give the same greedy tokens on one device and on model=2 (the text
    model's KV heads split, the tower replicated; fake CPU devices, in a subprocess)."""
    result = mesh_tokens(qwen_dir, "1x1", "1x2")
    assert all(len(tokens) == 8 for tokens in result["1x1"])
    assert result["1x2"] == result["1x1"]


def test_a_forced_tool_call_with_an_image(server) -> None:
    """A named tool choice over a chat holding an image: the call's arguments follow the schema,
    streamed or not, and the image steers them (another image, other arguments)."""
    import json

    from myserve.testing.checkpoints import WEATHER_PARAMS

    tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}}
    extra = {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}

    def call(name: str, **more: Any) -> dict[str, Any]:
        body = {"model": "qwen-vl", "messages": messages_with(name, text="Weather?"), "max_tokens": 48,
                "temperature": 0, **extra, **more}  # fmt: skip
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()

    answers = {}
    for name in ("square", "wide"):
        (tool_call,) = call(name)["choices"][0]["message"]["tool_calls"]
        assert tool_call["function"]["name"] == "get_weather"
        arguments = json.loads(tool_call["function"]["arguments"])
        assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
        answers[name] = arguments
    assert answers["square"] != answers["wide"]
    body = {"model": "qwen-vl", "messages": messages_with("square", text="Weather?"), "max_tokens": 48,
            "temperature": 0, "stream": True, **extra}  # fmt: skip
    streamed = ""
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    for delta_call in choice["delta"].get("tool_calls") or []:
                        streamed += delta_call["function"].get("arguments") or ""
    assert json.loads(streamed) == answers["square"]


def test_several_models_in_one_server_take_images_by_name(server, qwen_service, tiny_service) -> None:
    """One app serving Qwen2.5-VL and a text-only Llama: an image chat named for the first gets its
    answer from the single-model server; named for the second, a 400; the second still serves text."""
    from myserve.frontend.app import ServedModel, create_models_app
    from myserve.testing.services import wait_primed

    wait_primed(tiny_service)
    models = [ServedModel(engine=qwen_service, names=("qwen-vl",)), ServedModel(engine=tiny_service, names=("tiny",))]
    app = create_models_app(models)
    live = LiveServer(app)
    try:
        messages = messages_with("wide", "square", text="Both?")
        assert served(chat(live.url, messages))[0] == served(chat(server.url, messages))[0]
        refused = httpx.post(f"{live.url}/v1/chat/completions", json={"model": "tiny", "messages": messages})
        assert refused.status_code == 400 and "does not take images" in refused.json()["error"]["message"]
        text = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4}  # (no chat template: token ids)
        assert httpx.post(f"{live.url}/v1/completions", json=text, timeout=60).status_code == 200
    finally:
        live.stop()
