"""Run in a subprocess with 4 fake CPU devices: greedy tokens of 4 concurrent image chats through
a GenerationService on each mesh, printed as JSON (``test_llava.py``'s mesh test).

Usage: python tests/vision_mesh_worker.py LLAVA_CHECKPOINT MESH [MESH ...]  (MESH: "2x2" = data x model)
"""

from __future__ import annotations

import asyncio
import base64
import functools
import io
import json
import sys
from pathlib import Path

from fake_devices import use_fake_cpu_devices

use_fake_cpu_devices(4)

from myserve.testing import TINY_ENGINE, start_service  # noqa: E402
from myserve.testing.services import collect  # noqa: E402
from myserve.wire.params import SamplingParams  # noqa: E402


def png(size: int, colour: tuple[int, int, int]) -> str:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size + 7), colour)
    ImageDraw.Draw(image).ellipse((3, 5, size - 4, size - 2), fill=tuple(255 - c for c in colour))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def main(checkpoint: str, meshes: list[str]) -> None:
    images = [png(40 + 4 * i, (60 * i, 200 - 40 * i, 90)) for i in range(4)]
    # Chat i: image i, and chats 1 and 3 a second image too (the next one).
    chats = [[images[i], *([images[(i + 1) % 4]] if i % 2 else [])] for i in range(4)]
    result = {}
    for mesh in meshes:
        data, model = mesh.split("x")
        svc = start_service(
            Path(checkpoint), *TINY_ENGINE, "engine.num_pages=64", f"model.tokenizer={checkpoint}",
            f"mesh.data={data}", f"mesh.model={model}",
        )  # fmt: skip
        try:
            assert svc.images is not None
            streams = []
            for i in range(4):
                urls = chats[i]
                parts = [{"type": "image"} for _ in urls] + [{"type": "text", "text": f"Picture {i}?"}]
                text = svc.tokenizer.render_chat([{"role": "user", "content": parts}])
                encode = functools.partial(svc.tokenizer.encode, add_special_tokens=False)
                prompt, inputs = svc.images.expand(text, asyncio.run(svc.images.pixels(urls)), encode)
                params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
                streams.append(svc.submit(prompt, params, images=inputs))
            result[mesh] = [collect(s)[0] for s in streams]
        finally:
            svc.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
