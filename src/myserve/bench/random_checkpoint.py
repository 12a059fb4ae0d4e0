"""Random-weight Llama checkpoints for benchmarks, written with numpy (no torch, no download).

``python -m myserve.bench.random_checkpoint tiny-llama DIR`` writes ``config.json``,
``model.safetensors`` and the bundled SmolLM2 tokenizer into ``DIR``, so that
``python -m myserve.serve --hf-checkpoint DIR`` serves it as it would a real checkpoint.

Shapes:
- ``tiny-llama``: 2 layers, hidden 64, SmolLM2's 49152-token vocabulary. Its compute is negligible,
  so a server's throughput on it measures the per-step host work (planning, dispatch, reading
  results, detokenizing, SSE): the host-bound yardstick.
- ``llama-3.2-1b``: Llama-3.2-1B's shapes (16 layers, hidden 2048, vocab 128256, tied head), for
  accelerator benchmarks against the memory-bandwidth roofline.

Weights are drawn with std 0.02 (transformers' init): logits are near uniform, so text is
meaningless and every token is about as likely; right for timing only.
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
DTYPES = ("float32", "bfloat16", "float16")


def _tensors(cfg: dict[str, Any], rng: np.random.Generator, dtype: np.dtype) -> dict[str, np.ndarray]:
    """HF-named tensors of a random Llama with ``cfg``'s shapes."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads

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
            p + "mlp.gate_proj.weight": normal(inter, hidden),
            p + "mlp.up_proj.weight": normal(inter, hidden),
            p + "mlp.down_proj.weight": normal(hidden, inter),
        }
    out["model.norm.weight"] = ones
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = normal(cfg["vocab_size"], hidden)
    return out


def make_random_llama(shape: str, directory: Path, *, dtype: str = "float32", seed: int = 0) -> Path:
    """Write a random-weight checkpoint of ``shape`` (a key of SHAPES) with the bundled tokenizer."""
    import ml_dtypes
    from safetensors.numpy import save_file

    from myserve.bundled import bundled_gguf_path
    from myserve.tokenizer import Tokenizer

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    cfg = SHAPES[shape]
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "torch_dtype": dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
        **cfg,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(_tensors(cfg, np.random.default_rng(seed), np_dtype), str(directory / "model.safetensors"))
    Tokenizer.load(bundled_gguf_path()).hf.save_pretrained(str(directory))
    return directory


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: write a random checkpoint."""
    p = argparse.ArgumentParser(prog="python -m myserve.bench.random_checkpoint", description=__doc__.split("\n")[0])
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("directory", type=Path)
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    make_random_llama(args.shape, args.directory, dtype=args.dtype, seed=args.seed)
    print(args.directory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
