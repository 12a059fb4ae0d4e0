"""The vision tower as the engine runs it: one jitted executable per image size, and an encoder cache.

The engine core asks for an image's token embeddings when it admits a request (``core/images.py``).
A cached image (same content key) is not encoded again: the cache holds the embeddings of the
most recently used images, bounded in bytes. An image is encoded alone (a batch of one): the tower
runs once per distinct image, far less often than the decoder's steps, so batching images across
requests would buy little and cost a compile per batch size.
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from myserve.models.vision import Tower, encode_images
from myserve.models.vision_spec import VisionSpec
from myserve.runtime.mesh import replicated

logger = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 256 * 1024 * 1024
"""The encoder cache's bound: embeddings of recently seen images (float32) up to this many bytes."""


@functools.partial(jax.jit, static_argnums=0)
def _encode(spec: VisionSpec, tower: Tower, pixels: jax.Array) -> jax.Array:
    return encode_images(spec, tower, pixels)


class ImageEncoder:
    """A vision-language model's tower, replicated on the mesh, with its cache of encoded images."""

    def __init__(self, spec: VisionSpec, tower: Tower, mesh: Mesh, cache_bytes: int = DEFAULT_CACHE_BYTES):
        """``tower``: host arrays (``models/vision.read_tower``), placed on every device of ``mesh``."""
        self.spec = spec
        self.image_token_id = spec.image_token_id
        self.tokens_per_image = spec.tokens_per_image
        self.whole_images = spec.bidirectional
        self.image_shape = (3, spec.image_size, spec.image_size)
        self._tower: Any = jax.device_put(tower, replicated(mesh))
        self._sharding = replicated(mesh)
        self._cache: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self._cache_bytes = cache_bytes
        self._held = 0
        self.encoded = 0
        """Images run through the tower since start."""
        self.cache_hits = 0
        """Images whose embeddings came from the cache."""

    def warm_up(self) -> None:
        """Build the tower's executable (on an image of zeros, nothing cached), so that the first
        image a request brings is not the one that compiles it."""
        zeros = np.zeros((1, *self.image_shape), np.float32)
        jax.block_until_ready(_encode(self.spec, self._tower, jax.device_put(zeros, self._sharding)))

    def embeddings(self, key: str, pixels: np.ndarray) -> np.ndarray:
        """float32 [tokens_per_image, text hidden] of the image of content ``key`` (``pixels``
        [3, S, S]): cached, or encoded now."""
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            self.cache_hits += 1
            return cached
        t0 = time.perf_counter()
        placed = jax.device_put(pixels[None], self._sharding)
        out = np.asarray(_encode(self.spec, self._tower, placed)[0], np.float32)
        out.flags.writeable = False  # shared by every sequence of the image
        self.encoded += 1
        logger.debug("encoded an image %s in %.1f ms", pixels.shape, 1e3 * (time.perf_counter() - t0))
        self._cache[key] = out
        self._held += out.nbytes
        while self._held > self._cache_bytes and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._held -= old.nbytes
        return out
