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
from myserve.models.vision_qwen import encode_qwen_image, grid_arrays
from myserve.models.vision_spec import VisionSpec
from myserve.runtime.mesh import replicated

logger = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 256 * 1024 * 1024
"""The encoder cache's bound: embeddings of recently seen images (float32) up to this many bytes."""


@functools.partial(jax.jit, static_argnums=0)
def _encode(spec: VisionSpec, tower: Tower, pixels: jax.Array) -> jax.Array:
    return encode_images(spec, tower, pixels)


@functools.partial(jax.jit, static_argnums=0)
def _encode_grid(spec: VisionSpec, tower: Tower, patches: jax.Array, arrays: dict[str, jax.Array]) -> jax.Array:
    return encode_qwen_image(spec, tower, patches, arrays)


class ImageEncoder:
    """A vision-language model's tower, replicated on the mesh, with its cache of encoded images.

    A tower of one image size has one executable, built at warm-up; a tower of variable sizes
    (Qwen2.5-VL) one per patch grid, built the first time an image of that grid comes (each counted
    by the compile counter)."""

    def __init__(self, spec: VisionSpec, tower: Tower, mesh: Mesh, cache_bytes: int = DEFAULT_CACHE_BYTES):
        """``tower``: host arrays (``models/vision.read_tower``), placed on every device of ``mesh``."""
        self.spec = spec
        self.image_token_id = spec.image_token_id
        self.whole_images = spec.bidirectional
        self._tower: Any = jax.device_put(tower, replicated(mesh))
        self._sharding = replicated(mesh)
        self._grids: dict[tuple[int, int], Any] = {}  # a variable-size tower's arrays per grid, on the devices
        self._cache: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self._cache_bytes = cache_bytes
        self._held = 0
        self.encoded = 0
        """Images run through the tower since start."""
        self.cache_hits = 0
        """Images whose embeddings came from the cache."""

    def layout(self, grid: tuple[int, ...]) -> tuple[tuple[int, ...], int, tuple[int, ...]] | None:
        """The pixels' shape, tokens and M-RoPE (rows, columns) of an image of patch ``grid``
        (``core/images.py::ImageEncoding``); None for a grid the tower cannot take."""
        spec = self.spec
        if not spec.variable_size:
            return ((3, spec.image_size, spec.image_size), spec.tokens_per_image, ()) if not grid else None
        m = spec.merge_size
        if len(grid) != 3 or grid[0] != 1 or min(grid) <= 0 or grid[1] % m or grid[2] % m:
            return None  # (one frame: a still image)
        _, h, w = grid
        return (h * w, 3 * spec.temporal_patch_size * spec.patch_size**2), h * w // (m * m), (h // m, w // m)

    def warm_up(self) -> None:
        """Build a fixed-size tower's executable (on an image of zeros, nothing cached), so that the
        first image a request brings is not the one that compiles it."""
        if self.spec.variable_size:
            return  # (an executable per grid: built by the first image of each)
        zeros = np.zeros((1, 3, self.spec.image_size, self.spec.image_size), np.float32)
        jax.block_until_ready(_encode(self.spec, self._tower, jax.device_put(zeros, self._sharding)))

    def embeddings(self, key: str, pixels: np.ndarray, grid: tuple[int, ...] = ()) -> np.ndarray:
        """float32 [tokens, text hidden] of the image of content ``key`` (``pixels``: [3, S, S], or
        the patches of ``grid``): cached, or encoded now."""
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            self.cache_hits += 1
            return cached
        t0 = time.perf_counter()
        if self.spec.variable_size:
            arrays = self._grid_arrays(grid[1], grid[2])
            encoded = _encode_grid(self.spec, self._tower, jax.device_put(pixels, self._sharding), arrays)
        else:
            encoded = _encode(self.spec, self._tower, jax.device_put(pixels[None], self._sharding))[0]
        out = np.asarray(encoded, np.float32)
        out.flags.writeable = False  # shared by every sequence of the image
        self.encoded += 1
        logger.debug("encoded an image %s in %.1f ms", pixels.shape, 1e3 * (time.perf_counter() - t0))
        self._cache[key] = out
        self._held += out.nbytes
        while self._held > self._cache_bytes and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._held -= old.nbytes
        return out

    def _grid_arrays(self, rows: int, columns: int) -> Any:
        """The tower's per-grid arrays (window order, rotary positions) on the devices, made once."""
        arrays = self._grids.get((rows, columns))
        if arrays is None:
            arrays = jax.device_put(grid_arrays(self.spec, rows, columns), self._sharding)
            self._grids[rows, columns] = arrays
        return arrays
