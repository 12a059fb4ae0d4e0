"""LLaVA served: images in chat messages through the real HTTP app give transformers' greedy tokens
and logprobs; the same image is encoded once and its pages come from the prefix cache; another
image never shares them; bad images are 400s and the server keeps serving."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import vision_chats
from test_server import LiveServer
from vision_chats import (
    MAX_TOKENS,
    check_concurrent_equal_alone,
    data_url,
    generate,
    image_part,
    mesh_tokens,
    png,
    served,
    template_view,
)

from myserve.frontend.app import create_app
from myserve.testing import TINY_ENGINE, start_client, start_service
from myserve.testing.services import wait_primed
from myserve.testing.vision_checkpoints import make_tiny_llava

SIZES = {"a": (40, 50, 1), "b": (64, 32, 2), "c": (33, 33, 3), "d": (48, 48, 5), "e": (52, 44, 6)}
"""Width, height and colour seed of each image the tests draw (each resized differently)."""
IMAGES = {name: png(w, h, seed) for name, (w, h, seed) in SIZES.items()}


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llava(tmp_path_factory.mktemp("llava") / "tiny-llava")


@pytest.fixture(scope="module")
def hf_llava(llava_dir: Path):
    import torch
    import transformers

    return transformers.LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llava_service(llava_dir: Path):
    svc = start_service(llava_dir, *TINY_ENGINE, "engine.num_pages=128", f"model.tokenizer={llava_dir}")
    yield svc
    svc.shutdown()


@pytest.fixture(scope="module")
def server(llava_service):
    live = LiveServer(create_app(llava_service, served_model_name="llava"))
    yield live
    live.stop()


def reference(llava_dir: Path, hf_llava, messages: list[dict[str, Any]]) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs for a chat of ``messages`` (OpenAI shape)."""
    import torch
    import transformers

    from myserve.tokenizer import Tokenizer

    tok = Tokenizer.load(llava_dir)
    processor = transformers.AutoImageProcessor.from_pretrained(llava_dir, backend="pil")
    template_messages, images = template_view(messages)
    ids = tok.encode(tok.render_chat(template_messages), add_special_tokens=False)
    token = hf_llava.config.image_token_index
    expanded: list[int] = []
    for t in ids:
        expanded += [token] * 25 if t == token else [t]
    inputs: dict[str, Any] = {
        "input_ids": torch.tensor([expanded]),
        "attention_mask": torch.ones(1, len(expanded), dtype=torch.long),
    }
    if images:
        inputs["pixel_values"] = torch.tensor(processor(images=images, return_tensors="np")["pixel_values"])
    new, logprobs, _ = generate(hf_llava, inputs)
    return new, logprobs


