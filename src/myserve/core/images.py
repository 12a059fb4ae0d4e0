"""Images in the engine core (host side, no JAX): where a sequence's image tokens sit, what the
prefix cache hashes in their place, and which embeddings a step's flat tokens take.

A prompt carries an image as a run of the model's image token (``ImageInput.offset``,
``length``). The vision tower's output for it (``runtime/image_encoder.py``, cached by the image's
content key) replaces those tokens' embeddings in every step that computes them: a prefill
chunk, a chunk of it, or its recompute after preemption. Page hashes see a value derived from the
image's key at each of its positions instead of the placeholder token, so a cached page holding
image tokens is found again only for the same image at the same place.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence
from typing import Protocol

import msgspec
import numpy as np

from myserve.runtime.step_layout import Span
from myserve.runtime.step_ops import StepCall
from myserve.wire.images import ImageInput
from myserve.wire.params import InvalidParams


class _WithImages(Protocol):
    images: tuple[ImageSpan, ...]


class _Chunk(Protocol):
    """What ``images_in`` reads of a ``ScheduledChunk`` (not imported: the scheduler imports this module)."""

    @property
    def seq(self) -> _WithImages: ...

    @property
    def start(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...


_POSITION_BITS = 20
"""Bits of an image's hash values that number its positions (images of up to ~1M tokens)."""


@dataclasses.dataclass(frozen=True, eq=False)
class ImageSpan:
    """One image of a sequence: its placeholder run ``offset .. offset + length`` and the token
    embeddings [length, embed] (float32, the vision tower's output) those positions take."""

    key: str
    offset: int
    length: int
    embeddings: np.ndarray
    whole: bool = False
    """Its tokens attend to each other both ways (Gemma 3): a step computes them all or none of them."""
    grid: tuple[int, ...] = ()
    """M-RoPE (Qwen2.5-VL): its tokens as (rows, columns), placed in 2D; empty: in a row, as text."""

    @property
    def stop(self) -> int:
        """The position after its last token."""
        return self.offset + self.length

    @property
    def rope_shift(self) -> int:
        """How much earlier than their positions (M-RoPE) the tokens after it sit: transformers
        advances the rotary position by ``max(rows, columns)`` over an image, not by its tokens."""
        return self.length - max(self.grid) if self.grid else 0

    def hash_values(self) -> np.ndarray:
        """int64 [length]: what page hashes see at its positions instead of the image token. Negative,
        so never a token id; distinct per image key and position."""
        base = int(self.key[:10], 16) & ((1 << 40) - 1)  # 40 bits of the content hash
        return -1 - ((base << _POSITION_BITS) | np.arange(self.length, dtype=np.int64))


class ImageEncoding(Protocol):
    """What the engine core needs of a vision tower (``runtime/image_encoder.py``)."""

    image_token_id: int
    whole_images: bool
    """An image's tokens attend to each other both ways, so a step computes them all or none."""
    encoded: int
    """Images run through the tower so far."""
    cache_hits: int
    """Images whose embeddings came from the encoder cache."""

    def layout(self, grid: tuple[int, ...]) -> tuple[tuple[int, ...], int, tuple[int, ...]] | None:
        """For an image of patch ``grid`` (``ImageInput.grid``; empty for a fixed-size tower): the
        pixels' shape the tower takes, the tokens the image stands for and their M-RoPE (rows,
        columns) or ``()``; None for a grid the tower cannot take."""
        ...

    def embeddings(self, key: str, pixels: np.ndarray, grid: tuple[int, ...]) -> np.ndarray:
        """float32 [tokens, embed] of the image of content ``key`` (from the encoder cache, or its
        ``pixels`` of patch ``grid`` encoded now)."""
        ...


def rope_offset(images: Iterable[ImageSpan], position: int) -> int:
    """What M-RoPE adds to ``position`` for its rotary position: the shifts of the images before it."""
    return -sum(image.rope_shift for image in images if image.stop <= position)


