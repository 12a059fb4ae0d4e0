"""What the vision-language serving tests share: chats with image parts over HTTP, transformers'
greedy answer for a prompt it was given, the template's view of a chat, the concurrency check and
the mesh run."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np

MAX_TOKENS = 8


def png(width: int, height: int, seed: int) -> bytes:
    """A PNG the test draws: a background, a rectangle and an ellipse in colours from ``seed``."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    colours = [tuple(int(c) for c in rng.integers(0, 256, 3)) for _ in range(3)]
    image = Image.new("RGB", (width, height), colours[0])
    if min(width, height) < 8:  # too small to draw on
        return _saved(image)
    draw = ImageDraw.Draw(image)
    draw.rectangle((width // 8, height // 6, width // 2, height // 2), fill=colours[1])
    draw.ellipse((width // 3, height // 3, width - 2, height - 2), fill=colours[2])
    return _saved(image)


def _saved(image: Any) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def served(response: httpx.Response) -> tuple[list[int], list[float]]:
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["logprobs"]["content"]
    return [int(e["token"].split(":")[1]) for e in content], [e["logprob"] for e in content]


def chat(url: str, model: str, messages: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    """A greedy chat completion of ``MAX_TOKENS`` with each token's id and logprob."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 1,
        "return_tokens_as_token_ids": True,
        **extra,
    }
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def image_chat(images: dict[str, bytes], *names: str, text: str = "What is in the picture?") -> list[dict[str, Any]]:
    """One user message: the named PNGs as ``image_url`` parts, then ``text``."""
    parts = [image_part(data_url(images[name])) for name in names]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def template_view(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """``messages`` as a chat template takes them (``{"type": "image"}`` parts) and their images (PIL)."""
    from PIL import Image

    template_messages, images = [], []
    for m in messages:
        if isinstance(m["content"], str):
            template_messages.append(m)
            continue
        parts = []
        for p in m["content"]:
            if p["type"] == "text":
                parts.append(p)
            else:
                parts.append({"type": "image"})
                data = base64.b64decode(p["image_url"]["url"].split(",", 1)[1])
                images.append(Image.open(io.BytesIO(data)).convert("RGB"))
        template_messages.append({"role": m["role"], "content": parts})
    return template_messages, images


def generate(model: Any, inputs: dict[str, Any]) -> tuple[list[int], list[float], int]:
    """transformers' ``MAX_TOKENS`` greedy tokens for ``inputs`` (no EOS stop), their logprobs and
    the prompt's length."""
    import torch

    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            eos_token_id=None,
        )
    length = inputs["input_ids"].shape[1]
    new = out.sequences[0, length:].tolist()
    logprobs = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, new, strict=True)]
    return new, logprobs, length


def check_served_as(response: httpx.Response, want: tuple[list[int], list[float], int]) -> None:
    """A served chat (``chat``) gave transformers' prompt length, greedy tokens and their logprobs
    (within 2e-4): ``want`` as ``generate`` returns them."""
    tokens, logprobs, length = want
    got, got_lps = served(response)
    assert response.json()["usage"]["prompt_tokens"] == length  # the processor's expansion, token for token
    assert got == tokens
    np.testing.assert_allclose(got_lps, logprobs, atol=2e-4)


def check_concurrent_equal_alone(
    checkpoint: Path,
    model: str,
    cases: list[list[dict[str, Any]]],
    *,
    num_pages: int,
    max_model_len: int,
    max_tokens: int = 24,
) -> None:
    """``cases`` at once (case 5 with ``n = 2``) on an engine of its own whose pool (``num_pages``
    of the tiny engine's 8 tokens) is too small for them (it must preempt): each answer equals its
    chat's alone."""
    from test_server import LiveServer

    from myserve.frontend.app import create_app
    from myserve.testing import TINY_ENGINE, start_service

    settings = (
        f"engine.num_pages={num_pages}",
        f"model.max_model_len={max_model_len}",
        f"model.tokenizer={checkpoint}",
    )
    svc = start_service(checkpoint, *TINY_ENGINE, *settings)
    live = LiveServer(create_app(svc, served_model_name=model))
    try:
        _check_concurrent(svc, live.url, model, cases, max_tokens)
    finally:
        live.stop()
        svc.shutdown()


def _check_concurrent(svc: Any, url: str, model: str, cases: list[list[dict[str, Any]]], max_tokens: int) -> None:
    def body(messages: list[dict[str, Any]], n: int = 1) -> dict[str, Any]:
        return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "n": n}  # fmt: skip

    async def together() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            calls = [client.post("/v1/chat/completions", json=body(m, 2 if i == 5 else 1)) for i, m in enumerate(cases)]
            return await asyncio.gather(*calls)

    preempted = svc.stats().num_preemptions
    responses = asyncio.run(together())
    assert svc.stats().num_preemptions > preempted
    for i, (messages, response) in enumerate(zip(cases, responses, strict=True)):
        assert response.status_code == 200, response.text
        alone = httpx.post(f"{url}/v1/chat/completions", json=body(messages), timeout=120).json()
        want = alone["choices"][0]["message"]["content"]
        assert [c["message"]["content"] for c in response.json()["choices"]] == [want] * (2 if i == 5 else 1)


def mesh_tokens(checkpoint: Path, *meshes: str) -> dict[str, list[list[int]]]:
    """Each mesh's (``DATAxMODEL``) greedy tokens for 4 concurrent image chats
    (``vision_mesh_worker.py``, in a subprocess of fake CPU devices)."""
    worker = Path(__file__).with_name("vision_mesh_worker.py")
    proc = subprocess.run(
        [sys.executable, str(worker), str(checkpoint), *meshes], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
