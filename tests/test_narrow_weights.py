"""Weights kept narrow on device (``model.quantization: int8 | int4``): the quantized step equals a
dequantize-then-float32 reference of the same weights on 1, 2 and 4 fake devices (dense and MoE,
tensor and expert parallel), codes and scales shard like the weights they replace, device bytes
are those of the codes and scales, and GGUF blocks are kept as stored."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from test_gguf_blocks import random_tensor

from myserve.bench.random_checkpoint import SHAPES
from myserve.models.checkpoint import resolve_checkpoint
from myserve.models.gguf import KEPT_LAYOUTS, GGUFSource, resolve_quantization
from myserve.models.gguf_blocks import read_blocks
from myserve.models.loading import load_model, open_source
from myserve.models.narrow import NarrowWeight
from myserve.models.narrow_host import blocks_layout, group_size, ideal_bytes
from myserve.models.sharding import axis_mapping
from myserve.models.spec import spec_from_hf_config
from myserve.runtime.mesh import make_mesh

WORKER = Path(__file__).with_name("narrow_worker.py")


def run_worker(checkpoint: Path, quantization: str, *meshes: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(checkpoint), quantization, *meshes],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=WORKER.parent,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_close(result: dict) -> None:
    for mesh, r in result.items():
        # float32 rounding of the same sums in another order (and across devices): ~1e-5 of logits ~5.
        assert r["max_abs_diff"] <= 1e-4 * max(1.0, r["max_abs_logit"]), (mesh, r)


@pytest.mark.parametrize("quantization, codes", [("int8", "int8"), ("int4", "uint8")])
def test_dense_step_equals_the_dequantized_reference_on_1_2_4_devices(tiny_checkpoints, quantization, codes) -> None:
    result = run_worker(tiny_checkpoints["llama3"], quantization, "1x1", "1x2", "1x4")
    assert_close(result)
    for mesh, devices in (("1x1", 1), ("1x2", 2), ("1x4", 4)):
        layout = result[mesh]["layout"]
        # Output-sharded (gate_up over mlp, the table over vocab) and contracted-sharded (o_proj over
        # kv_heads, down over mlp) weights: the groups axis takes the contracted axis's mesh axis.
        assert layout["gate_up_proj"]["codes"] == "P(None, None, None, 'model')"
        assert layout["gate_up_proj"]["scale"] == "P(None, None, 'model')"
        assert layout["down_proj"]["codes"] == "P('model', None, None)"
        assert layout["embed"]["codes"] == "P(None, None, 'model')"
        assert {w["devices"] for w in layout.values()} == {devices}
        # The tied table (and head) keep 8 bits under int4 too.
        assert {w["codes_dtype"] for name, w in layout.items() if name != "embed"} == {codes}
        assert layout["embed"]["codes_dtype"] == "int8"
    # The 2 KV heads split over 2 devices but not over 4: o_proj then replicates, like the float weight.
    assert result["1x2"]["layout"]["o_proj"]["codes"] == "P('model', None, None)"


def test_moe_experts_stay_narrow_under_expert_and_tensor_parallelism(tiny_checkpoints) -> None:
    """Qwen2-MoE (routed and shared experts) in int4 on EP 2 x TP 2 and EP 4 (one device: the dense tests)."""
    result = run_worker(tiny_checkpoints["qwen2_moe"], "int4", "1x2x2", "1x4x1")
    assert_close(result)
    for mesh in result:
        layout = result[mesh]["layout"]
        assert layout["experts_gate_up"]["codes"] == "P('expert', None, None, None, 'model')"
        assert layout["experts_down"]["codes"] == "P('expert', 'model', None, None)"
        assert layout["experts_down"]["scale"] == "P('expert', 'model', None)"
        assert layout["experts_down"]["codes_dtype"] == "uint8"
    assert result["1x2x2"]["layout"]["experts_down"]["devices"] == 4


def test_int8_moe_on_two_devices(tiny_checkpoints) -> None:
    assert_close(run_worker(tiny_checkpoints["qwen3_moe"], "int8", "1x2x1"))


def _bytes(model) -> int:  # noqa: ANN001
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(model))


def _narrow_weights(model) -> list[NarrowWeight]:  # noqa: ANN001
    leaves = jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, NarrowWeight))
    return [w for w in leaves if isinstance(w, NarrowWeight)]


def _ideal(model, bits: int) -> int:  # noqa: ANN001
    """Bytes the weights need: each narrow weight's codes at its width plus a float32 scale per group
    of 128 (and an offset for 4-bit), every other leaf as it is. The table (and head) keep 8 bits
    under int4."""
    total = 0
    for w in jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, NarrowWeight)):
        if not isinstance(w, NarrowWeight):
            total += w.size * w.dtype.itemsize
            continue
        numel = int(np.prod([a.size for a in (*w.lead_axes, *w.in_axes, *w.out_axes)]))
        k = int(np.prod([a.size for a in w.in_axes]))
        table = "vocab" in {a.name for a in w.out_axes}
        assert w.bits == (8 if table else bits)
        group = group_size(k, 1, 128)
        ideal = ideal_bytes(numel, w.bits, group, 4, w.bits == 4)
        assert w.nbytes == ideal
        total += ideal
    return total


@pytest.mark.parametrize("quantization, bits", [("int8", 8), ("int4", 4)])
def test_device_bytes_are_those_of_the_codes_and_scales(tiny_checkpoints, quantization, bits) -> None:
    """Every matmul weight, the head and the table narrow; the device holds within 5 % of the ideal
    (codes at their width, one float32 scale per group, an offset for int4) plus the float norms."""
    source = open_source(resolve_checkpoint(str(tiny_checkpoints["llama3"])))
    mesh = make_mesh(1, 1)
    mapping = axis_mapping(source.spec, mesh)
    full = load_model(source, mesh, mapping)
    model = load_model(source, mesh, mapping, quantization=quantization)
    narrow = _narrow_weights(model)
    # qkv, o, gate_up, down per layer; the table, and the head unless tied
    assert len(narrow) == 4 * source.spec.num_layers + (1 if source.spec.tie_word_embeddings else 2)
    ideal = _ideal(model, bits)
    assert _bytes(model) <= 1.05 * ideal
    print(f"{quantization}: {_bytes(model)} bytes on device, {_bytes(full)} in float32, ideal {ideal}")


def test_bundled_gguf_keeps_its_blocks_as_stored() -> None:
    """SmolLM2's Q4_1 matrices stay 4-bit with the file's float16 scales and offsets, its Q8_0 table
    8-bit: the device holds what the file holds (within 5 %), about 1/5.6 of float32."""
    source = open_source(resolve_checkpoint(None))
    assert isinstance(source, GGUFSource)
    mesh = make_mesh(1, 1)
    mapping = axis_mapping(source.spec, mesh)
    model = load_model(source, mesh, mapping, quantization="int4")
    layer = model.layers[0]
    assert isinstance(layer.gate_up_proj, NarrowWeight) and layer.gate_up_proj.bits == 4
    assert layer.gate_up_proj.scale.array.dtype == np.float16 and layer.gate_up_proj.codes.array.dtype == np.uint8
    assert isinstance(model.embed, NarrowWeight) and model.embed.bits == 8  # Q8_0 stays 8-bit under int4
    file_bytes = sum(t.data.nbytes for t in source._file.tensors.values())
    assert _bytes(model) <= 1.05 * file_bytes, (_bytes(model), file_bytes)
    # The codes and scales are the file's: widened, they equal gguf's own dequantization.
    w = layer.down_proj.dequantize()
    want = source.read("model.layers.0.mlp.down_proj.weight").T
    np.testing.assert_array_equal(np.asarray(w.array), want)


@pytest.mark.parametrize("qtype", sorted(KEPT_LAYOUTS))
def test_kept_layouts_are_what_the_blocks_repack_to(qtype: int) -> None:
    """The layouts known from the header (for abstract loading) are those the blocks have."""
    data = random_tensor(qtype, (4, 512))  # type: ignore[arg-type]
    blocks = read_blocks(data, qtype, (4, 512))
    assert blocks is not None and blocks_layout(blocks) == KEPT_LAYOUTS[qtype]


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_abstract_loading_gives_the_real_shapes(quantization: str, tiny_checkpoints) -> None:
    """The steps are built early from abstract weights: their shapes, dtypes and shardings must be
    the real ones, or warmup would compile again (GGUF blocks and float checkpoints)."""
    for checkpoint in (None, str(tiny_checkpoints["llama3"])):
        source = open_source(resolve_checkpoint(checkpoint))
        mesh = make_mesh(1, 1)
        mapping = axis_mapping(source.spec, mesh)
        real = load_model(source, mesh, mapping, quantization=quantization)
        abstract = load_model(source, mesh, mapping, quantization=quantization, abstract=True)
        assert jax.tree.structure(real) == jax.tree.structure(abstract)
        for r, a in zip(jax.tree.leaves(real), jax.tree.leaves(abstract), strict=True):
            assert (r.shape, r.dtype, r.sharding) == (a.shape, a.dtype, a.sharding)


def test_auto_is_float_on_cpu_and_the_files_blocks_elsewhere(tiny_checkpoints) -> None:
    gguf = open_source(resolve_checkpoint(None))
    hf = open_source(resolve_checkpoint(str(tiny_checkpoints["llama3"])))
    assert resolve_quantization("auto", gguf, "cpu") == "none"
    assert resolve_quantization("auto", gguf, "gpu") == "int4"
    assert resolve_quantization("auto", gguf, "tpu") == "int4"
    assert resolve_quantization("auto", hf, "gpu") == "none"
    assert resolve_quantization("int8", hf, "cpu") == "int8"


def test_one_billion_shaped_model_bytes() -> None:
    """Weights of a Llama-3.2-1B-shaped model, from shapes alone (abstract): int8 about 1/4 and
    int4 about 1/8 of float32 plus scales (the figures docs/performance.md reports)."""
    cfg = dict(model_type="llama", **SHAPES["llama-3.2-1b"])
    source = SimpleNamespace(spec=spec_from_hf_config(cfg, "1b"), has=lambda name: False)
    mesh = make_mesh(1, 1)
    mapping = axis_mapping(source.spec, mesh)
    models = {q: load_model(source, mesh, mapping, quantization=q, abstract=True) for q in ("none", "int8", "int4")}  # type: ignore[arg-type]
    sizes = {q: _bytes(m) for q, m in models.items()}
    print({q: f"{b / 2**20:.0f} MiB ({b / sizes['none']:.4f} of float32)" for q, b in sizes.items()})
    # int8: 1/4 + a scale per 128. int4: 1/8 + a scale and offset per 128 for the layers, the
    # 128256 x 2048 table (a fifth of the parameters) int8.
    assert 0.25 <= sizes["int8"] / sizes["none"] <= 0.25 * 1.05
    for q, bits in (("int8", 8), ("int4", 4)):
        assert sizes[q] <= 1.05 * _ideal(models[q], bits)


def test_the_quantization_flag(capsys) -> None:
    from myserve.entrypoints import serve

    assert serve.config_from_args(serve.parse_args([])).model.quantization == "auto"
    assert serve.config_from_args(serve.parse_args(["--quantization", "int4"])).model.quantization == "int4"
    assert serve.config_from_args(serve.parse_args(["-q", "w8a8"])).model.quantization == "w8a8"
    with pytest.raises(SystemExit) as e:
        serve.parse_args(["--quantization", "int3"])
    assert e.value.code == 2 and "invalid choice: 'int3'" in capsys.readouterr().err


def test_the_group_size_of_weights_quantized_at_load(tiny_checkpoints) -> None:
    from myserve.config import load_config
    from myserve.errors import ConfigError

    source = open_source(resolve_checkpoint(str(tiny_checkpoints["llama3"])))
    mesh = make_mesh(1, 1)
    mapping = axis_mapping(source.spec, mesh)
    for bits, group, groups in (("int8", 0, 1), ("int8", 32, 2), ("int4", 128, 1), ("int4", 16, 4)):
        model = load_model(source, mesh, mapping, quantization=bits, group_size=group)
        down = model.layers[0].down_proj  # K = intermediate 128: the default 128 is one group
        qkv = model.layers[0].qkv_proj  # K = hidden 64
        assert isinstance(qkv, NarrowWeight) and isinstance(down, NarrowWeight)
        assert qkv.scale.array.shape[0] == groups, (bits, group)
        assert down.scale.array.shape[0] == 128 // (group or 128)
    assert load_config(None, []).model.quantization_group_size == 128
    assert load_config(None, ["model.quantization_group_size=32"]).model.quantization_group_size == 32
    with pytest.raises(ConfigError, match="quantization_group_size 3"):
        load_config(None, ["model.quantization_group_size=3"])
