"""``myserve.bench.export_gguf``: myserve's GGUF loader reads back exactly the HF checkpoint's
weights and shape, with SmolLM2's tokenizer metadata."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from myserve.bench.export_gguf import export_gguf, main
from myserve.errors import CheckpointError

pytestmark = pytest.mark.slow  # transformers and the tokenizer metadata: ~10-25 s each on 2 cores


def _assert_same_model(hf_dir: Path, gguf_path: Path) -> None:
    """Every HF tensor reads back bit-identical through the GGUF loader (Q/K un-permuted), and the
    spec is the same but for rms_norm_eps, which GGUF stores as float32."""
    from myserve.models.gguf import GGUFSource
    from myserve.models.loading import SafetensorsSource

    hf, gg = SafetensorsSource(hf_dir), GGUFSource(gguf_path)
    assert gg.spec.rms_norm_eps == pytest.approx(hf.spec.rms_norm_eps, rel=1e-6)
    assert gg.spec == type(hf.spec)(**{**vars(hf.spec), "rms_norm_eps": gg.spec.rms_norm_eps})
    names = [n for n in hf._files if not (hf.spec.tie_word_embeddings and n == "lm_head.weight")]
    assert len(names) == 2 + 9 * hf.spec.num_layers + (0 if hf.spec.tie_word_embeddings else 1)
    for name in names:
        ours, theirs = gg.read(name), hf.read(name)
        assert ours.dtype == np.float32 and ours.shape == theirs.shape, name
        assert np.array_equal(ours, theirs), name


def test_tiny_llama_untied_round_trips(tmp_path: Path) -> None:
    """A transformers-made Llama (separate head, 2 KV heads for 4 query heads) with SmolLM2's
    vocabulary; its llama3 rope scaling is dropped first (the exporter refuses it)."""
    from myserve.testing import make_tiny_checkpoint

    hf_dir = make_tiny_checkpoint("llama3", tmp_path / "hf", vocab_size=49152)
    with pytest.raises(CheckpointError, match="rope scaling"):
        export_gguf(hf_dir, tmp_path / "refused.gguf")
    config = json.loads((hf_dir / "config.json").read_text())
    for key in ("rope_scaling", "rope_parameters"):
        config.pop(key, None)
    (hf_dir / "config.json").write_text(json.dumps(config))
    out = export_gguf(hf_dir, tmp_path / "tiny.gguf")
    _assert_same_model(hf_dir, out)


def test_yardstick_tied_round_trips_with_smollm2_tokenizer(tmp_path: Path) -> None:
    """The yardstick's own writer (tied head), through the CLI; the tokenizer keys are SmolLM2's."""
    from myserve.bench.random_checkpoint import make_random_llama
    from myserve.bundled import bundled_gguf_path
    from myserve.models.gguf_file import read_gguf

    hf_dir = make_random_llama("tiny-llama", tmp_path / "hf", layers=1)
    out = tmp_path / "yardstick.gguf"
    assert main([str(hf_dir), str(out)]) == 0
    _assert_same_model(hf_dir, out)
    exported, smol = read_gguf(out), read_gguf(bundled_gguf_path(), with_tensors=False)
    assert "output.weight" not in exported.tensors
    assert all(t.ggml_type == 0 for t in exported.tensors.values())  # F32
    ours = exported.metadata
    tokenizer = {k: v for k, v in smol.metadata.items() if k.startswith("tokenizer.")}
    assert "tokenizer.ggml.merges" in tokenizer and "tokenizer.chat_template" in tokenizer
    assert {k: v for k, v in ours.items() if k.startswith("tokenizer.")} == tokenizer
    assert ours["general.file_type"] == 0  # all F32
    assert ours["llama.rope.dimension_count"] == 16 and ours["llama.vocab_size"] == 49152