def check_images(
    prompt: Sequence[int], images: Sequence[ImageInput], encoder: ImageEncoding | None, limit: int | None = None
) -> None:
    """Refuse images a model cannot take, or placeholders that do not match them: every image's run
    of image tokens inside the prompt, in order, not overlapping, and no image token elsewhere."""
    if not images:
        if encoder is not None and encoder.image_token_id in prompt:
            raise InvalidParams("messages", "the prompt holds image tokens but no image")
        return
    if encoder is None:
        raise InvalidParams("messages", "this model does not take images")
    if limit is not None and len(images) > limit:
        raise InvalidParams("messages", f"at most {limit} images per prompt")
    expected = np.zeros(len(prompt), bool)
    end = 0
    for image in images:
        layout = encoder.layout(tuple(image.grid))
        if layout is None:
            raise InvalidParams("messages", f"the vision tower cannot take an image of grid {list(image.grid)}")
        shape, tokens, _ = layout
        if tuple(image.shape) != shape or len(image.pixels) != 4 * int(np.prod(image.shape)):
            raise InvalidParams("messages", f"an image's pixels must be float32 of shape {shape}")
        if image.length != tokens:
            raise InvalidParams("messages", f"an image takes {tokens} tokens, not {image.length}")
        # (Not the prompt's last token either: a one-token chunk of it could be planned as a decode.)
        if image.offset < end or image.offset + image.length >= len(prompt):
            raise InvalidParams("messages", "image placeholders out of order, outside the prompt, or at its end")
        expected[image.offset : image.offset + image.length] = True
        end = image.offset + image.length
    actual = np.asarray(prompt, np.int64) == encoder.image_token_id
    if not np.array_equal(actual, expected):
        raise InvalidParams("messages", "the prompt's image tokens do not match its images")


def hash_tokens(tokens: list[int], start: int, images: Iterable[ImageSpan]) -> list[int]:
    """``tokens`` (positions ``start ..``) with each image position's hash value in place of its token."""
    stop = start + len(tokens)
    out = tokens
    for image in images:
        lo, hi = max(start, image.offset), min(stop, image.stop)
        if lo < hi:
            if out is tokens:
                out = list(tokens)
            out[lo - start : hi - start] = image.hash_values()[lo - image.offset : hi - image.offset].tolist()
    return out


def chunk_bounds(images: Iterable[ImageSpan], start: int, n: int) -> tuple[int, int]:
    """For a prompt chunk of ``n`` tokens from position ``start``: (the fewest tokens it may take:
    the rest of a ``whole`` image it starts inside, else 1; ``n`` cut back so that it ends before a
    ``whole`` image it would split). A chunk shorter than the first cannot run this step."""
    least = 1
    for image in images:
        if not image.whole:
            continue
        if image.offset <= start < image.stop:
            least = image.stop - start
        elif start < image.offset < start + n < image.stop:
            n = image.offset - start
    return least, n


type PlacedImages = list[tuple[Sequence[ImageSpan], int, int, int]]
"""A step's chunks that compute image tokens: (the sequence's images, the chunk's first position,
its length, its first flat index in the step)."""


def images_in(chunks: Sequence[_Chunk], spans: Sequence[Span]) -> PlacedImages:
    """The chunks of a step (laid out as ``spans``) that compute image tokens: prompt chunks only
    (a decode comes after every image)."""
    offsets = itertools.accumulate((len(span.token_ids) for span in spans), initial=0)
    return [
        (c.seq.images, c.start, c.num_tokens, at)
        for c, at in zip(chunks, offsets, strict=False)
        if c.seq.images and c.start < c.seq.images[-1].stop
    ]


def with_step_images(call: StepCall, placed: PlacedImages) -> StepCall:
    """``call`` with the image embeddings its step's flat tokens take (as it is without any)."""
    images = step_images(placed, call.shape.tokens) if placed else None
    if images is None:
        return call
    return msgspec.structs.replace(call, images=images[0], image_ends=images[1], image_rope=images[2])


def step_images(placed: PlacedImages, tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """A step's image embeddings [tokens, embed], image ends [tokens] (``StepCall.image_ends``) and
    M-RoPE streams [3, tokens] (``StepCall.image_rope``) from its chunks (``images_in``); None when
    no chunk computes an image token."""
    out: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    for images, start, n, at in placed:
        chunk_offset = rope_offset(images, start)  # what the chunk's span adds to every position
        for image in images:
            lo, hi = max(start, image.offset), min(start + n, image.stop)
            if lo >= hi:
                continue
            if out is None:
                embed = image.embeddings.shape[1]
                out = np.zeros((tokens, embed), np.float32), np.zeros(tokens, np.int32), np.zeros((3, tokens), np.int32)
            rows = slice(at + lo - start, at + hi - start)
            out[0][rows] = image.embeddings[lo - image.offset : hi - image.offset]
            out[1][rows] = image.stop
            if image.grid:  # token j at (row, column) of the grid: (start, start + row, start + column)
                j = np.arange(lo - image.offset, hi - image.offset)
                base = rope_offset(images, image.offset) - chunk_offset - j
                out[2][:, rows] = np.stack([base, base + j // image.grid[1], base + j % image.grid[1]])
                if image.stop < start + n:  # the chunk's tokens after it sit earlier
                    out[2][:, at + image.stop - start : at + n] -= image.rope_shift
    return out
