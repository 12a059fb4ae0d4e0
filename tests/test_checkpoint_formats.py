"""Checkpoint formats beyond the defaults: sharded bf16/fp16 safetensors, and every ggml type we rely on."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import load_on_mesh
from test_model_parity import full_logits

from myserve.models.gguf_file import read_gguf
from myserve.testing import hf_logits, make_tiny_checkpoint


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_sharded_half_precision_checkpoint_loads_as_float32(dtype: str, tmp_path: Path) -> None:
    import torch
    import transformers

    src = make_tiny_checkpoint("qwen2", tmp_path / "src", seed=3, dtype=dtype)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, dtype))
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2  # really several files
    ids = [int(t) for t in np.random.RandomState(1).randint(0, 256, size=20)]
    ours = full_logits(*load_on_mesh(sharded), ids)
    # The reference upcasts the same half-precision weights to float32.
    ref = hf_logits(sharded, ids)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # random K-quant blocks may decode to NaN
def test_gguf_reader_slices_every_quant_type(tmp_path: Path) -> None:
    """Our header parser hands gguf.quants the same bytes as gguf.GGUFReader, for each type."""
    import gguf

    rng = np.random.RandomState(0)
    x = rng.randn(8, 512).astype(np.float32)
    q = gguf.GGMLQuantizationType
    tensors: dict[str, tuple[np.ndarray, q | None]] = {
        "f32": (x, None),
        "f16": (x.astype(np.float16), None),
        "q8_0": (gguf.quants.quantize(x, q.Q8_0), q.Q8_0),
        "q4_0": (gguf.quants.quantize(x, q.Q4_0), q.Q4_0),
        "q4_1": (gguf.quants.quantize(x, q.Q4_1), q.Q4_1),
    }
    # The gguf package cannot quantize K-quants; random blocks of the right size still test slicing.
    for name, qtype in (("q4_k", q.Q4_K), ("q6_k", q.Q6_K)):
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.randint(0, 256, size=(8, 512 // block * size)).astype(np.uint8)
        raw[:, :2] = [0, 0x3C]  # keep the leading f16 scale finite (1.0)
        tensors[name] = (raw, qtype)
    path = tmp_path / "types.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours = read_gguf(path).tensors
    theirs = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    for name in tensors:
        a = gguf.quants.dequantize(ours[name].data, q(ours[name].ggml_type)).reshape(ours[name].shape)
        b = gguf.quants.dequantize(theirs[name].data, theirs[name].tensor_type)
        assert a.shape == (8, 512), name
        np.testing.assert_array_equal(a, np.asarray(b).reshape(8, 512), err_msg=name)
    np.testing.assert_allclose(gguf.quants.dequantize(ours["q8_0"].data, q.Q8_0).reshape(8, 512), x, atol=0.05)
