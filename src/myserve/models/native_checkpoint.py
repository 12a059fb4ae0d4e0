"""Checkpoints written by JAX trainers, read as HF-named tensors (``model.checkpoint_path``).

- **Orbax**: a pytree of arrays keyed by the HF parameter names, the simplest thing a JAX trainer
  can save (``ocp.StandardCheckpointer().save(dir, {name: array})``; nested dicts whose dotted path
  is the HF name, optionally under one first key such as ``params``), in Orbax's TensorStore
  layout: zarr arrays (v2 or v3) in an OCDBT database or in plain files. A ``CheckpointManager``
  step directory holding one item is read through that item.
- **MaxText**: an Orbax pytree holding MaxText's Llama tree (``params.params.decoder.layers...``,
  layers stacked on a scan axis, ``[in, out...]`` kernels, the query pre-scaled, q/k maybe in an
  interleaved RoPE layout): a MaxText training step directory or its converters' output, read
  through ``models/maxtext_tree.py``.
- **Levanter**: the trainer state serialized by ``tree_serialize_leaves_tensorstore``, each leaf a
  zarr array at its module path (``model/transformer/layers/stacked/self_attn/q_proj/weight``):
  layers stacked along a first axis (``Stacked``, scanned layers) or one directory per layer
  (``BlockSeq``), projections with their output axes first and split into named axes
  (``[kv_heads, q_per_kv, head_dim, embed]``), which flatten into HF's ``[out, in]``. A MoE's
  experts (Levanter's Mixtral: ``block_sparse_moe/experts/w1/weight``, haliax ``MoELinear``s) are
  one array per projection, ``[layers, experts, in, out]``: HF's ``experts.{j}.w1.weight`` is one
  expert's slice of it, transposed.

Every array is read on its own, when the loader asks for it (one TensorStore read), so the host
never holds the whole checkpoint. The model's configuration comes from an HF ``config.json``
(``model.checkpoint``: beside the checkpoint by default, or ``--hf-config``).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import numpy as np

from myserve.errors import CheckpointError
from myserve.models.maxtext_tree import MaxTextTree, maxtext_prefix
from myserve.models.spec import ModelSpec

_ORBAX_MARKERS = ("_METADATA", "manifest.ocdbt", "_CHECKPOINT_METADATA")


def _tensorstore() -> Any:
    try:
        import tensorstore
    except ImportError:  # pragma: no cover - an optional dependency
        raise CheckpointError(
            "reading Orbax or Levanter checkpoints needs tensorstore: pip install tensorstore"
        ) from None
    return tensorstore


def is_native_checkpoint(path: Path) -> bool:
    """Whether ``path`` is an Orbax or a Levanter checkpoint directory."""
    return _levanter_root(path) is not None or _orbax_root(path) is not None


def _levanter_root(path: Path) -> Path | None:
    """The model's directory of a Levanter checkpoint (the step directory's ``model``, or itself)."""
    for root in (path / "model", path):
        if (root / "transformer").is_dir():
            return root
    return None


def _orbax_root(path: Path) -> Path | None:
    """The directory of an Orbax pytree checkpoint: ``path``, or the one item of a step directory."""
    if not path.is_dir():
        return None
    if any((path / m).exists() for m in _ORBAX_MARKERS[:2]):
        return path
    items = [d for d in path.iterdir() if d.is_dir() and any((d / m).exists() for m in _ORBAX_MARKERS[:2])]
    return items[0] if len(items) == 1 else None


class NativeSource:
    """A ``TensorSource`` (HF-named tensors in HF layout) over an Orbax (HF-keyed or MaxText's tree)
    or a Levanter checkpoint."""

    def __init__(self, path: Path, spec: ModelSpec):
        self.spec = spec
        self.path = path
        if not path.is_dir():
            raise CheckpointError(f"{path}: no such checkpoint directory")
        self._levanter = _levanter_root(path)
        self._orbax = None if self._levanter is not None else _orbax_root(path)
        if self._levanter is None and self._orbax is None:
            raise CheckpointError(f"{path}: neither an Orbax nor a Levanter checkpoint")
        stored = self._orbax_stored() if self._orbax is not None else []
        prefix = maxtext_prefix(stored)
        self._maxtext = None if prefix is None else MaxTextTree(path, stored, prefix, spec, self._orbax_shape)
        self._names: dict[str, str] = self._orbax_names(stored) if self._maxtext is None else {}
        """Orbax keyed by HF names: HF name -> the array's name in the checkpoint."""

    @property
    def kind(self) -> str:
        """``orbax``, ``maxtext`` (an Orbax checkpoint of MaxText's tree) or ``levanter``."""
        if self._levanter is not None:
            return "levanter"
        return "orbax" if self._maxtext is None else "maxtext"

    # -- Orbax --------------------------------------------------------------------------------
    def _orbax_store(self) -> dict[str, Any]:
        assert self._orbax is not None
        if (self._orbax / "manifest.ocdbt").exists():
            return {"driver": "ocdbt", "base": f"file://{self._orbax}"}
        return {"driver": "file", "path": str(self._orbax)}

    def _orbax_stored(self) -> list[str]:
        """The names (dotted paths) of the pytree's arrays."""
        ts = _tensorstore()
        keys = ts.KvStore.open(self._orbax_store()).result().list().result()
        return sorted({k.decode().rsplit("/", 1)[0] for k in keys if k.endswith((b"/.zarray", b"/zarr.json"))})

    def _orbax_shape(self, name: str) -> tuple[int, ...]:
        try:
            return tuple(_open(_tensorstore(), {**self._orbax_store(), "path": name}).shape)
        except (ValueError, OSError) as e:
            raise CheckpointError(f"{self.path}: cannot open {name}: {e}") from None

    @staticmethod
    def _orbax_names(stored: list[str]) -> dict[str, str]:
        """Every array of the pytree by HF name: its dotted path, less a first key (``params``)
        when the path does not start like an HF name."""
        names: dict[str, str] = {}
        for name in stored:
            hf = name if name.startswith(("model.", "lm_head.")) else name.split(".", 1)[-1]
            names[hf] = name
        return names

    # -- Levanter -----------------------------------------------------------------------------
    def _levanter_location(self, hf_name: str) -> tuple[Path, tuple[int, ...]] | None:
        """Where an HF tensor is in a Levanter checkpoint: its array's directory, and the index of
        its part of that array (the layer's when the layers are stacked, then the expert's)."""
        root = self._levanter
        assert root is not None
        fixed = {
            "model.embed_tokens.weight": root / "embeddings" / "token_embeddings" / "weight",
            "model.norm.weight": root / "transformer" / "norm" / "weight",
            "lm_head.weight": root / "lm_head" / "weight",
        }
        if hf_name in fixed:
            return (fixed[hf_name], ()) if fixed[hf_name].is_dir() else None
        parts = hf_name.split(".")
        if parts[:2] != ["model", "layers"] or len(parts) < 4 or not parts[2].isdigit():
            return None
        if int(parts[2]) >= self.spec.num_layers:
            return None
        layer, rest = int(parts[2]), parts[3:]
        expert: tuple[int, ...] = ()
        if _is_expert(hf_name):  # ...experts.{j}.w1.weight: expert j of ...experts/w1/weight
            if int(rest[2]) >= self.spec.num_experts:
                return None
            rest, expert = [*rest[:2], *rest[3:]], (int(rest[2]),)
        stacked = root / "transformer" / "layers" / "stacked" / Path(*rest)
        if stacked.is_dir():
            return stacked, (layer, *expert)
        single = root / "transformer" / "layers" / "blocks" / str(layer) / Path(*rest)
        return (single, expert) if single.is_dir() else None

    # -- the TensorSource ---------------------------------------------------------------------
    def has(self, hf_name: str) -> bool:
        """Whether the checkpoint holds ``hf_name``."""
        if self._maxtext is not None:
            return self._maxtext.locate(hf_name) is not None
        if self._orbax is not None:
            return hf_name in self._names
        return self._levanter_location(hf_name) is not None

    def read(self, hf_name: str) -> np.ndarray:
        """``hf_name`` in HF layout (``[out, in]`` for a projection), as stored (bf16 stays bf16)."""
        if self._maxtext is not None:
            located = self._maxtext.locate(hf_name)
            if located is None:
                raise CheckpointError(f"{self.path}: checkpoint has no tensor {hf_name}")
            name, part = located
            return self._maxtext.to_hf(hf_name, _read({**self._orbax_store(), "path": name}, self.path, hf_name, part))
        if self._orbax is not None:
            if hf_name not in self._names:
                raise CheckpointError(f"{self.path}: checkpoint has no tensor {hf_name}")
            return _read({**self._orbax_store(), "path": self._names[hf_name]}, self.path, hf_name)
        found = self._levanter_location(hf_name)
        if found is None:
            raise CheckpointError(f"{self.path}: checkpoint has no tensor {hf_name}")
        directory, index = found
        array = _read({"driver": "file", "path": str(directory)}, self.path, hf_name, index)
        return _hf_layout(hf_name, array)

    def read_slice(self, hf_name: str, index: tuple[slice, ...]) -> np.ndarray:
        """``read(hf_name)[index]``, reading only that part where the layout allows: an Orbax
        array keyed by HF name, or a Levanter array whose part is whole along its named axes (one
        KV head's rows, a range of MLP columns); a MaxText tree is read whole, then cut."""
        if self._maxtext is not None:
            return self.read(hf_name)[index]
        if self._orbax is not None:
            if hf_name not in self._names:
                raise CheckpointError(f"{self.path}: checkpoint has no tensor {hf_name}")
            return _read({**self._orbax_store(), "path": self._names[hf_name]}, self.path, hf_name, index)
        found = self._levanter_location(hf_name)
        if found is None:
            raise CheckpointError(f"{self.path}: checkpoint has no tensor {hf_name}")
        directory, prefix = found
        store = {"driver": "file", "path": str(directory)}
        stored = _open(_tensorstore(), store).shape[len(prefix) :]
        part = _levanter_part(hf_name, tuple(stored), index)
        if part is None:  # not whole along the named axes: read the tensor, then cut
            return self.read(hf_name)[index]
        return _hf_layout(hf_name, _read(store, self.path, hf_name, (*prefix, *part)))

    @functools.cached_property
    def num_parameters(self) -> int:
        """Elements of every array the model reads (for the memory plan)."""
        ts = _tensorstore()
        total = 0
        if self._orbax is not None:
            names = self._names.values() if self._maxtext is None else self._maxtext.arrays
            for name in names:
                total += math.prod(_open(ts, {**self._orbax_store(), "path": name}).shape)
            return total
        root = self._levanter
        assert root is not None
        for meta in [*root.rglob(".zarray"), *root.rglob("zarr.json")]:
            total += math.prod(_open(ts, {"driver": "file", "path": str(meta.parent)}).shape)
        return total


def _open(ts: Any, kvstore: dict[str, Any]) -> Any:
    """The zarr array (v2, else v3) at ``kvstore``."""
    try:
        return ts.open({"driver": "zarr", "kvstore": kvstore}, open=True).result()
    except ValueError:
        return ts.open({"driver": "zarr3", "kvstore": kvstore}, open=True).result()


def _read(kvstore: dict[str, Any], checkpoint: Path, hf_name: str, index: tuple[Any, ...] = ()) -> np.ndarray:
    """One array on the host, or its part at ``index`` (one layer of stacked ones: only it is read)."""
    ts = _tensorstore()
    try:
        array = _open(ts, kvstore)
        return np.asarray((array[index] if index else array).read().result())
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{checkpoint}: cannot read {hf_name}: {e}") from None


def _is_expert(hf_name: str) -> bool:
    """Whether ``hf_name`` is one routed expert's projection (``...block_sparse_moe.experts.{j}.w1.weight``)."""
    parts = hf_name.split(".")
    return len(parts) == 8 and parts[3:5] == ["block_sparse_moe", "experts"] and parts[5].isdigit()


def _hf_groups(hf_name: str, ndim: int) -> list[list[int]]:
    """Which axes of a Levanter array (less its layer/expert index) make each axis of the HF
    tensor (``_hf_layout``), in order."""
    if _is_expert(hf_name):
        return [[1], [0]]
    if hf_name.endswith(".bias") or ndim == 1 or "norm" in hf_name.rsplit(".", 2)[-2]:
        return [list(range(ndim))]
    if hf_name.endswith(("o_proj.weight", "down_proj.weight")):
        return [[0], list(range(1, ndim))]
    return [list(range(ndim - 1)), [ndim - 1]]


def _levanter_part(hf_name: str, stored: tuple[int, ...], index: tuple[slice, ...]) -> tuple[slice, ...] | None:
    """The index into a Levanter array of ``stored`` shape that holds ``hf[index]``: each HF axis's
    range must cover whole rows of the stored axes it flattens (else None)."""
    part = [slice(None)] * len(stored)
    for hf_axis, want in enumerate(index):
        if want == slice(None):
            continue
        group = _hf_groups(hf_name, len(stored))[hf_axis]
        trail = math.prod(stored[a] for a in group[1:])
        start, stop = want.start or 0, want.stop
        if want.step not in (None, 1) or stop is None or start % trail or stop % trail:
            return None
        part[group[0]] = slice(start // trail, stop // trail)
    return tuple(part)


def _hf_layout(hf_name: str, array: np.ndarray) -> np.ndarray:
    """A Levanter array in HF's layout: its axes grouped as ``_hf_groups`` says (named output axes
    ``[kv_heads, q_per_kv, head_dim, embed]`` flatten into ``[out, in]``; an output projection's
    input axes ``[embed, heads, head_dim]`` flatten after its output; vectors flatten; an expert's
    ``[in, out]`` transposes)."""
    groups = _hf_groups(hf_name, array.ndim)
    order = [a for group in groups for a in group]
    shape = tuple(math.prod(array.shape[a] for a in group) for group in groups)
    return np.ascontiguousarray(array.transpose(order)).reshape(shape)
