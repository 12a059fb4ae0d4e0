"""Writers of the checkpoints JAX trainers make, from an HF checkpoint's tensors (tests only):
Orbax's ``StandardCheckpointer`` with a pytree keyed by the HF names, and Levanter's layout as its
``tree_serialize_leaves_tensorstore`` writes it (each leaf a zarr array at its module path, through
JAX's own array serialization, which is what Levanter calls), layers stacked or one per directory;
and MaxText's Llama tree as its converters and trainer save it (an Orbax ``CheckpointManager`` step)."""

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
    experts: dict[tuple[int, str], list[tuple[int, np.ndarray]]] = {}
    for name, w in tensors.items():
        parts = name.split(".")
        if parts[3:5] == ["block_sparse_moe", "experts"]:  # Mixtral: haliax MoELinear [experts, in, out]
            experts.setdefault((int(parts[2]), f"block_sparse_moe/experts/{parts[6]}/weight"), []).append(
                (int(parts[5]), w.T)
            )
        elif name == "model.embed_tokens.weight":
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
    for (index, rest), items in experts.items():
        array = np.stack([a for _, a in sorted(items, key=lambda item: item[0])])
        if stacked:
            layers.setdefault(rest, []).append((index, array))  # type: ignore[arg-type]
        else:
            leaves[root / "transformer" / "layers" / "blocks" / str(index) / rest] = array
    for rest, items in layers.items():
        stack = np.stack([a for _, a in sorted(items, key=lambda item: item[0])])
        leaves[root / "transformer" / "layers" / "stacked" / rest] = stack
    manager = serialization.GlobalAsyncCheckpointManager()
    paths = [str(p) for p in leaves]
    manager.serialize_with_paths([jax.numpy.asarray(a) for a in leaves.values()], paths)
    manager.wait_until_finished()
    (out / "metadata.json").write_text(json.dumps({"step": 0, "timestamp": "2026-11-26T00:00:00"}))
    return out


def _maxtext_leaf(name: str, w: np.ndarray, cfg: dict, interleave: bool) -> tuple[str, np.ndarray]:
    """An HF tensor of one layer as MaxText's converter writes it (``to_maxtext.py``'s Llama hooks):
    its path in the layer and its ``[in, out...]`` kernel, q and k interleaved for LLaMA's RoPE
    when ``interleave``, the query divided by sqrt(head_dim) in float32."""
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
    modules = {
        "input_layernorm.weight": "pre_self_attention_layer_norm.scale",
        "post_attention_layernorm.weight": "post_self_attention_layer_norm.scale",
        "self_attn.q_proj.weight": "self_attention.query.kernel",
        "self_attn.k_proj.weight": "self_attention.key.kernel",
        "self_attn.v_proj.weight": "self_attention.value.kernel",
        "self_attn.o_proj.weight": "self_attention.out.kernel",
        "mlp.gate_proj.weight": "mlp.wi_0.kernel",
        "mlp.up_proj.weight": "mlp.wi_1.kernel",
        "mlp.down_proj.weight": "mlp.wo.kernel",
    }
    path = modules[name]
    if w.ndim == 1:
        return path, w
    if name.endswith("o_proj.weight"):
        return path, w.T.reshape(heads, hd, -1)
    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
        x = w.T.reshape(w.shape[1], -1, hd)
        if interleave and not name.endswith("v_proj.weight"):  # halves -> pairs (adjust_rope)
            x = np.stack([x[..., : hd // 2], x[..., hd // 2 :]], axis=-1).reshape(x.shape)
        if name.endswith("q_proj.weight"):  # scale_query
            x = (x.astype(np.float32) * np.float32(1 / np.sqrt(hd))).astype(w.dtype)
        assert x.shape[1] == (heads if "q_proj" in name else kv)
        return path, x
    return path, w.T


def _nest(tree: dict, path: str, value: object) -> None:
    *parents, leaf = path.split(".")
    for key in parents:
        tree = tree.setdefault(key, {})
    tree[leaf] = value


def write_maxtext(hf_dir: Path, out: Path, *, scan_axis: int | None = 1, interleave: bool | None = None) -> Path:
    """A MaxText training checkpoint of the HF Llama's weights, as MaxText's converters and trainer
    save it: an Orbax ``CheckpointManager`` step ``out/0`` whose item ``items`` (OCDBT, zarr3) is the
    ``TrainState`` (``step``, ``params: {params: tree}``, an optimizer moment of the same tree).
    Layers stacked on ``scan_axis`` (MaxText's ``param_scan_axis``), or ``layers_<i>`` when None;
    ``interleave`` defaults to what MaxText's RoPE for the config needs (Llama 3.1's scaling)."""
    import jax
    import orbax.checkpoint as ocp

    cfg = json.loads((hf_dir / "config.json").read_text())
    if interleave is None:
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}  # transformers >= 5, older
        interleave = rope.get("rope_type", rope.get("type")) == "llama3"
    tree: dict = {}
    layers: dict[str, list[tuple[int, np.ndarray]]] = {}
    for name, w in hf_tensors(hf_dir).items():
        if name == "model.embed_tokens.weight":
            _nest(tree, "token_embedder.embedding", w)
        elif name == "model.norm.weight":
            _nest(tree, "decoder.decoder_norm.scale", w)
        elif name == "lm_head.weight":
            _nest(tree, "decoder.logits_dense.kernel", w.T)
        else:
            _, _, index, rest = name.split(".", 3)
            path, array = _maxtext_leaf(rest, w, cfg, interleave)
            if scan_axis is None:
                _nest(tree, f"decoder.layers_{index}.{path}", array)
            else:
                layers.setdefault(path, []).append((int(index), array))
    for path, items in layers.items():
        stack = np.stack([a for _, a in sorted(items, key=lambda item: item[0])], axis=scan_axis)
        _nest(tree, f"decoder.layers.{path}", stack)
    moment = jax.tree_util.tree_map(np.zeros_like, tree)
    state = {"step": 0, "params": {"params": tree}, "opt_state": [{"count": np.int32(0), "mu": {"params": moment}}]}
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)
    options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
    manager = ocp.CheckpointManager(out, item_names=("items",), item_handlers={"items": handler}, options=options)
    manager.save(0, args=ocp.args.Composite(items=ocp.args.PyTreeSave(item=state)))
    manager.wait_until_finished()
    manager.close()
    return out / "0"
