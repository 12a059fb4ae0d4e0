"""Checkpoint loading: HF directories, hub ids (local cache only), GGUF files, the bundled default.

Weights are read one tensor at a time, converted to our layout and dtype on the host, and placed
straight onto the mesh with the sharding the rules give; stacked per-layer weights are filled in
place on device, layer by layer. The host never holds more than one tensor of the checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from myserve.bundled import bundled_gguf_path
from myserve.errors import CheckpointError
from myserve.models.gguf import GGUFSource
from myserve.models.llama import DecoderLayer, LlamaModel, ModelAxes
from myserve.models.spec import ModelSpec, spec_from_hf_config
from myserve.runtime.mesh import named_sharding

logger = logging.getLogger(__name__)


class TensorSource(Protocol):
    """Where weights come from: HF-named tensors in HF layout."""

    spec: ModelSpec

    def has(self, hf_name: str) -> bool: ...

    def read(self, hf_name: str) -> np.ndarray: ...


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


class SafetensorsSource:
    """Tensors of an HF checkpoint directory: one or many ``*.safetensors`` (with an index)."""

    def __init__(self, directory: Path):
        from safetensors import SafetensorError, safe_open

        self._safe_open, self._error = safe_open, SafetensorError
        config_path = directory / "config.json"
        try:
            cfg = json.loads(config_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{config_path}: cannot read config ({e})") from None
        self.spec = spec_from_hf_config(cfg, str(config_path))
        self._files: dict[str, Path] = {}
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: invalid safetensors index ({e})") from None
            self._files = {name: directory / f for name, f in weight_map.items()}
        else:
            files = sorted(directory.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{directory}: no *.safetensors files")
            for f in files:
                for name in self._open(f).keys():
                    self._files[name] = f

    def _open(self, file: Path):
        try:
            return self._safe_open(str(file), framework="flax")
        except (self._error, OSError, ValueError) as e:
            raise CheckpointError(f"{file}: corrupt or unreadable safetensors file ({e})") from None

    def has(self, hf_name: str) -> bool:
        """Whether the checkpoint holds this tensor."""
        return hf_name in self._files

    def read(self, hf_name: str) -> np.ndarray:
        """One tensor as a host array in its stored dtype (bf16 via ml_dtypes)."""
        file = self._files.get(hf_name)
        if file is None:
            raise CheckpointError(f"checkpoint has no tensor {hf_name}")
        # framework="flax" reads bf16 too (numpy cannot); pin it to the host CPU device.
        with jax.default_device(jax.devices("cpu")[0]):
            try:
                return np.asarray(self._open(file).get_tensor(hf_name))
            except (self._error, OSError, ValueError) as e:
                raise CheckpointError(f"{file}: corrupt tensor {hf_name} ({e})") from None


def open_source(resolved: ResolvedCheckpoint) -> TensorSource:
    """The tensor source of a resolved checkpoint."""
    return GGUFSource(resolved.path) if resolved.kind == "gguf" else SafetensorsSource(resolved.path)


# How each weight goes from HF layout ([out, in] projections) to our named layout.
def _proj_in_out(spec: ModelSpec, heads: int) -> Callable[[np.ndarray], np.ndarray]:
    return lambda w: w.T.reshape(spec.hidden_size, heads, spec.head_dim)


def _layer_table(spec: ModelSpec, ax: ModelAxes) -> dict[str, tuple[str, tuple, Callable | None]]:
    """field of DecoderLayer -> (HF suffix, our axes, transform)."""
    t = np.transpose
    table: dict[str, tuple[str, tuple, Callable | None]] = {
        "attn_norm": ("input_layernorm.weight", (ax.Embed,), None),
        "q_proj": (
            "self_attn.q_proj.weight",
            (ax.Embed, ax.Heads, ax.HeadSize),
            _proj_in_out(spec, spec.num_heads),
        ),
        "k_proj": (
            "self_attn.k_proj.weight",
            (ax.Embed, ax.KVHeads, ax.HeadSize),
            _proj_in_out(spec, spec.num_kv_heads),
        ),
        "v_proj": (
            "self_attn.v_proj.weight",
            (ax.Embed, ax.KVHeads, ax.HeadSize),
            _proj_in_out(spec, spec.num_kv_heads),
        ),
        "o_proj": (
            "self_attn.o_proj.weight",
            (ax.Heads, ax.HeadSize, ax.Embed),
            lambda w: w.T.reshape(spec.num_heads, spec.head_dim, spec.hidden_size),
        ),
        "mlp_norm": ("post_attention_layernorm.weight", (ax.Embed,), None),
        "gate_proj": ("mlp.gate_proj.weight", (ax.Embed, ax.Mlp), t),
        "up_proj": ("mlp.up_proj.weight", (ax.Embed, ax.Mlp), t),
        "down_proj": ("mlp.down_proj.weight", (ax.Mlp, ax.Embed), t),
    }
    if spec.qkv_bias:
        q_shape, kv_shape = (spec.num_heads, spec.head_dim), (spec.num_kv_heads, spec.head_dim)
        table["q_bias"] = ("self_attn.q_proj.bias", (ax.Heads, ax.HeadSize), lambda b: b.reshape(q_shape))
        table["k_bias"] = ("self_attn.k_proj.bias", (ax.KVHeads, ax.HeadSize), lambda b: b.reshape(kv_shape))
        table["v_bias"] = ("self_attn.v_proj.bias", (ax.KVHeads, ax.HeadSize), lambda b: b.reshape(kv_shape))
    if spec.o_bias:
        table["o_bias"] = ("self_attn.o_proj.bias", (ax.Embed,), None)
    if spec.qk_norm:
        table["q_norm"] = ("self_attn.q_norm.weight", (ax.HeadSize,), None)
        table["k_norm"] = ("self_attn.k_norm.weight", (ax.HeadSize,), None)
    if spec.mlp_bias:
        table["gate_bias"] = ("mlp.gate_proj.bias", (ax.Mlp,), None)
        table["up_bias"] = ("mlp.up_proj.bias", (ax.Mlp,), None)
        table["down_bias"] = ("mlp.down_proj.bias", (ax.Embed,), None)
    return table


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(stacked: jax.Array, i: jax.Array, value: jax.Array) -> jax.Array:
    """Write one layer into a stacked weight in place (the stack is donated)."""
    return stacked.at[i].set(value)


class _Placer:
    """Reads, converts and shards tensors onto the mesh one at a time."""

    def __init__(self, source: TensorSource, mesh: Mesh, mapping: Mapping[str, str], dtype: jnp.dtype):
        self.source, self.mesh, self.mapping, self.dtype = source, mesh, mapping, dtype

    def _host(self, hf_name: str, axes: tuple, transform: Callable | None) -> np.ndarray:
        w = self.source.read(hf_name)
        if transform is not None:
            w = transform(w)
        expected = tuple(a.size for a in axes)
        if w.shape != expected:
            raise CheckpointError(f"tensor {hf_name} has shape {w.shape}, expected {expected}")
        return np.ascontiguousarray(w.astype(self.dtype))

    def single(self, hf_name: str, axes: tuple, transform: Callable | None = None) -> hax.NamedArray:
        sharding = named_sharding([a.name for a in axes], self.mapping, self.mesh)
        return hax.named(jax.device_put(self._host(hf_name, axes, transform), sharding), axes)

    def stacked(self, Layers, hf_suffix: str, axes: tuple, transform: Callable | None) -> hax.NamedArray:
        full_axes = (Layers, *axes)
        sharding = named_sharding([a.name for a in full_axes], self.mapping, self.mesh)
        layer_sharding = named_sharding([a.name for a in axes], self.mapping, self.mesh)
        shape = tuple(a.size for a in full_axes)
        stacked = jax.jit(lambda: jnp.zeros(shape, self.dtype), out_shardings=sharding)()
        for i in range(Layers.size):
            host = self._host(f"model.layers.{i}.{hf_suffix}", axes, transform)
            stacked = _set_layer(stacked, jnp.int32(i), jax.device_put(host, layer_sharding))
        return hax.named(stacked, full_axes)


def load_model(
    source: TensorSource,
    mesh: Mesh,
    mapping: Mapping[str, str],
    dtype: jnp.dtype = jnp.float32,
    attention_backend: str = "reference",
) -> LlamaModel:
    """Build a ``LlamaModel`` from a tensor source, every weight placed on ``mesh`` by ``mapping``."""
    spec = source.spec
    ax = ModelAxes.of(spec)
    placer = _Placer(source, mesh, mapping, jnp.dtype(dtype))
    layer_fields = {
        field: placer.stacked(ax.Layers, suffix, axes, transform)
        for field, (suffix, axes, transform) in _layer_table(spec, ax).items()
    }
    return LlamaModel(
        spec=spec,
        attention_backend=attention_backend,
        embed=placer.single("model.embed_tokens.weight", (ax.Vocab, ax.Embed)),
        layers=DecoderLayer(**layer_fields),
        final_norm=placer.single("model.norm.weight", (ax.Embed,)),
        lm_head=None
        if spec.tie_word_embeddings
        else placer.single("lm_head.weight", (ax.Embed, ax.Vocab), np.transpose),
    )
