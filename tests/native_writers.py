"""Writers of the checkpoints JAX trainers make, from an HF checkpoint's tensors (tests only):
Orbax's ``StandardCheckpointer`` with a pytree keyed by the HF names, and Levanter's layout as its
``tree_serialize_leaves_tensorstore`` writes it (each leaf a zarr array at its module path, through
JAX's own array serialization, which is what Levanter calls), layers stacked or one per directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file


def hf_tensors(hf_dir: Path) -> dict[str, np.ndarray]:
    return load_file(str(hf_dir / "model.safetensors"))


def write_orbax(hf_dir: Path, out: Path, *, nested_under: str | None = None, config: bool = True) -> Path:
    """``ocp.StandardCheckpointer().save(out, {hf_name: array})`` (or ``{nested_under: {...}}``)."""
    import orbax.checkpoint as ocp

    tree: dict = hf_tensors(hf_dir)
    if nested_under is not None:
        tree = {nested_under: tree}
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(out, tree)
    checkpointer.wait_until_finished()
    if config:
        shutil.copy(hf_dir / "config.json", out / "config.json")
    return out


def _levanter_array(name: str, w: np.ndarray, cfg: dict) -> np.ndarray:
    """An HF tensor of one layer in Levanter's layout: a projection's output split into named axes."""
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if name.endswith("q_proj.weight"):
        return w.reshape(kv, heads // kv, hd, -1)
    if name.endswith(("k_proj.weight", "v_proj.weight")):
        return w.reshape(kv, hd, -1)
    if name.endswith("o_proj.weight"):
        return w.reshape(w.shape[0], heads, hd)
    if name.endswith("q_proj.bias"):
        return w.reshape(kv, heads // kv, hd)
    if name.endswith(("k_proj.bias", "v_proj.bias")):
        return w.reshape(kv, hd)
    return w


def write_levanter(hf_dir: Path, out: Path, *, stacked: bool = True) -> Path:
    """A Levanter trainer checkpoint of the HF model's weights: ``out/model/...`` plus its
    ``metadata.json`` (no optimizer state: the server reads the model only)."""
    import jax
    from jax.experimental.array_serialization import serialization

    cfg = json.loads((hf_dir / "config.json").read_text())
    tensors = hf_tensors(hf_dir)
    root = out / "model"
    leaves: dict[Path, np.ndarray] = {}
    layers: dict[str, list[np.ndarray]] = {}
    for name, w in tensors.items():
        if name == "model.embed_tokens.weight":
            leaves[root / "embeddings" / "token_embeddings" / "weight"] = w
        elif name == "model.norm.weight":
            leaves[root / "transformer" / "norm" / "weight"] = w
        elif name == "lm_head.weight":
            leaves[root / "lm_head" / "weight"] = w
        else:
            _, _, index, *rest = name.split(".")
            array = _levanter_array(name, w, cfg)
            if stacked:
                layers.setdefault("/".join(rest), []).append((int(index), array))  # type: ignore[arg-type]
            else:
                leaves[root / "transformer" / "layers" / "blocks" / index / Path(*rest)] = array
    for rest, items in layers.items():
        stack = np.stack([a for _, a in sorted(items, key=lambda item: item[0])])
        leaves[root / "transformer" / "layers" / "stacked" / rest] = stack
    manager = serialization.GlobalAsyncCheckpointManager()
    paths = [str(p) for p in leaves]
    manager.serialize_with_paths([jax.numpy.asarray(a) for a in leaves.values()], paths)
    manager.wait_until_finished()
    (out / "metadata.json").write_text(json.dumps({"step": 0, "timestamp": "2026-11-26T00:00:00"}))
    return out
