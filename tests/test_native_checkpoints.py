"""Checkpoints from JAX trainers (``models/native_checkpoint.py``): Orbax pytrees keyed by HF names
(flat, or nested under ``params``), Levanter's layout (layers stacked, or one directory each) and
MaxText's Llama tree (layers scanned on axis 1 or 0, or one subtree each; q/k RoPE-interleaved for
Llama 3.1's scaling, else not), written here from tiny random Llama, Mistral, Qwen3 and Qwen3-MoE
models with the writers those trainers use (``tests/native_writers.py``). Every tensor reads back
exactly; loaded on 1 device and on a tensor-parallel mesh of 2 fake devices the model is the
safetensors one array for array; served, greedy tokens equal the safetensors server's;
``--checkpoint-path``/``--hf-config`` configure it; a Levanter checkpoint (no config.json beside it)
is a live weight update; a MaxText tree configured as another model is refused in one line."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from native_writers import hf_tensors, write_levanter, write_maxtext, write_orbax

from myserve.entrypoints import serve
from myserve.errors import CheckpointError
from myserve.models.checkpoint import hf_spec
from myserve.models.loading import SafetensorsSource
from myserve.models.native_checkpoint import NativeSource, is_native_checkpoint
from myserve.models.placer import read_part
from myserve.testing import TINY_ENGINE, collect, make_tiny_checkpoint, start_service
from myserve.wire.params import SamplingParams

LAYOUTS = {
    "orbax": lambda hf, out: write_orbax(hf, out),
    "orbax-params": lambda hf, out: write_orbax(hf, out, nested_under="params", config=False),
    "levanter-stacked": lambda hf, out: write_levanter(hf, out),
    "levanter-blocks": lambda hf, out: write_levanter(hf, out, stacked=False),
    "maxtext": lambda hf, out: write_maxtext(hf, out),
    "maxtext-unscanned": lambda hf, out: write_maxtext(hf, out, scan_axis=None),
    "maxtext-axis0": lambda hf, out: write_maxtext(hf, out, scan_axis=0),
}
CASES = [
    ("llama3", "orbax"),
    ("llama3", "levanter-stacked"),
    ("llama3", "levanter-blocks"),
    ("qwen3", "orbax-params"),
    ("qwen3", "levanter-stacked"),
    ("qwen3_moe", "orbax"),
    ("mixtral", "levanter-stacked"),  # Levanter's MoE: MoELinear experts [layers, experts, in, out]
    ("mixtral", "levanter-blocks"),
    ("llama3", "maxtext"),  # interleaved q/k (Llama 3.1 RoPE scaling), with an optimizer moment
    ("llama_tied", "maxtext-unscanned"),  # no logits_dense (tied), RoPE halves as in HF
    ("mistral", "maxtext-axis0"),
]
PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11], [200, 201, 3, 4, 77, 1, 90, 45, 33, 12, 9]]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(arch, layout) -> (HF directory, native checkpoint directory)."""
    root = tmp_path_factory.mktemp("native")
    hf = {arch: make_tiny_checkpoint(arch, root / arch) for arch in {a for a, _ in CASES}}
    return {(arch, layout): (hf[arch], LAYOUTS[layout](hf[arch], root / f"{arch}-{layout}")) for arch, layout in CASES}


@pytest.mark.parametrize(("arch", "layout"), CASES, ids=[f"{a}-{lay}" for a, lay in CASES])
def test_every_tensor_reads_back_exactly(made, arch: str, layout: str) -> None:
    hf, native = made[(arch, layout)]
    assert is_native_checkpoint(native) and not is_native_checkpoint(hf)
    source = NativeSource(native, hf_spec(hf))
    assert source.kind == layout.split("-")[0]
    tensors = hf_tensors(hf)
    for name, tensor in tensors.items():
        assert source.has(name), name
        got = source.read(name)
        assert got.dtype == tensor.dtype and np.array_equal(got, tensor), name
    assert source.num_parameters == sum(t.size for t in tensors.values())
    assert not source.has("model.layers.99.mlp.up_proj.weight")
    with pytest.raises(CheckpointError, match="no tensor"):
        source.read("model.layers.99.mlp.up_proj.weight")


@pytest.mark.parametrize(("arch", "layout"), CASES, ids=[f"{a}-{lay}" for a, lay in CASES])
def test_a_part_of_a_tensor_reads_as_the_same_part_of_the_whole(made, arch: str, layout: str) -> None:
    """``read_slice`` (a multi-host load's reads of its own shards) gives ``read(name)[index]``, for
    parts that are whole KV heads or MLP columns and for ones that are not (read whole, then cut)."""
    hf, native = made[(arch, layout)]
    sources = [NativeSource(native, hf_spec(hf)), SafetensorsSource(hf)]
    head = sources[0].spec.head_dim
    names = ["model.layers.1.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"]
    names += ["model.embed_tokens.weight", "model.layers.1.input_layernorm.weight"]
    names += [n for n in hf_tensors(hf) if n.startswith("model.layers.1.") and ".experts.3." in n]
    for source in sources:
        for name in names:
            whole = source.read(name)
            for index in [
                (slice(head, 2 * head),),  # one head's rows
                (slice(3, 17),),  # not whole heads
                (slice(None), slice(head, min(3 * head, whole.shape[-1]))) if whole.ndim == 2 else (slice(2, 5),),
            ]:
                part = read_part(source, name, index)
                assert part.dtype == whole.dtype and np.array_equal(part, whole[index]), (name, index)


