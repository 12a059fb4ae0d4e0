"""Checkpoint loading: HF directories, hub ids (local cache only), GGUF files, the bundled default.

Weights are read one tensor at a time (or the two or three one fused weight combines, such as
q/k/v of one layer), converted to our layout and dtype on the host, and placed straight onto the
mesh with the sharding the rules give (``models/placer.py``). The host never holds more than one
layer's few tensors.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import haliax as hax
import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (names bfloat16 for numpy: safetensors reads bf16 as numpy)
import numpy as np
from jax.sharding import Mesh

from myserve.errors import CheckpointError
from myserve.models.axes import ModelAxes
from myserve.models.checkpoint import ResolvedCheckpoint, hf_spec
from myserve.models.gguf import GGUFSource
from myserve.models.llama import DecoderLayer, LlamaModel, Weight
from myserve.models.lora import LoraLayer, stack_axes
from myserve.models.moe import MoeBlock
from myserve.models.narrow import NarrowWeight
from myserve.models.narrow_host import BlockLayout
from myserve.models.native_checkpoint import NativeSource, is_native_checkpoint
from myserve.models.placer import Combine, NarrowPlacer, Placer, Split, TensorSource
from myserve.models.row_head import wants_row_head
from myserve.models.sharding import MeshAxes
from myserve.models.spec import ModelSpec
from myserve.ops.gpu_grouped_matmul import resolve_quantized_matmul
from myserve.ops.moe import resolve_moe_backend

logger = logging.getLogger(__name__)


_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)
"""Where vision-language checkpoints keep their text model's weights (transformers' older and newer
namings), and the names a text-only checkpoint gives them: the decoder loads from either."""


class SafetensorsSource:
    """Tensors of an HF checkpoint directory: one or many ``*.safetensors`` (with an index)."""

    def __init__(self, directory: Path):
        from safetensors import SafetensorError, safe_open

        self._safe_open, self._error = safe_open, SafetensorError
        self.spec = hf_spec(directory)
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
        self._stored: dict[str, str] = {}  # a text-model name -> the name a vision-language checkpoint stores it under
        for name in list(self._files):
            for prefix, plain in _TEXT_PREFIXES:
                if name.startswith(prefix) and plain + name[len(prefix) :] not in self._files:
                    alias = plain + name[len(prefix) :]
                    self._files[alias], self._stored[alias] = self._files[name], name

    def _open(self, file: Path, framework: str = "numpy"):
        try:
            return self._safe_open(str(file), framework=framework)
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
        stored = self._stored.get(hf_name, hf_name)
        return self._read(file, stored, lambda f: f.get_tensor(stored))

    def _read(self, file: Path, hf_name: str, get: Callable[[Any], Any]) -> np.ndarray:
        """``get`` applied to ``file`` opened for numpy (bf16 through ``ml_dtypes``), or for JAX on
        the host CPU where numpy has no name for the dtype. Not JAX first: each new shape it reads
        compiles an executable (``jit(stage)``), a warm start's only compiles."""
        try:
            try:
                return get(self._open(file))
            except (TypeError, AttributeError):  # a dtype numpy lacks even with ml_dtypes
                with jax.default_device(jax.local_devices(backend="cpu")[0]):
                    return np.asarray(get(self._open(file, "flax")))
        except (self._error, OSError, ValueError) as e:
            raise CheckpointError(f"{file}: corrupt tensor {hf_name} ({e})") from None

    def read_slice(self, hf_name: str, index: tuple[slice, ...]) -> np.ndarray:
        """One part of a tensor, reading only its bytes (safetensors' lazy slices)."""
        file = self._files.get(hf_name)
        if file is None:
            raise CheckpointError(f"checkpoint has no tensor {hf_name}")
        stored = self._stored.get(hf_name, hf_name)
        return self._read(file, stored, lambda f: f.get_slice(stored)[index])


def open_source(resolved: ResolvedCheckpoint, weights: str | Path | None = None) -> TensorSource:
    """The tensor source of a resolved checkpoint; with ``weights`` (``model.checkpoint_path``), the
    weights are that Orbax or Levanter checkpoint's and ``resolved`` gives the configuration."""
    if weights is not None:
        return NativeSource(Path(weights).expanduser(), hf_spec(resolved.path))
    if resolved.kind == "hf" and is_native_checkpoint(resolved.path):  # its config.json beside it
        return NativeSource(resolved.path, hf_spec(resolved.path))
    return GGUFSource(resolved.path) if resolved.kind == "gguf" else SafetensorsSource(resolved.path)


