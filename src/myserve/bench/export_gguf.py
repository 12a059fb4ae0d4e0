"""Export an HF Llama checkpoint (the random yardstick) to a float32 GGUF file for llama.cpp.

``python -m myserve.bench.export_gguf CHECKPOINT_DIR OUT.gguf`` writes the checkpoint's weights
under llama.cpp's tensor names with ``llama.*`` metadata from its config, so that llama-server can
be benchmarked on the very weights myserve serves. The tokenizer metadata (every ``tokenizer.*``
key) is copied from the bundled SmolLM2 GGUF: the yardstick checkpoints
(``myserve.bench.random_checkpoint``) carry SmolLM2's tokenizer.

llama.cpp's GGUF files store the Q and K projections' rows permuted (interleaved rotary pairs per
head instead of HF's rotate-half halves); ``myserve.models.gguf`` undoes that on load, and this
module applies the inverse. Only plain Llamas are exported: no rope scaling (llama3 scaling would
need a ``rope_freqs`` tensor, which myserve's GGUF loader does not read), biases, sliding windows
or experts.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from myserve.errors import CheckpointError
from myserve.models.gguf import _GLOBAL_NAMES, _LAYER_NAMES
from myserve.models.spec import ModelSpec

# HF per-layer suffixes of a plain Llama (the keys of the loader's HF -> GGUF name table).
_LLAMA_LAYER = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


def permute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's Q/K projection rows (rotate-half per head) in llama.cpp's order (interleaved pairs):
    the inverse of ``myserve.models.gguf._unpermute_rotary``."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _check_exportable(spec: ModelSpec, where: str) -> None:
    """Refuse what this exporter would silently get wrong."""
    problems = [
        f"model_type {spec.model_type!r} (only 'llama')" if spec.model_type != "llama" else "",
        "rope scaling" if spec.rope_scaling is not None else "",
        "biases" if spec.qkv_bias or spec.o_bias or spec.mlp_bias else "",
        "a sliding window" if spec.sliding_window is not None else "",
        "experts" if spec.num_experts else "",
        f"activation {spec.hidden_act!r}" if spec.hidden_act != "silu" else "",
    ]
    problems = [p for p in problems if p]
    if problems:
        raise CheckpointError(f"{where}: cannot export to GGUF: {', '.join(problems)}")


def _add_llama_metadata(writer, spec: ModelSpec, name: str) -> None:  # noqa: ANN001 (gguf.GGUFWriter)
    """The ``general.*`` and ``llama.*`` keys llama.cpp reads for a float32 Llama."""
    import gguf

    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(spec.max_position_embeddings)
    writer.add_embedding_length(spec.hidden_size)
    writer.add_block_count(spec.num_layers)
    writer.add_feed_forward_length(spec.intermediate_size)
    writer.add_head_count(spec.num_heads)
    writer.add_head_count_kv(spec.num_kv_heads)
    if spec.head_dim != spec.hidden_size // spec.num_heads:
        writer.add_key_length(spec.head_dim)
        writer.add_value_length(spec.head_dim)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(spec.rms_norm_eps)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_vocab_size(spec.vocab_size)


def _copy_tokenizer(writer, reader) -> int:  # noqa: ANN001 (gguf.GGUFWriter, gguf.GGUFReader)
    """Copy every ``tokenizer.*`` key (value and type) of ``reader``'s file into ``writer``;
    return how many."""
    import gguf

    copied = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        sub_type = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub_type)
        copied += 1
    return copied


def export_gguf(checkpoint: Path, out: Path, tokenizer_gguf: Path | None = None) -> Path:
    """Write ``checkpoint`` (an HF Llama directory) as a float32 GGUF file at ``out``, with the
    tokenizer of ``tokenizer_gguf`` (default: the bundled SmolLM2 GGUF); return ``out``."""
    import gguf

    from myserve.bundled import bundled_gguf_path
    from myserve.models.loading import SafetensorsSource

    source = SafetensorsSource(checkpoint)
    spec = source.spec
    _check_exportable(spec, str(checkpoint))
    tokenizer = gguf.GGUFReader(tokenizer_gguf or bundled_gguf_path())
    tokens = tokenizer.fields.get("tokenizer.ggml.tokens")
    if tokens is None or len(tokens.data) != spec.vocab_size:
        found = "none" if tokens is None else len(tokens.data)
        raise CheckpointError(f"{checkpoint}: vocab_size {spec.vocab_size} but the tokenizer has {found} tokens")

    def f32(hf_name: str) -> np.ndarray:
        return np.ascontiguousarray(source.read(hf_name), dtype=np.float32)

    writer = gguf.GGUFWriter(out, "llama")
    _add_llama_metadata(writer, spec, checkpoint.name)
    _copy_tokenizer(writer, tokenizer)
    writer.add_tensor(_GLOBAL_NAMES["model.embed_tokens.weight"], f32("model.embed_tokens.weight"))
    rotary_heads = {"self_attn.q_proj.weight": spec.num_heads, "self_attn.k_proj.weight": spec.num_kv_heads}
    for i in range(spec.num_layers):
        for suffix in _LLAMA_LAYER:
            w = f32(f"model.layers.{i}.{suffix}")
            if suffix in rotary_heads:
                w = permute_rotary(w, rotary_heads[suffix])
            writer.add_tensor(f"blk.{i}.{_LAYER_NAMES[suffix]}", w)
    writer.add_tensor(_GLOBAL_NAMES["model.norm.weight"], f32("model.norm.weight"))
    if not spec.tie_word_embeddings:
        writer.add_tensor(_GLOBAL_NAMES["lm_head.weight"], f32("lm_head.weight"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: export a checkpoint directory to a GGUF file."""
    p = argparse.ArgumentParser(prog="python -m myserve.bench.export_gguf", description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", type=Path, help="HF Llama checkpoint directory (config.json, *.safetensors)")
    p.add_argument("out", type=Path, help="the GGUF file to write")
    args = p.parse_args(argv)
    try:
        export_gguf(args.checkpoint, args.out)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: {args.out.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
