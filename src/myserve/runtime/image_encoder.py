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
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from myserve.models.checkpoint import max_image_patches
from myserve.models.vision import Tower, encode_images
from myserve.models.vision_qwen import encode_qwen_image, grid_arrays, patch_buckets
from myserve.models.vision_spec import VisionSpec
from myserve.runtime.mesh import replicated

logger = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 256 * 1024 * 1024
WARM_PATCHES = 4096
"""A variable-size tower's buckets up to this many patches (an image of about 900 x 900 pixels at
Qwen2.5-VL's 14-pixel patches) are built at warm-up; larger ones by their first image."""
"""The encoder cache's bound: embeddings of recently seen images (float32) up to this many bytes."""


@functools.partial(jax.jit, static_argnums=0)
def _encode(spec: VisionSpec, tower: Tower, pixels: jax.Array) -> jax.Array:
    return encode_images(spec, tower, pixels)


@functools.partial(jax.jit, static_argnums=0)
def _encode_grid(spec: VisionSpec, tower: Tower, patches: jax.Array, arrays: dict[str, jax.Array]) -> jax.Array:
    return encode_qwen_image(spec, tower, patches, arrays)


class ImageEncoder:
    """A vision-language model's tower, replicated on the mesh, with its cache of encoded images.

    A tower of one image size has one executable, built at warm-up. A tower of variable sizes
    (Qwen2.5-VL) pads an image's patches up to a bucket (``patch_buckets``: powers of two up to the
    processor's largest image) and has one executable per bucket: those up to ``WARM_PATCHES``
    built at warm-up, larger ones by their first image (counted by the compile counter)."""

    def __init__(
        self,
        spec: VisionSpec,
        tower: Tower,
        mesh: Mesh,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        checkpoint_dir: Path | None = None,
    ):
        """``tower``: host arrays (``models/vision.read_tower``), placed on every device of ``mesh``;
        ``checkpoint_dir``: where a variable-size tower's image processor says its largest image."""
        self.spec = spec
        self.buckets: tuple[int, ...] = ()
        if spec.variable_size:
            most = max_image_patches(checkpoint_dir, spec) if checkpoint_dir is not None else 16384
            self.buckets = patch_buckets(spec, most)
        self.image_token_id = spec.image_token_id
        self.whole_images = spec.bidirectional
        self._tower: Any = jax.device_put(tower, replicated(mesh))
        self._sharding = replicated(mesh)
        self._patch_values = 3 * spec.temporal_patch_size * spec.patch_size**2
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
        if self.spec.variable_size:  # each bucket's executable, on padding alone (a merged token's grid)
            m = self.spec.merge_size
            for bucket in (b for b in self.buckets if b <= WARM_PATCHES):
                arrays = jax.device_put(grid_arrays(self.spec, m, m, bucket), self._sharding)
                zeros = jax.device_put(np.zeros((bucket, self._patch_values), np.float32), self._sharding)
                jax.block_until_ready(_encode_grid(self.spec, self._tower, zeros, arrays))
            return
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
            arrays, bucket = self._grid_arrays(grid[1], grid[2])
            padded = np.zeros((bucket, pixels.shape[1]), np.float32)
            padded[: len(pixels)] = pixels
            tokens = len(pixels) // self.spec.merge_size**2
            encoded = _encode_grid(self.spec, self._tower, jax.device_put(padded, self._sharding), arrays)
            out = np.asarray(encoded, np.float32)[:tokens]  # (sliced on the host: a device slice compiles per size)
        else:
            encoded = _encode(self.spec, self._tower, jax.device_put(pixels[None], self._sharding))
            out = np.asarray(encoded, np.float32)[0]
        out.flags.writeable = False  # shared by every sequence of the image
        self.encoded += 1
        logger.debug("encoded an image %s in %.1f ms", pixels.shape, 1e3 * (time.perf_counter() - t0))
        self._cache[key] = out
        self._held += out.nbytes
        while self._held > self._cache_bytes and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._held -= old.nbytes
        return out

    def _grid_arrays(self, rows: int, columns: int) -> tuple[Any, int]:
        """A grid's arrays (window order, rotary positions) padded to the smallest bucket they fit,
        on the devices, made once; and that bucket (past the largest: the grid's own size)."""
        found = self._grids.get((rows, columns))
        if found is None:
            for bucket in (*(b for b in self.buckets if b >= rows * columns), None):
                try:
                    arrays = grid_arrays(self.spec, rows, columns, bucket)
                    break
                except ValueError:  # (a grid of more windows than the bucket holds: the next one)
                    continue
            found = jax.device_put(arrays, self._sharding), bucket or rows * columns
            self._grids[rows, columns] = found
        return found
