"""PEFT LoRA checkpoints read into the layouts of the device's adapter stacks (``models/lora.py``),
as host arrays: what the engine core writes into a slot (``core/adapters.py``).

q/k/v and gate/up are fused in our layers, so each module's ``A`` [r, in] and ``B`` [out, r] go into
its part of the group's fused stacks: ``A`` transposed into its ``max_rank`` columns, ``B`` into
its rows of the fused output, scaled by ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA). Every layer
gets every field (zeros for projections the adapter leaves alone), so a slot write always has the
same shapes and never compiles anything.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from myserve.errors import ConfigError
from myserve.models.lora import FIELDS, stack_axes
from myserve.models.spec import ModelSpec

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may modify (of every dense architecture served)."""
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    """One PEFT adapter read from disk, in our layouts, as host arrays."""

    name: str
    path: str
    rank: int
    """The largest rank of its modules."""
    layers: dict[int, dict[str, np.ndarray]]
    """Per layer index, every ``LoraLayer`` field without the slot axis (``b`` scaled; zeros where
    the adapter leaves a projection alone)."""

    def flat(self) -> tuple[np.ndarray, ...]:
        """Every layer's fields in ``LoraLayer`` order, layer after layer (what a slot write takes)."""
        return tuple(self.layers[i][field] for i in sorted(self.layers) for field in FIELDS)


def empty_adapter(spec: ModelSpec, max_rank: int) -> LoraAdapter:
    """An adapter changing nothing (every field zeros): the shapes a slot write takes."""
    shapes = {name: tuple(a.size for a in axes[1:]) for name, axes in stack_axes(spec, 1, max_rank).items()}
    layers = {i: {name: np.zeros(shape, np.float32) for name, shape in shapes.items()} for i in range(spec.num_layers)}
    return LoraAdapter("", "", 0, layers)


def read_adapter(name: str, path: str | Path, spec: ModelSpec, max_rank: int) -> LoraAdapter:
    """Read a PEFT LoRA checkpoint (``adapter_config.json``, ``adapter_model.safetensors``) for a
    base model of ``spec``; ``ConfigError`` naming what cannot be served (a rank above ``max_rank``,
    DoRA, trained biases, extra modules, targets other than ``TARGETS``)."""
    directory = Path(path)
    try:
        config = json.loads((directory / "adapter_config.json").read_text())
        tensors = load_file(directory / "adapter_model.safetensors")
    except (OSError, ValueError) as e:
        raise ConfigError(f"LoRA adapter {name!r} at {path}: cannot read it ({e})") from None
    _check_config(name, config)
    rank = int(config.get("r", 8))
    alpha = float(config.get("lora_alpha", rank))
    rslora = bool(config.get("use_rslora", False))
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise ConfigError(f"LoRA adapter {name!r}: {key} modifies something other than {', '.join(TARGETS)}")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in TARGETS or layer >= spec.num_layers:
            raise ConfigError(f"LoRA adapter {name!r}: {key} does not fit the base model")
        if spec.is_moe and module in ("gate_proj", "up_proj", "down_proj"):
            raise ConfigError(f"LoRA adapter {name!r}: adapters of a MoE model's experts are not supported yet")
        pairs.setdefault((layer, module), {})[which] = value.astype(np.float32)
    biggest = max((p["A"].shape[0] for p in pairs.values() if "A" in p), default=0)
    if biggest > max_rank:
        raise ConfigError(f"LoRA adapter {name!r} has rank {biggest}, above max_lora_rank {max_rank} (--max-lora-rank)")
    layers = empty_adapter(spec, max_rank).layers
    for (layer, module), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise ConfigError(f"LoRA adapter {name!r}: layer {layer} {module} lacks lora_A or lora_B")
        r = pair["A"].shape[0]
        module_alpha = float(config.get("alpha_pattern", {}).get(module, alpha))
        scale = module_alpha / (math.sqrt(r) if rslora else r)
        _place(spec, max_rank, layers.setdefault(layer, {}), module, pair["A"], pair["B"] * scale)
    return LoraAdapter(name, str(path), biggest or rank, layers)


def _check_config(name: str, config: dict) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"LoRA adapter {name!r}: peft_type {config.get('peft_type')} is not LoRA")
    refused = {
        "use_dora": "DoRA",
        "modules_to_save": "modules_to_save",
        "fan_in_fan_out": "fan_in_fan_out",
        "lora_bias": "trained biases",
    }
    for key, what in refused.items():
        if config.get(key):
            raise ConfigError(f"LoRA adapter {name!r}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise ConfigError(f"LoRA adapter {name!r}: trained biases are not supported")


def _place(
    spec: ModelSpec, max_rank: int, out: dict[str, np.ndarray], module: str, a: np.ndarray, b: np.ndarray
) -> None:
    """Write one module's ``A`` [r, in] and scaled ``B`` [out, r] into its group's fused stacks
    (``out``: one layer's fields, zeros elsewhere)."""
    kvh, g, d, big_r = spec.num_kv_heads, spec.q_per_kv, spec.head_dim, max_rank
    r = a.shape[0]
    if module in ("q_proj", "k_proj", "v_proj"):
        i = ("q_proj", "k_proj", "v_proj").index(module)
        out["qkv_a"][:, i * big_r : i * big_r + r] = a.T
        if module == "q_proj":  # head kvh_i * g + j is (kv head kvh_i, query j)
            out["qkv_b"][:r, :, :g, :] = b.T.reshape(r, kvh, g, d)
        else:
            out["qkv_b"][i * big_r : i * big_r + r, :, g + i - 1, :] = b.T.reshape(r, kvh, d)
    elif module == "o_proj":
        out["o_a"][..., :r] = a.T.reshape(kvh, g, d, r)
        out["o_b"][:r] = b.T
    elif module in ("gate_proj", "up_proj"):
        i = 0 if module == "gate_proj" else 1
        out["gate_up_a"][:, i * big_r : i * big_r + r] = a.T
        out["gate_up_b"][i * big_r : i * big_r + r, i, :] = b.T
    else:  # down_proj
        out["down_a"][:, :r] = a.T
        out["down_b"][:r] = b.T
