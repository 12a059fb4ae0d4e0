"""An image of a prompt as it travels from the front end to the engine core: preprocessed pixels
(the checkpoint's own image processor ran in the front end) and where its placeholder tokens sit."""

from __future__ import annotations

import hashlib

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

    @staticmethod
    def of(pixels: np.ndarray, offset: int, length: int) -> ImageInput:
        """The image of float32 ``pixels`` [C, H, W] whose placeholders start at ``offset``."""
        data = np.ascontiguousarray(pixels, dtype="<f4")
        shape = tuple(int(d) for d in data.shape)
        key = hashlib.blake2b(repr(shape).encode() + data.tobytes(), digest_size=16).hexdigest()
        return ImageInput(key, offset, length, shape, data.tobytes())

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
    placeholder: str
    """What the chat template writes for an image (LLaVA: ``<image>``; Gemma 3: ``<start_of_image>``)."""
    replacement: str
    """The text that takes its place: the image's tokens, with the family's markers around them."""
