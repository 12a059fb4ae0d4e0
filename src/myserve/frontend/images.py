"""Images of chat messages, in the front end: fetched, decoded, checked, preprocessed by the
checkpoint's own image processor, and turned into the prompt's placeholder tokens.

Where an image may come from: a ``data:`` URL (base64) always; ``http(s)://`` only from the hosts
``model.allowed_media_domains`` names (vLLM's ``--allowed-media-domains``); ``file://`` only under
``model.allowed_local_media_path``. Every refusal is a 400 naming the part (``messages``), never a
500 and never a hang: fetches have a timeout and a size bound, decoding a pixel bound checked from
the header before any pixel is decoded.

The processor is transformers' (``AutoImageProcessor``, its PIL backend: no torch), loaded from the
checkpoint directory; its output (float32 [3, S, S], or a variable-size tower's patches and their
grid) travels to the engine core as an ``ImageInput`` (``wire/images.py``), where the vision tower
runs.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import logging
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from myserve.frontend.errors import APIError
from myserve.wire.images import ImageInput, ImageModel

if TYPE_CHECKING:
    from myserve.config.schema import ModelConfig

logger = logging.getLogger(__name__)

MIN_IMAGE_SIDE = 8
"""Pixels per side an image needs at least (smaller ones carry nothing a vision tower can read)."""
MAX_IMAGE_PIXELS = 32 * 1024 * 1024
"""Pixels an image may have at most (checked from its header, before decoding: a decompression bomb
of a small PNG is refused without allocating it)."""
MAX_FETCH_BYTES = 20 * 1024 * 1024
"""Bytes an image fetched from a URL or file may have."""
FETCH_TIMEOUT_S = 10.0


class Processed(NamedTuple):
    """An image as the checkpoint's processor left it: float32 pixels [3, S, S], or (a tower of
    variable sizes, Qwen2.5-VL) its patches [rows * columns, patch values] and their ``grid``
    (frames, rows, columns)."""

    pixels: np.ndarray
    grid: tuple[int, ...]


def bad_image(message: str, code: str = "invalid_image") -> APIError:
    """The 400 of an image part the server cannot use."""
    return APIError(400, message, param="messages", code=code)


class ImageSupport:
    """A vision-language model's image input: its processor, its placeholder, and the rules."""

    def __init__(
        self,
        model: ImageModel,
        processor: Any,
        *,
        limit: int,
        allowed_domains: Sequence[str] = (),
        local_path: Path | None = None,
    ):
        self.model = model
        self.processor = processor
        self.limit = limit
        """Images per prompt at most (``model.limit_mm_per_prompt``)."""
        self.allowed_domains = frozenset(d.lower() for d in allowed_domains)
        self.local_path = None if local_path is None else local_path.resolve()

    @staticmethod
    def load(image_model: ImageModel | None, model: ModelConfig) -> ImageSupport | None:
        """The image input the engine said its model has (None: a text-only model), with
        ``model``'s limits; the processor comes from the checkpoint directory."""
        if image_model is None:
            return None
        from transformers import AutoImageProcessor

        processor = AutoImageProcessor.from_pretrained(image_model.directory, backend="pil")
        local = model.allowed_local_media_path
        return ImageSupport(
            image_model,
            processor,
            limit=model.images_per_prompt,
            allowed_domains=model.allowed_media_domains,
            local_path=None if local is None else Path(local).expanduser(),
        )

    async def pixels(self, urls: Sequence[str]) -> list[Processed]:
        """Each image preprocessed, in order (read and decoded on a worker thread: the event loop
        keeps serving)."""
        if len(urls) > self.limit:
            raise bad_image(f"at most {self.limit} images per prompt (--limit-mm-per-prompt), got {len(urls)}")
        return [await asyncio.to_thread(self._one, url, i) for i, url in enumerate(urls)]

    def _one(self, url: str, index: int) -> Processed:
        data = self._read(url, index)
        image = _decode(data, index)
        out = self.processor(images=[image], return_tensors="np")
        pixels = np.asarray(out["pixel_values"], np.float32)
        if "image_grid_thw" in out:  # a tower of variable sizes: the image's patches and their grid
            return Processed(pixels, tuple(int(d) for d in np.asarray(out["image_grid_thw"])[0]))
        return Processed(pixels[0], ())

    def _read(self, url: str, index: int) -> bytes:
        """The bytes of image ``index``'s URL, where the deployment allows reading it."""
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return _data_url(url, index)
        if scheme in ("http", "https"):
            host = (urllib.parse.urlsplit(url).hostname or "").lower()
            if host not in self.allowed_domains:
                raise bad_image(
                    f"image {index}: fetching images from {host or 'that URL'} is not allowed "
                    f"(--allowed-media-domains); send a data: URL",
                    code="forbidden_media_url",
                )
            if _is_private(host):
                raise bad_image(f"image {index}: {host} is a private address", code="forbidden_media_url")
            return _fetch(url, index)
        if scheme == "file":
            return self._local(url, index)
        raise bad_image(f"image {index}: unsupported URL scheme {scheme or url[:16]!r}; send a data: URL")

    def _local(self, url: str, index: int) -> bytes:
        if self.local_path is None:
            raise bad_image(
                f"image {index}: local files are not served (--allowed-local-media-path)", code="forbidden_media_url"
            )
        path = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path)).resolve()
        if not path.is_relative_to(self.local_path):
            raise bad_image(f"image {index}: the file is outside the allowed media path", code="forbidden_media_url")
        try:
            if path.stat().st_size > MAX_FETCH_BYTES:
                raise bad_image(f"image {index}: larger than {MAX_FETCH_BYTES} bytes")
            return path.read_bytes()
        except OSError:
            raise bad_image(f"image {index}: cannot read the file") from None

    def expand(
        self, text: str, images: Sequence[Processed], encode: Callable[[str], list[int]]
    ) -> tuple[list[int], list[ImageInput]]:
        """The rendered chat ``text``'s tokens with each image's mark (what the chat template wrote)
        expanded as the model's processor does it (in the text, before tokenizing, so the tokens
        around an image are the processor's too), and the images placed at their tokens' runs."""
        model = self.model
        pieces = text.split(model.placeholder)
        if len(pieces) - 1 != len(images):
            raise bad_image(
                f"the prompt has {len(pieces) - 1} image placeholders for {len(images)} images "
                f"(does the text contain the model's image mark {model.placeholder!r}?)"
            )
        counts = [model.tokens(image.grid) for image in images]
        out = [pieces[0]]
        for piece, n in zip(pieces[1:], counts, strict=True):
            out += [model.before, model.image_token * n, model.after, piece]
        ids = encode("".join(out))
        token = model.image_token_id
        starts = [i for i, t in enumerate(ids) if t == token and (i == 0 or ids[i - 1] != token)]
        if len(starts) != len(images) or ids.count(token) != sum(counts):
            raise bad_image("the prompt's text holds the model's image token itself")
        placed = zip(starts, counts, images, strict=True)
        return ids, [ImageInput.of(image.pixels, at, n, image.grid) for at, n, image in placed]


