"""An image of a prompt as it travels from the front end to the engine core: preprocessed pixels
(the checkpoint's own image processor ran in the front end) and where its placeholder tokens sit."""

from __future__ import annotations

import hashlib
import math

import msgspec
import numpy as np


class ImageInput(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One image of a request's prompt.

    ``pixels`` are the processor's float32 values, little-endian, of shape ``shape`` (channels,
    height, width); the prompt holds the model's image token at ``offset .. offset + length``.
    ``key`` names the content (a hash of shape and pixels): the engine's encoder cache and the
    prefix cache's page hashes use it, so the same image is neither encoded nor prefilled twice,
    and two images never share a cached page."""

    key: str
    offset: int
    length: int
    shape: tuple[int, ...]
    pixels: bytes
    grid: tuple[int, ...] = ()
    """A tower of variable image sizes (Qwen2.5-VL): the image's patch grid (frames, rows, columns),
    its pixels being the processor's patches [rows * columns, patch values]; empty otherwise."""

    @staticmethod
    def of(pixels: np.ndarray, offset: int, length: int, grid: tuple[int, ...] = ()) -> ImageInput:
        """The image of float32 ``pixels`` ([C, H, W], or patches of ``grid``) whose placeholders
        start at ``offset``."""
        data = np.ascontiguousarray(pixels, dtype="<f4")
        shape = tuple(int(d) for d in data.shape)
        key = hashlib.blake2b(repr((shape, grid)).encode() + data.tobytes(), digest_size=16).hexdigest()
        return ImageInput(key, offset, length, shape, data.tobytes(), grid)

    def array(self) -> np.ndarray:
        """The pixels as a float32 array of ``shape`` (read-only, over the message's bytes)."""
        return np.frombuffer(self.pixels, dtype="<f4").reshape(self.shape)


class ImageModel(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """What the front end needs of a vision-language model to prepare its images: where its image
    processor's config is, the image token and how many of them stand for one image, and how the
    model's processor expands the chat template's mark of an image in the prompt's text."""

    directory: str
    """The checkpoint directory (its ``preprocessor_config.json``)."""
    image_token_id: int
    tokens_per_image: int
    """0: each image has its own, its patch grid's cells over ``merge_size`` squared (Qwen2.5-VL)."""
    placeholder: str
    """What the chat template writes for an image (LLaVA: ``<image>``; Gemma 3: ``<start_of_image>``)."""
    before: str
    """The text the processor puts before an image's tokens in the placeholder's place."""
    image_token: str
    """The image token's text, repeated once per token of the image."""
    after: str
    """The text after the image's tokens."""
    merge_size: int = 1

    def tokens(self, grid: tuple[int, ...]) -> int:
        """Tokens of an image of patch ``grid`` (empty: a fixed-size tower's)."""
        if self.tokens_per_image:
            return self.tokens_per_image
        return math.prod(grid) // (self.merge_size * self.merge_size)
