"""Finding a checkpoint on disk (an HF directory, a cached hub id, a GGUF file, the bundled default)
without importing JAX: the HTTP front end resolves the tokenizer's source with it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from myserve.bundled import bundled_gguf_path
from myserve.errors import CheckpointError
from myserve.models.spec import ModelSpec, spec_from_hf_config
from myserve.models.vision_spec import VisionSpec, vision_spec_from_hf_config


@dataclasses.dataclass(frozen=True)
class ResolvedCheckpoint:
    """A checkpoint found on disk: an HF directory or a GGUF file."""

    kind: str  # "hf" or "gguf"
    path: Path


def resolve_checkpoint(checkpoint: str | Path | None) -> ResolvedCheckpoint:
    """Find a checkpoint: None (bundled SmolLM2), a directory, a ``.gguf`` file, or a cached hub id."""
    if checkpoint is None:
        return ResolvedCheckpoint("gguf", bundled_gguf_path())
    path = Path(checkpoint).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise CheckpointError(f"{path}: GGUF file not found")
        return ResolvedCheckpoint("gguf", path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path}: not an HF checkpoint directory (no config.json)")
        return ResolvedCheckpoint("hf", path)
    if path.exists():
        raise CheckpointError(f"{path}: not a checkpoint directory or .gguf file")
    return ResolvedCheckpoint("hf", _from_hub_cache(str(checkpoint)))


def _from_hub_cache(repo_id: str) -> Path:
    """Resolve a hub id from the local HF cache only; this server never downloads weights."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        snapshot = Path(snapshot_download(repo_id, local_files_only=True))
    except HFValidationError:
        raise CheckpointError(f"{repo_id}: no such directory or file, and not a valid hub id") from None
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        raise CheckpointError(
            f"{repo_id}: not found locally and not in the HF cache; download it first "
            f"(huggingface-cli download {repo_id}) or pass a directory"
        ) from None
    if not (snapshot / "config.json").is_file():
        raise CheckpointError(f"{snapshot}: cached snapshot of {repo_id} has no config.json")
    return snapshot


def hf_spec(directory: Path) -> ModelSpec:
    """The architecture an HF ``config.json`` in ``directory`` describes."""
    return spec_from_hf_config(*_read_config(directory))


def vision_spec_of(directory: Path) -> VisionSpec | None:
    """The vision tower an HF checkpoint directory's ``config.json`` describes (None: text only)."""
    return vision_spec_from_hf_config(*_read_config(directory))


def max_image_patches(directory: Path, spec: VisionSpec, default: int = 16384) -> int:
    """The most patches an image of a variable-size tower (Qwen2.5-VL) can have: the checkpoint's
    image processor's pixel bound (``max_pixels``, or ``size.longest_edge`` as transformers >= 5
    names it) over a patch's pixels; ``default`` without one."""
    try:
        config = json.loads((directory / "preprocessor_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return default
    pixels = config.get("max_pixels") or (config.get("size") or {}).get("longest_edge")
    return int(pixels) // (spec.patch_size * spec.patch_size) if pixels else default


def _read_config(directory: Path) -> tuple[dict, str]:
    """``directory``'s parsed ``config.json``, and its path for error messages."""
    config_path = directory / "config.json"
    try:
        return json.loads(config_path.read_text()), str(config_path)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{config_path}: cannot read config ({e})") from None


def declared_dtype(checkpoint_dir: Path | None) -> str | None:
    """The dtype an HF checkpoint's config.json names (``dtype``, or the older ``torch_dtype``)."""
    if checkpoint_dir is None:
        return None
    try:
        data = json.loads((checkpoint_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    value = data.get("dtype") or data.get("torch_dtype") if isinstance(data, dict) else None
    return value if isinstance(value, str) else None
