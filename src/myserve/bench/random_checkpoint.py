"""Random-weight checkpoints for benchmarks, written with numpy (no torch, no download).

``python -m myserve.bench.random_checkpoint tiny-llama DIR`` writes ``config.json``,
``model.safetensors`` and the bundled SmolLM2 tokenizer into ``DIR``, so that
``python -m myserve.serve --hf-checkpoint DIR`` serves it as it would a real checkpoint. It prints
the shape's total and active (per token) parameter counts.

Shapes:
- ``tiny-llama``: 2 layers, hidden 64, SmolLM2's 49152-token vocabulary. Its compute is negligible,
  so a server's throughput on it measures the per-step host work (planning, dispatch, reading
  results, detokenizing, SSE): the host-bound yardstick.
- ``tiny-llama-16``: the yardstick with 16 layers (Llama-3.2-1B's count): host work that grows
  with the number of layers or weight arrays (per-array dispatch, argument handling) shows on it
  and not on the 2-layer one.
- ``llama-3.2-1b``: Llama-3.2-1B's shapes (16 layers, hidden 2048, vocab 128256, tied head), for
  accelerator benchmarks against the memory-bandwidth roofline.
- ``llama-3.1-8b``: Llama-3.1-8B's shapes (32 layers, hidden 4096, vocab 128256, separate head):
  what ``config/llama-3.1-8b-h100.yaml`` serves, for ``python -m myserve.bench.device``.
- ``moe-1b``: a Qwen3-MoE (``qwen3_moe``) of ~1.0B parameters of which ~0.21B are active per token:
  16 layers, hidden 1024, 16 query / 8 KV heads of 64, 32 experts of width 576 with top-4 routing
  (renormalised), SmolLM2's vocabulary, tied head. Experts in HF's per-expert layout
  (``mlp.experts.{j}.{gate,up,down}_proj.weight``, router ``mlp.gate.weight``).
- ``dense-active``: the dense Qwen3 (``qwen3``) with ``moe-1b``'s attention, embeddings and norms
  and one MLP of width 4 x 576 = 2304: the same active parameters, the yardstick the MoE's
  grouped matmul is compared with (docs/performance.md, "Mixture-of-Experts on CPU").
- ``tiny-moe``: a Qwen3-MoE with the yardstick's size (2 layers, hidden 64, 8 experts of width 32,
  top-2): the MoE path of ``python -m myserve.bench.device --tiny`` on a CPU.

``--layers N`` writes a shape with ``N`` layers instead of its own (the same layer, a shorter run).

Weights are drawn with std 0.02 (transformers' init): logits are near uniform, so text is
meaningless and every token is about as likely (so routing is near uniform over the experts);
right for timing only.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

SHAPES: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    ),
    "llama-3.2-1b": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        tie_word_embeddings=True,
    ),
}
SHAPES["tiny-llama-16"] = SHAPES["tiny-llama"] | {"num_hidden_layers": 16}
_LLAMA3_ROPE = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
SHAPES["llama-3.1-8b"] = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=_LLAMA3_ROPE,
    tie_word_embeddings=False,
)
_QWEN3_1B = dict(
    vocab_size=49152,
    hidden_size=1024,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    attention_bias=False,
    use_sliding_window=False,
    tie_word_embeddings=True,
)
SHAPES["moe-1b"] = dict(
    model_type="qwen3_moe",
    **_QWEN3_1B,
    intermediate_size=4 * 576,  # unused by the MoE layers; transformers' config requires it
    num_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=576,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)
SHAPES["dense-active"] = dict(model_type="qwen3", **_QWEN3_1B, intermediate_size=4 * 576)
SHAPES["tiny-moe"] = dict(
    model_type="qwen3_moe",
    **(
        _QWEN3_1B | dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    ),
    intermediate_size=128,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
DTYPES = ("float32", "bfloat16", "float16")


def _tensors(cfg: dict[str, Any], rng: np.random.Generator, dtype: np.dtype) -> dict[str, np.ndarray]:
    """HF-named tensors of a random Llama, Qwen3 or Qwen3-MoE (``cfg["model_type"]``) with
    ``cfg``'s shapes."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    model_type = cfg.get("model_type", "llama")

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, np.float32) * 0.02).astype(dtype)

    out = {"model.embed_tokens.weight": normal(cfg["vocab_size"], hidden)}
    ones = np.ones(hidden, dtype)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": ones,
            p + "post_attention_layernorm.weight": ones,
            p + "self_attn.q_proj.weight": normal(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": normal(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": normal(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": normal(hidden, heads * head_dim),
        }
        if model_type in ("qwen3", "qwen3_moe"):
            head_ones = np.ones(head_dim, dtype)
            out |= {p + "self_attn.q_norm.weight": head_ones, p + "self_attn.k_norm.weight": head_ones}
        if model_type == "qwen3_moe":
            width = cfg["moe_intermediate_size"]
            out[p + "mlp.gate.weight"] = normal(cfg["num_experts"], hidden)
            for j in range(cfg["num_experts"]):
                e = f"{p}mlp.experts.{j}."
                out |= {
                    e + "gate_proj.weight": normal(width, hidden),
                    e + "up_proj.weight": normal(width, hidden),
                    e + "down_proj.weight": normal(hidden, width),
                }
        else:
            out |= {
                p + "mlp.gate_proj.weight": normal(inter, hidden),
                p + "mlp.up_proj.weight": normal(inter, hidden),
                p + "mlp.down_proj.weight": normal(hidden, inter),
            }
    out["model.norm.weight"] = ones
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = normal(cfg["vocab_size"], hidden)
    return out


def _config(shape: str, layers: int | None) -> dict[str, Any]:
    """``shape``'s config fields, with ``layers`` layers when given."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    return SHAPES[shape] | ({} if layers is None else {"num_hidden_layers": layers})


def parameter_counts(shape: str, layers: int | None = None) -> tuple[int, int]:
    """(total, active) parameters of ``shape`` (with ``layers`` layers instead of its own when
    given): active counts what one token's forward pass uses, i.e. only ``num_experts_per_tok`` of a
    MoE layer's experts (embeddings and head included)."""
    cfg = _config(shape, layers)
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    norms = 2 * hidden + (2 * head_dim if cfg.get("model_type") in ("qwen3", "qwen3_moe") else 0)
    if "num_experts" in cfg:
        expert = 3 * hidden * cfg["moe_intermediate_size"]
        router = cfg["num_experts"] * hidden
        mlp_total, mlp_active = cfg["num_experts"] * expert + router, cfg["num_experts_per_tok"] * expert + router
    else:
        mlp_total = mlp_active = 3 * hidden * cfg["intermediate_size"]
    outer = vocab * hidden * (1 if cfg.get("tie_word_embeddings", False) else 2) + hidden
    layers = cfg["num_hidden_layers"]
    return outer + layers * (attention + norms + mlp_total), outer + layers * (attention + norms + mlp_active)


def make_random_llama(
    shape: str,
    directory: Path,
    *,
    dtype: str = "float32",
    seed: int = 0,
    layers: int | None = None,
    tokenizer: Path | None = None,
) -> Path:
    """Write a random-weight checkpoint of ``shape`` (a key of SHAPES) with the bundled tokenizer
    (Llama, Qwen3 or Qwen3-MoE, as the shape's ``model_type`` says; the name is historical);
    ``layers`` replaces the shape's layer count (a shorter benchmark of the same layer);
    ``tokenizer``: an HF tokenizer folder (``tokenizer.json``, ``tokenizer_config.json``) to use
    instead of the bundled one (a machine without the 98 MB bundled GGUF)."""
    import ml_dtypes
    from safetensors.numpy import save_file

    from myserve.bundled import bundled_gguf_path
    from myserve.tokenizer import Tokenizer

    cfg = _config(shape, layers)
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    model_type = cfg.get("model_type", "llama")
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "hidden_act": "silu",
        "torch_dtype": dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
        **cfg,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(_tensors(cfg, np.random.default_rng(seed), np_dtype), str(directory / "model.safetensors"))
    Tokenizer.load(bundled_gguf_path() if tokenizer is None else tokenizer).hf.save_pretrained(str(directory))
    return directory


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: write a random checkpoint."""
    p = argparse.ArgumentParser(prog="python -m myserve.bench.random_checkpoint", description=__doc__.split("\n")[0])
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("directory", type=Path)
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=None, help="layers instead of the shape's own (shorter runs)")
    p.add_argument("--tokenizer", type=Path, default=None, help="HF tokenizer folder instead of the bundled one")
    args = p.parse_args(argv)
    make_random_llama(
        args.shape, args.directory, dtype=args.dtype, seed=args.seed, layers=args.layers, tokenizer=args.tokenizer
    )
    total, active = parameter_counts(args.shape, args.layers)
    print(f"{args.directory}: {args.shape}, {total:,} parameters, {active:,} active per token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