def _layer_table(spec: ModelSpec, ax: ModelAxes) -> dict[str, tuple[tuple[str, ...], tuple, Combine | None]]:
    """field of DecoderLayer -> (HF suffixes, our axes, combine(*tensors) -> our layout)."""
    e, g, d = spec.hidden_size, spec.q_per_kv, spec.head_dim

    def qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        # [out, in] -> [in, kv_heads, qkv, head_size]: per KV head its query heads, then k, then v.
        # -1 for the KV heads: a multi-host load combines only its own heads (Placer.place).
        qs = q.T.reshape(e, -1, g, d)
        return np.concatenate([qs, k.T.reshape(e, -1, 1, d), v.T.reshape(e, -1, 1, d)], axis=2)

    def qkv_bias(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        return np.concatenate([q.reshape(-1, g, d), k.reshape(-1, 1, d), v.reshape(-1, 1, d)], axis=1)

    attn = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    # Llama's post_attention_layernorm is its MLP's input norm; Gemma (sandwich norms) names that
    # one pre_feedforward_layernorm, and its post_attention_layernorm normalizes the attention output.
    mlp_norm = "pre_feedforward_layernorm" if spec.sandwich_norms else "post_attention_layernorm"
    table: dict[str, tuple[tuple[str, ...], tuple, Combine | None]] = {
        "attn_norm": (("input_layernorm.weight",), (ax.Embed,), None),
        "qkv_proj": (tuple(f"{p}.weight" for p in attn), (ax.Embed, ax.KVHeads, ax.QKV, ax.HeadSize), qkv),
        "o_proj": (
            ("self_attn.o_proj.weight",),
            (ax.KVHeads, ax.QPerKV, ax.HeadSize, ax.Embed),
            lambda w: w.T.reshape(-1, g, d, e),
        ),
        "mlp_norm": ((f"{mlp_norm}.weight",), (ax.Embed,), None),
        "gate_up_proj": (
            ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
            (ax.Embed, ax.GateUp, ax.Mlp),
            lambda gate, up: np.stack([gate.T, up.T], axis=1),
        ),
        "down_proj": (("mlp.down_proj.weight",), (ax.Mlp, ax.Embed), np.transpose),
    }
    if spec.qkv_bias:
        table["qkv_bias"] = (tuple(f"{p}.bias" for p in attn), (ax.KVHeads, ax.QKV, ax.HeadSize), qkv_bias)
    if spec.o_bias:
        table["o_bias"] = (("self_attn.o_proj.bias",), (ax.Embed,), None)
    if spec.qk_norm:
        table["q_norm"] = (("self_attn.q_norm.weight",), (ax.HeadSize,), None)
        table["k_norm"] = (("self_attn.k_norm.weight",), (ax.HeadSize,), None)
    if spec.is_moe:  # the MLP is the layer's MoeBlock (_moe_table)
        del table["gate_up_proj"], table["down_proj"]
    if spec.sandwich_norms:
        table["post_attn_norm"] = (("post_attention_layernorm.weight",), (ax.Embed,), None)
        table["post_mlp_norm"] = (("post_feedforward_layernorm.weight",), (ax.Embed,), None)
    if spec.mlp_bias:
        table["gate_up_bias"] = (("mlp.gate_proj.bias", "mlp.up_proj.bias"), (ax.GateUp, ax.Mlp), np.stack)
        table["down_bias"] = (("mlp.down_proj.bias",), (ax.Embed,), None)
    return table


def _moe_table(spec: ModelSpec, ax: ModelAxes, fused: bool) -> dict[str, tuple[tuple[str, ...], tuple, Combine | None]]:
    """field of MoeBlock -> (HF suffixes, our axes, combine). Checkpoints store each expert's
    projections apart (``experts.{j}.gate_proj``; Mixtral ``w1``/``w3``/``w2``), or, as transformers 5
    saves them, fused (``fused``: ``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I])."""
    mixtral = spec.model_type == "mixtral"
    moe = "block_sparse_moe" if mixtral else "mlp"
    e, h, i = spec.num_experts, spec.hidden_size, spec.expert_intermediate_size
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    experts = (ax.Experts, ax.Embed, ax.GateUp, ax.ExpertMlp)
    table: dict[str, tuple[tuple[str, ...], tuple, Combine | None]] = {
        "router": ((f"{moe}.gate.weight",), (ax.Embed, ax.Routes), np.transpose)
    }
    if fused:
        table["gate_up"] = (
            (f"{moe}.experts.gate_up_proj",),
            experts,
            lambda w: w.reshape(-1, 2, i, h).transpose(0, 3, 1, 2),
        )
        table["down"] = (
            (f"{moe}.experts.down_proj",),
            (ax.Experts, ax.ExpertMlp, ax.Embed),
            lambda w: w.transpose(0, 2, 1),
        )
    else:
        # [out, in] per expert -> [experts, in, gate_up, out]; the host holds one layer's experts at once.
        pairs = tuple(f"{moe}.experts.{j}.{p}.weight" for j in range(e) for p in (gate, up))
        table["gate_up"] = (
            pairs,
            experts,
            lambda *w: np.stack([np.stack([g.T, u.T], axis=1) for g, u in zip(w[::2], w[1::2], strict=True)]),
        )
        downs = tuple(f"{moe}.experts.{j}.{down}.weight" for j in range(e))
        table["down"] = (downs, (ax.Experts, ax.ExpertMlp, ax.Embed), lambda *w: np.stack([d.T for d in w]))
    if spec.shared_expert_intermediate_size:
        shared = f"{moe}.shared_expert"
        table["shared_gate_up"] = (
            (f"{shared}.gate_proj.weight", f"{shared}.up_proj.weight"),
            (ax.Embed, ax.GateUp, ax.SharedMlp),
            lambda g, u: np.stack([g.T, u.T], axis=1),
        )
        table["shared_down"] = ((f"{shared}.down_proj.weight",), (ax.SharedMlp, ax.Embed), np.transpose)
        table["shared_gate"] = ((f"{moe}.shared_expert_gate.weight",), (ax.Embed,), lambda w: w.reshape(-1))
    return table


def _splits(spec: ModelSpec, fused: bool) -> dict[str, Split]:
    """field -> which part of its HF tensors each part of its sharded axes reads (``Placer.place``):
    a multi-host load reads only its own KV heads, MLP columns, experts and vocabulary rows."""
    q_rows = spec.q_per_kv * spec.head_dim  # HF rows of q_proj per KV head
    splits: dict[str, Split] = {
        "qkv_proj": {"kv_heads": (0, (q_rows, spec.head_dim, spec.head_dim))},
        "qkv_bias": {"kv_heads": (0, (q_rows, spec.head_dim, spec.head_dim))},
        "o_proj": {"kv_heads": (1, q_rows)},
        "gate_up_proj": {"mlp": (0, 1)},
        "down_proj": {"mlp": (1, 1)},
        "gate_up_bias": {"mlp": (0, 1)},
        "shared_gate_up": {"shared_mlp": (0, 1)},
        "shared_down": {"shared_mlp": (1, 1)},
    }
    if fused:  # [E, 2I, H] (gate rows, then up rows: an expert_mlp part is two ranges, cut after) and [E, H, I]
        splits["gate_up"] = {"experts": (0, 1)}
        splits["down"] = {"experts": (0, 1), "expert_mlp": (2, 1)}
    else:  # one [out, in] tensor per expert and projection
        splits["gate_up"] = {"experts": "names", "expert_mlp": (0, 1)}
        splits["down"] = {"experts": "names", "expert_mlp": (1, 1)}
    return splits


_VOCAB_SPLIT: Split = {"vocab": (0, 1)}
"""The embedding table and LM head: HF [vocab, embed] rows."""


# RMSNorm weights: with ``spec.norm_unit_offset`` (Gemma, whose norms scale by ``1 + w``) they get
# the 1 added here, in float32, and stay float32 whatever the model dtype, so the norm multiplies by
# exactly transformers' float32 ``1.0 + w`` (llama.cpp's GGUF converter folds the 1 in the same way).
_NORMS = frozenset({"attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "q_norm", "k_norm"})


def _unit_offset(w: np.ndarray) -> np.ndarray:
    """A Gemma norm weight ``w`` as the factor it applies, ``1 + w``, in float32."""
    return w.astype(np.float32) + np.float32(1.0)


# Matmul weights and the axes (by position) they are contracted over: these are what int8
# quantization replaces; norms, biases and the embedding table stay in the model dtype (Gemma's
# norms in float32, above).
_CONTRACTED: dict[str, tuple[int, ...]] = {
    "qkv_proj": (0,),
    "o_proj": (0, 1, 2),
    "gate_up_proj": (0,),
    "down_proj": (0,),
}


# A MoE layer's matmul weights kept narrow under int8/int4 (the router and shared gate stay float).
_EXPERT_MATMULS = frozenset({"gate_up", "down", "shared_gate_up", "shared_down"})

# load_model's default dtype, a np.dtype (jax 0.12 types jnp.float32 as a scalar type, not a dtype).
_FLOAT32 = jnp.dtype(jnp.float32)


def load_model(
    source: TensorSource,
    mesh: Mesh,
    mapping: Mapping[str, MeshAxes],
    dtype: jnp.dtype = _FLOAT32,
    attention_backend: str = "reference",
    quantization: str = "none",
    abstract: bool = False,
    group_size: int = 128,
    lora: tuple[int, int] = (0, 0),
    moe_backend: str = "auto",
    quantized_matmul: str = "auto",
) -> LlamaModel:
    """Build a ``LlamaModel`` from a tensor source, every weight placed on ``mesh`` by ``mapping``.

    ``quantization``: ``int8`` / ``int4`` keep every matmul weight, the LM head and the embedding
    table narrow (``models/narrow.py``; GGUF blocks as the file holds them), ``w8a8`` stores the
    dense matmuls and the head as int8 with activations quantized per token (``models/quant.py``).
    ``abstract=True`` reads nothing: every weight is a ``jax.ShapeDtypeStruct`` with the sharding it
    would have (enough to lower the steps early). ``group_size``: elements per scale of weights
    quantized here (0: one per output channel). ``lora``: (slots, max rank) of the LoRA stacks each
    layer holds (``models/lora.py``; zeros until an adapter is written into a slot), or (0, 0): none.
    ``moe_backend``: ``engine.moe_backend``, the experts' grouped matmul (``ops/moe.py``).
    ``quantized_matmul``: ``engine.quantized_matmul``, how narrow dense weights multiply.
    """
    spec = source.spec
    moe_impl = resolve_moe_backend(moe_backend) if spec.is_moe else "loop"
    ax = ModelAxes.of(spec)
    bits = {"int8": 8, "int4": 4}.get(quantization)
    placer = (
        NarrowPlacer(
            source,
            mesh,
            mapping,
            jnp.dtype(dtype),
            abstract,
            bits=bits,
            group=group_size,
            kernel=resolve_quantized_matmul(quantized_matmul, mesh.devices.size),
        )  # fmt: skip
        if bits
        else Placer(source, mesh, mapping, jnp.dtype(dtype), abstract)
    )
    w8a8 = quantization == "w8a8"

    def norm(host: np.ndarray, axes: tuple) -> hax.NamedArray:
        if spec.norm_unit_offset:
            return placer.put(_unit_offset(host), axes, jnp.dtype(jnp.float32))
        return placer.put(host, axes)

    table = _layer_table(spec, ax)
    fused = source.has(
        f"model.layers.0.{'block_sparse_moe' if spec.model_type == 'mixtral' else 'mlp'}.experts.down_proj"
    )
    moe_table = _moe_table(spec, ax, fused) if spec.is_moe else {}
    splits = _splits(spec, fused)
    layouts: dict[str, BlockLayout | None] = {}
    if isinstance(placer, NarrowPlacer):
        for field, (suffixes, _, _) in {**table, **moe_table}.items():
            names = [tuple(f"model.layers.{i}.{s}" for s in suffixes) for i in range(spec.num_layers)]
            layouts[field] = placer.plan(names)

    def weight(field: str, hf_names: tuple[str, ...], axes: tuple, combine: Combine | None) -> Weight:
        if isinstance(placer, NarrowPlacer) and field in _CONTRACTED:
            return placer.narrow(hf_names, axes, combine, n_in=len(_CONTRACTED[field]), layout=layouts[field])
        if field in _NORMS:
            return norm(placer.host(hf_names, axes, combine), axes)
        if w8a8 and field in _CONTRACTED:
            return placer.put_quantized(placer.host(hf_names, axes, combine), axes, _CONTRACTED[field])
        return placer.place(hf_names, axes, combine, split=splits.get(field))

    def expert_weight(field: str, hf_names: tuple[str, ...], axes: tuple, combine: Combine | None) -> Weight:
        if isinstance(placer, NarrowPlacer) and field in _EXPERT_MATMULS:
            n_lead = 1 if axes[0].name == "experts" else 0
            return placer.narrow(hf_names, axes, combine, n_in=1, n_lead=n_lead, layout=layouts[field])
        return placer.place(hf_names, axes, combine, split=splits.get(field))

    def layer(i: int) -> DecoderLayer:
        fields: dict[str, object] = {
            field: weight(field, tuple(f"model.layers.{i}.{s}" for s in suffixes), axes, combine)
            for field, (suffixes, axes, combine) in table.items()
        }
        if moe_table:  # under w8a8 the experts stay in the model dtype (docs/design/models.md)
            fields["moe"] = MoeBlock(
                impl=moe_impl,
                **{
                    field: expert_weight(field, tuple(f"model.layers.{i}.{s}" for s in suffixes), axes, combine)
                    for field, (suffixes, axes, combine) in moe_table.items()
                },
            )
        if lora[0]:
            fields["lora"] = LoraLayer(
                **{
                    name: placer.put(np.zeros(tuple(a.size for a in axes), np.float32), axes)
                    for name, axes in stack_axes(spec, *lora).items()
                }
            )
        return DecoderLayer(**fields)  # type: ignore[arg-type]

    layers = tuple(layer(i) for i in range(spec.num_layers))
    embed: Weight
    lm_head: Weight | None = None
    row_head: hax.NamedArray | None = None  # (models/row_head.py)
    if isinstance(placer, NarrowPlacer):
        # One narrow table (embed | vocab) serves the lookup (rows dequantized) and, tied, the head.
        def narrow_table(name: str) -> NarrowWeight:
            # Quantized from float, the table and head take 8 bits even under int4 (4-bit logits
            # measured 2.5x SmolLM2's perplexity; llama.cpp's 4-bit mixes keep them at 6-8 bits too).
            layout = placer.plan([(name,)])
            return placer.narrow((name,), (ax.Embed, ax.Vocab), np.transpose, n_in=1, layout=layout, min_bits=8)

        embed = narrow_table("model.embed_tokens.weight")
        lm_head = None if spec.tie_word_embeddings else narrow_table("lm_head.weight")
    elif w8a8:
        embed_host = placer.host(("model.embed_tokens.weight",), (ax.Vocab, ax.Embed))
        if not spec.tie_word_embeddings:
            head_host = placer.host(("lm_head.weight",), (ax.Embed, ax.Vocab), np.transpose)
            lm_head = placer.put_quantized(head_host, (ax.Embed, ax.Vocab), (0,))
        else:  # tied: the lookup keeps the float table, the head gets an int8 copy
            lm_head = placer.put_quantized(embed_host, (ax.Vocab, ax.Embed), (1,))
        embed = placer.put(embed_host, (ax.Vocab, ax.Embed))
    else:
        embed = placer.place(("model.embed_tokens.weight",), (ax.Vocab, ax.Embed), split=_VOCAB_SPLIT)
        if not spec.tie_word_embeddings:
            lm_head = placer.place(("lm_head.weight",), (ax.Embed, ax.Vocab), np.transpose, split=_VOCAB_SPLIT)
        elif wants_row_head(mesh, placer.dtype, ax.Vocab.size, ax.Embed.size):
            tied = ("model.embed_tokens.weight",)
            row_head = placer.place(tied, (ax.Embed, ax.Vocab), np.transpose, split=_VOCAB_SPLIT)
    final_norm = norm(placer.host(("model.norm.weight",), (ax.Embed,)), (ax.Embed,))
    if not abstract:  # a multi-host load reads only its part of the sharded weights (Placer.place)
        logger.info("read %d parameter elements of the checkpoint in this process", placer.elements_read)
    return LlamaModel(
        spec=spec,
        attention_backend=attention_backend,
        embed=embed,
        layers=layers,
        final_norm=final_norm,
        lm_head=lm_head,
        row_head=row_head,
    )