TP_CASES = [
    ("llama3", "levanter-stacked"),
    ("qwen3", "orbax-params"),
    ("qwen3_moe", "orbax"),
    ("mixtral", "levanter-stacked"),
]


@pytest.mark.parametrize(("arch", "layout"), TP_CASES, ids=[a for a, _ in TP_CASES])
def test_loaded_on_one_and_two_devices_it_is_the_safetensors_model(made, arch: str, layout: str) -> None:
    """Every array equal, with the same sharding, on 1 and 2 (fake) devices; the MoE is also served
    on TP 2 from both (the same greedy tokens)."""
    hf, native = made[(arch, layout)]
    worker = Path(__file__).with_name("native_worker.py")
    for model in (1, 2):
        serve = ["serve"] if model == 2 and arch == "mixtral" else []
        out = subprocess.run(
            [sys.executable, str(worker), str(hf), str(native), str(model), *serve],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["same"] and result["arrays"] > 0, result
        assert (result["split"] > 0) == (model == 2), result  # TP 2 shards some arrays over both devices
        if serve:
            plain, native_tokens = result["tokens"]
            assert native_tokens == plain and all(len(t) == 8 for t in plain), result


def test_served_from_orbax_levanter_and_maxtext_gives_the_safetensors_tokens(made, tmp_path) -> None:
    hf, orbax = made[("llama3", "orbax")]
    _, levanter = made[("llama3", "levanter-stacked")]
    _, maxtext = made[("llama3", "maxtext")]
    plain = start_service(hf, *TINY_ENGINE, "engine.num_pages=64", "engine.enable_weight_updates=true")
    try:
        want = [collect(plain.submit(p, GREEDY))[0] for p in PROMPTS]
        for overrides in (
            [f"model.checkpoint_path={orbax}"],  # config.json beside the weights
            [f"model.checkpoint_path={levanter}", f"model.hf_config={hf}"],  # named apart
            [f"model.checkpoint_path={maxtext}", f"model.hf_config={hf}"],  # a MaxText step directory
        ):
            native = start_service(None, *TINY_ENGINE, "engine.num_pages=64", *overrides, *_tokenizer())
            try:
                assert [collect(native.submit(p, GREEDY))[0] for p in PROMPTS] == want, overrides
            finally:
                native.shutdown()
        # A live update from safetensors of other weights, then back from the Levanter checkpoint
        # (no config.json beside it: the served model's configuration).
        other = make_tiny_checkpoint("llama3", tmp_path / "other", seed=5)
        assert asyncio.run(plain.update_weights(str(other), "other", "finish"))[0] is None
        assert [collect(plain.submit(p, GREEDY))[0] for p in PROMPTS] != want
        error, info = asyncio.run(plain.update_weights(str(levanter), "levanter", "finish"))
        assert error is None and info["version"] == "levanter"
        assert [collect(plain.submit(p, GREEDY))[0] for p in PROMPTS] == want
    finally:
        plain.shutdown()


def _tokenizer() -> list[str]:
    from myserve.bundled import bundled_gguf_path

    return ["model.dtype=float32", f"model.tokenizer={bundled_gguf_path()}"]


def test_checkpoint_path_and_hf_config_flags(tmp_path) -> None:
    def config_of(*argv: str):
        return serve.config_from_args(serve.parse_args(list(argv)))

    config = config_of("--checkpoint-path", "/ckpt/step-100")
    assert config.model.checkpoint_path == "/ckpt/step-100" and config.model.checkpoint == "/ckpt/step-100"
    config = config_of("--checkpoint-path", "/ckpt/step-100", "--hf-config", "/hf/llama/config.json")
    assert config.model.checkpoint == "/hf/llama" and config.model.hf_config == "/hf/llama"
    config = config_of("org/llama", "--checkpoint-path", "/ckpt/step-100")
    assert config.model.checkpoint == "org/llama"  # the configuration and tokenizer of the HF checkpoint
    from myserve.errors import ConfigError

    with pytest.raises(ConfigError, match="hf_config needs model.checkpoint_path"):
        config_of("--hf-config", "/hf/llama")
    with pytest.raises(CheckpointError, match="neither an Orbax nor a Levanter checkpoint"):
        NativeSource(tmp_path, hf_spec(make_tiny_checkpoint("llama3", tmp_path / "hf")))


def test_maxtext_tree_of_another_architecture_or_shape_is_refused(made) -> None:
    _, maxtext = made[("llama3", "maxtext")]
    with pytest.raises(CheckpointError, match="MaxText parameter tree is read for llama/mistral models, not qwen3"):
        NativeSource(maxtext, hf_spec(made[("qwen3", "orbax-params")][0]))
    source = NativeSource(maxtext, hf_spec(made[("llama_tied", "maxtext-unscanned")][0]))  # 4 KV heads, not 2
    with pytest.raises(CheckpointError, match=r"k_proj.weight's MaxText array has shape \[64, 2, 16\], not \[64, 4"):
        source.read("model.layers.0.self_attn.k_proj.weight")
