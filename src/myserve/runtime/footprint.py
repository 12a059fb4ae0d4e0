"""A model's memory estimated from its checkpoint's headers and its config, without JAX and
without reading a tensor: the parameter count, the weights' bytes (the dtype, or the narrow
weights' bytes per parameter), and the host's available memory. The KV pool's sizing
(``kv_sizing``) and the several-model memory check (``memory_check``) both use it."""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

from myserve.config import Config
from myserve.errors import CheckpointError
from myserve.models.checkpoint import declared_dtype, hf_spec, resolve_checkpoint
from myserve.models.gguf import GGUFSource, resolve_quantization
from myserve.models.gguf_file import read_gguf
from myserve.models.row_head import row_head_bytes
from myserve.models.spec import ModelSpec, spec_from_hf_config
from myserve.runtime.cpu_dtype import cpu_auto_dtype

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def weight_bytes(config: Config, where: str) -> int:
    """One replica's weights of ``config``'s model on platform ``where``, in bytes, from the
    checkpoint's headers: parameters x the bytes of the dtype (or of its narrow weights), and on a
    CPU the copy of a tied float32 table that one-row logits read (``models/row_head.py``)."""
    if config.model.checkpoint_path is not None:  # an Orbax or Levanter checkpoint's arrays
        from myserve.models.native_checkpoint import NativeSource

        resolved = resolve_checkpoint(config.model.checkpoint)
        spec = hf_spec(resolved.path)
        parameters = NativeSource(Path(config.model.checkpoint_path), spec).num_parameters
    else:
        spec, parameters = spec_and_parameters(config.model.checkpoint)
    quantization, itemsize = _quantization(config, where), itemsize_of(config, where)
    weights = int(parameters * _PARAMETER_BYTES.get(quantization, itemsize))
    if quantization == "none" and spec.tie_word_embeddings and itemsize == 4:  # (only float32 tables are copied)
        weights += row_head_bytes(where == "cpu", "float32", spec.vocab_size, spec.hidden_size)
    return weights


def itemsize_of(config: Config, where: str) -> int:
    """Bytes per weight and KV value of ``config``'s float dtype on ``where`` (``auto`` resolved as
    ``resolve_dtype`` does: on a CPU, this host's CPU and the checkpoint's declared dtype)."""
    dtype = config.model.dtype
    if dtype != "auto":
        return DTYPE_BYTES[dtype]
    if where != "cpu":
        return DTYPE_BYTES["bfloat16"]
    # A GGUF file is not a directory with a config.json: declared_dtype says None for it.
    return DTYPE_BYTES[cpu_auto_dtype(declared_dtype(resolve_checkpoint(config.model.checkpoint).path))]


# Bytes per parameter of narrow weights, scales included (int8 per channel; int4 and GGUF's Q4_1 in
# groups of 32 with float16 scale and offset: 20 bytes per 32; W8A8 per channel).
_PARAMETER_BYTES = {"int8": 1.07, "int4": 0.63, "w8a8": 1.0}


def _quantization(config: Config, where: str) -> str:
    """``model.quantization`` as the deployment will resolve it."""
    resolved = resolve_checkpoint(config.model.checkpoint)
    source = GGUFSource(resolved.path) if resolved.kind == "gguf" else None
    return resolve_quantization(config.model.quantization, source, where)


def spec_and_parameters(checkpoint: str | None) -> tuple[ModelSpec, int]:
    """A checkpoint's architecture and parameter count, read from its headers (no tensor is read)."""
    resolved = resolve_checkpoint(checkpoint)
    if resolved.kind == "gguf":
        tensors = read_gguf(resolved.path).tensors.values()
        return GGUFSource(resolved.path).spec, sum(math.prod(t.shape) for t in tensors)
    config_path = resolved.path / "config.json"
    try:
        spec = spec_from_hf_config(json.loads(config_path.read_text()), str(config_path))
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{config_path}: cannot read: {e}") from None
    return spec, sum(_safetensors_parameters(f) for f in sorted(resolved.path.glob("*.safetensors")))


def _safetensors_parameters(path: Path) -> int:
    """Elements of every tensor in a safetensors file, from its JSON header."""
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file: {e}") from None
    return sum(math.prod(t["shape"]) for key, t in header.items() if key != "__metadata__")


def host_available() -> int:
    """``MemAvailable`` (what can be allocated without swapping), or free pages where there is no /proc."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