def _data_url(url: str, index: int) -> bytes:
    """A ``data:[<type>][;base64],<data>`` URL's bytes (base64 only: images are binary)."""
    head, sep, payload = url.partition(",")
    if not sep or not head.lower().endswith(";base64"):
        raise bad_image(f"image {index}: a data: URL must be base64 (data:image/png;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_image(f"image {index}: the data: URL is not valid base64") from None


def _decode(data: bytes, index: int) -> Any:
    """A PIL image of ``data`` in RGB, its size checked before its pixels are decoded."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if min(width, height) < MIN_IMAGE_SIDE:
            raise bad_image(f"image {index}: {width}x{height} is smaller than {MIN_IMAGE_SIDE}x{MIN_IMAGE_SIDE} pixels")
        if width * height > MAX_IMAGE_PIXELS:
            raise bad_image(f"image {index}: {width}x{height} is more than {MAX_IMAGE_PIXELS} pixels")
        image.load()  # decodes now: a truncated file fails here, not in the processor
        return image.convert("RGB")
    except APIError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise bad_image(f"image {index}: cannot decode it ({type(e).__name__}: {e})") from None


def _is_private(host: str) -> bool:
    """Whether ``host`` is a literal loopback, private or link-local address (an allowed name that
    resolves there is the operator's choice)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_private or address.is_loopback or address.is_link_local


def _fetch(url: str, index: int) -> bytes:
    """GET ``url``: at most ``MAX_FETCH_BYTES``, within ``FETCH_TIMEOUT_S``."""
    try:
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as response:  # noqa: S310 - scheme checked
            data = response.read(MAX_FETCH_BYTES + 1)
    except (OSError, ValueError) as e:
        raise bad_image(f"image {index}: cannot fetch it ({type(e).__name__})", code="media_fetch_failed") from None
    if len(data) > MAX_FETCH_BYTES:
        raise bad_image(f"image {index}: larger than {MAX_FETCH_BYTES} bytes")
    return data
