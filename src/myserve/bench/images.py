"""Image requests for the HTTP benchmark (``python -m myserve.bench --images distinct|same``): one
image per chat prompt, of a fixed size, drawn here (no files, no network).

``distinct``: every request its own image, so each is encoded by the vision tower and its tokens
prefilled; ``same``: one image for every request, so after the first the encoder cache and the
prefix cache serve it (what a cache hit is worth shows as the difference between the two runs).
"""

from __future__ import annotations

import base64
import io
from typing import Any

IMAGE_MODES = ("none", "distinct", "same")


def image_data_url(size: int, seed: int) -> str:
    """A ``size`` x ``size`` PNG as a ``data:`` URL: a background, a rectangle and an ellipse in
    colours from ``seed`` (different seeds, different images)."""
    import random

    from PIL import Image, ImageDraw

    rng = random.Random(seed)

    def colour() -> tuple[int, int, int]:
        return rng.randrange(256), rng.randrange(256), rng.randrange(256)

    image = Image.new("RGB", (size, size), colour())
    draw = ImageDraw.Draw(image)
    draw.rectangle((size // 8, size // 6, size // 2, size // 2), fill=colour())
    draw.ellipse((size // 3, size // 3, size - 2, size - 2), fill=colour())
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def with_image(body: dict[str, Any], url: str) -> dict[str, Any]:
    """A chat request ``body`` whose last user message starts with the image at ``url``."""
    messages = [dict(m) for m in body["messages"]]
    last = max(i for i, m in enumerate(messages) if m["role"] == "user")
    content = messages[last]["content"]
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
    messages[last]["content"] = [{"type": "image_url", "image_url": {"url": url}}, *parts]
    return {**body, "messages": messages}


def with_images(bodies: list[dict[str, Any]], mode: str, size: int) -> list[dict[str, Any]]:
    """``bodies`` with one image each, as ``mode`` says (``none``: unchanged)."""
    if mode == "none":
        return bodies
    shared = image_data_url(size, 0)
    return [with_image(b, shared if mode == "same" else image_data_url(size, i + 1)) for i, b in enumerate(bodies)]