def chat(url: str, messages: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    return vision_chats.chat(url, "llava", messages, **extra)


def messages_with(*images: str, text: str = "What is in the picture?") -> list[dict[str, Any]]:
    parts = [image_part(data_url(IMAGES[name])) for name in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.mark.parametrize("images", [(), ("a",), ("a", "b")], ids=["no-image", "one-image", "two-images"])
def test_greedy_tokens_and_logprobs_equal_transformers(images, server, llava_dir, hf_llava) -> None:
    messages = messages_with(*images) if images else [{"role": "user", "content": "Describe a picture."}]
    want, want_lps = reference(llava_dir, hf_llava, messages)
    got, got_lps = served(chat(server.url, messages))
    assert got == want
    np.testing.assert_allclose(got_lps, want_lps, atol=2e-4)


def test_serving_images_after_warmup_compiles_nothing(server, llava_service) -> None:
    """The tower and the image forwards are built before ready: a primed server compiles nothing
    for image requests of any token bucket."""
    wait_primed(llava_service)
    before = llava_service.stats().compile_count
    for images in (("c",), ("a", "b"), ("d", "c", "b")):  # 1 to 3 images: every token bucket
        assert chat(server.url, messages_with(*images, text="Again?")).status_code == 200
    assert llava_service.stats().compile_count == before


def test_the_images_change_the_answer(server) -> None:
    """A test of the tests: the tower's embeddings reach the step (other images, other tokens)."""
    names = ("a", "b", "c")
    answers = {name: served(chat(server.url, messages_with(name, text="Which?")))[0] for name in names}
    assert len({tuple(a) for a in answers.values()}) == len(names)


def test_the_same_image_again_is_neither_encoded_nor_prefilled(server, llava_service, llava_dir, hf_llava) -> None:
    messages = messages_with("c", text="And now?")
    first = chat(server.url, messages)
    encoded = llava_service.stats().images_encoded
    second = chat(server.url, messages)
    (tokens, lps), (again, again_lps) = served(first), served(second)
    assert again == tokens
    np.testing.assert_allclose(again_lps, lps, atol=1e-4)  # (a cached prefix: other shapes, other rounding)
    assert llava_service.stats().images_encoded == encoded  # nothing encoded for the second
    metrics = httpx.get(f"{server.url}/metrics").text
    assert f'myserve:images_encoded_total{{model_name="llava"}} {float(encoded)}' in metrics
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 25  # the image's pages came from the prefix cache (page size 8)
    # The same text with an image never sent before: no page holding an image token is shared
    # (the image starts inside the first page of 8), and the answer is that image's.
    other = chat(server.url, messages_with("e", text="And now?"))  # ("e": sent by no other test)
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    want, _ = reference(llava_dir, hf_llava, messages_with("e", text="And now?"))
    assert served(other)[0] == want


def test_the_openai_sdk_sends_image_parts(server) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    messages: Any = messages_with("b")
    reply = client.chat.completions.create(model="llava", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    stream = client.chat.completions.create(
        model="llava", messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert reply.choices[0].message.content == streamed and reply.usage is not None
    assert reply.usage.prompt_tokens > 25


def test_the_responses_api_takes_input_image(server) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    content: Any = [
        {"type": "input_image", "image_url": data_url(IMAGES["b"])},
        {"type": "input_text", "text": "What is in the picture?"},
    ]
    reply = client.responses.create(
        model="llava", input=[{"role": "user", "content": content}], max_output_tokens=MAX_TOKENS, temperature=0
    )
    body = {"model": "llava", "messages": messages_with("b"), "max_tokens": MAX_TOKENS, "temperature": 0}
    chat_reply = httpx.post(f"{server.url}/v1/chat/completions", json=body).json()
    assert reply.output_text == chat_reply["choices"][0]["message"]["content"]
    assert reply.usage is not None and reply.usage.input_tokens > 25


def truncated_png() -> bytes:
    data = IMAGES["a"]
    return data[: len(data) // 2]


def huge_png() -> bytes:
    """A 20000 x 20000 PNG of one colour: small on the wire, 400 M pixels decoded."""
    import struct
    import zlib

    width = height = 20000

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    rows = zlib.compress(b"\x00" * (width + 1) * 64)  # a few rows: the header alone must refuse it
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


BAD = {
    "not-base64": ["data:image/png;base64,@@@not base64@@@"],
    "truncated-png": [data_url(truncated_png())],
    "one-pixel": [data_url(png(1, 1, 4))],
    "huge": [data_url(huge_png())],
    "too-many": [data_url(IMAGES["a"])] * 5,
    "forbidden-host": ["https://example.com/cat.png"],
    "local-file": ["file:///etc/passwd"],
    "not-an-image": [data_url(b"GIF89a but not really")],
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_images_are_400s_and_the_server_keeps_serving(case: str, server) -> None:
    messages = [{"role": "user", "content": [*(image_part(u) for u in BAD[case]), {"type": "text", "text": "hi"}]}]
    response = chat(server.url, messages)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and error["message"]
    assert chat(server.url, messages_with("a")).status_code == 200


def test_an_image_sent_to_a_text_model_is_a_400(tiny_service) -> None:
    wait_primed(tiny_service)  # (a shared engine this may have started: left idle for the next file)
    live = LiveServer(create_app(tiny_service, served_model_name="tiny"))
    try:
        body = {"model": "tiny", "messages": messages_with("a"), "max_tokens": 2}
        response = httpx.post(f"{live.url}/v1/chat/completions", json=body)
        assert response.status_code == 400
        assert "does not take images" in response.json()["error"]["message"]
    finally:
        live.stop()


def test_concurrent_text_and_image_chats_with_preemption_equal_each_alone(llava_dir: Path) -> None:
    """16 chats at once (one with n = 2) on a pool (24 pages of 8) too small for all of them: each
    answer equals its chat's alone."""
    names = [(), ("a",), ("b", "c"), ("d",)]
    cases = [messages_with(*names[i % 4], text=f"Question {i}: what now?") for i in range(16)]
    check_concurrent_equal_alone(llava_dir, "llava", cases, num_pages=24, max_model_len=192, max_tokens=32)


def test_images_cross_the_wire_to_a_core_process(llava_dir, hf_llava) -> None:
    """The engine core in its own process: the front end preprocesses, the pixels travel as typed
    arrays (msgspec), the core encodes them."""
    client = start_client(llava_dir, *TINY_ENGINE, "engine.num_pages=64", f"model.tokenizer={llava_dir}")
    live = LiveServer(create_app(client, served_model_name="llava"))
    try:
        messages = messages_with("b", "a", text="Compare them.")
        want, want_lps = reference(llava_dir, hf_llava, messages)
        got, got_lps = served(chat(live.url, messages))
        assert got == want
        np.testing.assert_allclose(got_lps, want_lps, atol=2e-4)
        deadline = time.monotonic() + 10  # (the core's counters come with its next report)
        while client.stats().images_encoded < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.stats().images_encoded == 2
    finally:
        live.stop()
        client.shutdown()


def test_images_on_a_tensor_and_data_parallel_mesh(llava_dir: Path) -> None:
    """4 concurrent image chats give the same greedy tokens on one device, on model=2 (the text
    model's KV heads split, the tower replicated) and on 2 data-parallel replicas of model=2
    (4 fake CPU devices, in a subprocess)."""
    result = mesh_tokens(llava_dir, "1x1", "1x2", "2x2")
    assert all(len(tokens) == 8 for tokens in result["1x1"])
    assert result["1x2"] == result["1x1"] and result["2x2"] == result["1x1"]
