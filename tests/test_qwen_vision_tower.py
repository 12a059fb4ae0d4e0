"""Qwen2.5-VL's vision tower in JAX (``models/vision_qwen.py``) against transformers' on a tiny
random checkpoint: images of different sizes and shapes (each its own patch grid, windows cut by
the grid's edges), the window order and rotary positions against transformers' own helpers."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from myserve.models.checkpoint import vision_spec_of
from myserve.models.loading import SafetensorsSource
from myserve.models.vision_qwen import encode_qwen_image, grid_arrays, patch_buckets, read_qwen_tower
from myserve.models.vision_spec import VisionSpec
from myserve.testing.qwen_vl_checkpoint import make_tiny_qwen2_5_vl

SIZES = {"square": (32, 32), "wide": (64, 40), "tall": (30, 70), "big": (90, 90), "small": (12, 20)}
"""Width and height of each test image."""


def picture(width: int, height: int, seed: int) -> Any:
    """A PIL image: a background, a rectangle and an ellipse in colours from ``seed``."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    colours = [tuple(int(c) for c in rng.integers(0, 256, 3)) for _ in range(3)]
    image = Image.new("RGB", (width, height), colours[0])
    draw = ImageDraw.Draw(image)
    draw.rectangle((width // 8, height // 6, width // 2, height // 2), fill=colours[1])
    draw.ellipse((width // 3, height // 3, width - 2, height - 2), fill=colours[2])
    return image


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen-vl-tower") / "tiny-qwen2.5-vl")


@pytest.fixture(scope="module")
def hf_model(qwen_dir: Path) -> Any:
    import torch
    import transformers

    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def processed(qwen_dir: Path) -> dict[str, tuple[np.ndarray, tuple[int, int, int]]]:
    """Each image's ``pixel_values`` and ``image_grid_thw`` by the checkpoint's processor (PIL backend)."""
    import transformers

    processor = transformers.AutoImageProcessor.from_pretrained(qwen_dir, backend="pil")
    out = {}
    for seed, (name, (w, h)) in enumerate(SIZES.items()):
        batch = processor(images=[picture(w, h, seed)], return_tensors="np")
        t, gh, gw = (int(v) for v in batch["image_grid_thw"][0])
        out[name] = (np.asarray(batch["pixel_values"], np.float32), (t, gh, gw))
    return out


@pytest.fixture(scope="module")
def tower(qwen_dir: Path) -> tuple[VisionSpec, Any]:
    spec = vision_spec_of(qwen_dir)
    assert spec is not None and spec.family == "qwen2_5_vl"
    return spec, read_qwen_tower(SafetensorsSource(qwen_dir), spec, np.float32)


def test_grids_differ_and_stay_small(processed) -> None:
    grids = {name: processed[name][1] for name in SIZES}
    assert all(t == 1 for t, _, _ in grids.values())
    assert len({(h, w) for _, h, w in grids.values()}) == len(SIZES), grids
    assert all(h * w // 4 <= 40 for _, h, w in grids.values()), grids


@pytest.mark.parametrize("name", list(SIZES))
def test_encode_equals_transformers(name: str, processed, hf_model, tower) -> None:
    import torch

    spec, weights = tower
    pixels, (t, gh, gw) = processed[name]
    with torch.no_grad():
        want = hf_model.model.get_image_features(torch.tensor(pixels), torch.tensor([[t, gh, gw]])).pooler_output[0]
    arrays = {k: jnp.asarray(v) for k, v in grid_arrays(spec, gh, gw).items()}
    encode = jax.jit(functools.partial(encode_qwen_image, spec))
    got = np.asarray(encode(weights, jnp.asarray(pixels), arrays))
    assert got.shape == (gh * gw // spec.merge_size**2, spec.text_hidden_size)
    assert got.dtype == np.float32
    assert float(np.abs(want.numpy()).max()) > 0.1  # not all alike near zero
    np.testing.assert_allclose(got, want.numpy(), atol=1e-4, rtol=0)
    # Padded to the next buckets (patches of zeros, windows of padding): the same image tokens first.
    for bucket in (b for b in patch_buckets(spec, 4 * gh * gw) if b >= gh * gw):
        padded = np.zeros((bucket, pixels.shape[1]), np.float32)
        padded[: len(pixels)] = pixels
        arrays = {k: jnp.asarray(v) for k, v in grid_arrays(spec, gh, gw, bucket).items()}
        out = np.asarray(encode(weights, jnp.asarray(padded), arrays))
        assert out.shape == (bucket // spec.merge_size**2, spec.text_hidden_size)
        np.testing.assert_allclose(out[: len(got)], want.numpy(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", list(SIZES))
def test_grid_arrays_equal_transformers_helpers(name: str, processed, tower) -> None:
    """The window order, rotary positions and window boundaries as transformers computes them."""
    import torch
    from transformers.vision_utils import get_vision_position_ids, get_vision_window_index

    spec, _ = tower
    _, (t, gh, gw) = processed[name]
    arrays = grid_arrays(spec, gh, gw)
    grid = torch.tensor([[t, gh, gw]])
    window_index, cu_window = get_vision_window_index(grid, spec.merge_size, spec.window_size, spec.patch_size)
    unit = spec.merge_size**2
    np.testing.assert_array_equal(arrays["perm"].reshape(-1, unit)[:, 0] // unit, window_index.numpy())
    np.testing.assert_array_equal(arrays["unperm"], torch.argsort(window_index).numpy())
    pos = get_vision_position_ids(grid, spec.merge_size).numpy()
    np.testing.assert_array_equal(arrays["pos"], pos[arrays["perm"]])
    n = len(arrays["perm"])
    windows, starts = arrays["windows"], arrays["windows"][:, 0]
    np.testing.assert_array_equal(np.append(starts, n), cu_window.numpy())  # consecutive runs, in order
    assert len(starts) > 1  # several windows per image
    flat = windows.reshape(-1)
    np.testing.assert_array_equal(flat[arrays["slots"]], np.arange(n))  # each patch's slot holds it
    assert np.all(np.sort(flat[flat < n]) == np.arange(n))  # every patch in one window, padding past N


def test_tower_from_the_checkpoint_matches_the_processor(qwen_dir: Path, processed, tower) -> None:
    spec, weights = tower
    assert (spec.patch_size, spec.merge_size, spec.temporal_patch_size) == (4, 2, 2)
    assert spec.full_layers == (1,) and len(weights["layers"]) == spec.num_layers == 2
    assert weights["patch"].shape == (3 * 2 * 4 * 4, spec.hidden_size)
    assert weights["merger"]["fc2"]["w"].shape == (spec.merge_size**2 * spec.hidden_size, spec.text_hidden_size)
    for pixels, (_, gh, gw) in processed.values():
        assert pixels.shape == (gh * gw, weights["patch"].shape[0])
        assert len(grid_arrays(spec, gh, gw)["unperm"]) == pixels.shape[0] // spec.merge_size**2


def test_either_weight_prefix_reads_the_same_tower(qwen_dir: Path, tower) -> None:
    """transformers 5 saves ``visual.*``; a checkpoint saved with the in-memory names has ``model.visual.*``."""
    spec, weights = tower
    plain = SafetensorsSource(qwen_dir)

    class Renamed:
        def has(self, name: str) -> bool:
            return name.startswith("model.visual.") and plain.has(name.removeprefix("model."))

        def read(self, name: str) -> np.ndarray:
            assert name.startswith("model.visual.")
            return plain.read(name.removeprefix("model."))

    again = read_qwen_tower(Renamed(), spec, np.float32)
    jax.tree.map(np.testing.assert_array_equal, again, weights)
