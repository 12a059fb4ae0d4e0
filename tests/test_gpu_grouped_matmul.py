"""The GPU grouped matmul kernel (``ops/gpu_grouped_matmul.py``) behind ``engine.moe_backend=pallas``,
run on CPU by Pallas's interpreter: narrow experts (int8 per channel, int4 with offsets, GGUF-sized
groups) against the loop that widens them first, its tiles, that it lowers to Triton calls for CUDA
that take the codes as stored, and a served MoE model against transformers. (Float experts: every
implementation in ``tests/test_moe_ops.py``.) Compiling the Triton code and its speed need a GPU."""

from __future__ import annotations

import dataclasses

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ragged_steps import cuda_target

from myserve.errors import ConfigError
from myserve.models.narrow import NarrowWeight
from myserve.ops import gpu_grouped_matmul, moe
from myserve.ops.dequant import StackedNarrow
from myserve.ops.moe import expert_mlp, resolve_moe_backend, route
from myserve.testing import collect
from myserve.wire.params import SamplingParams


def _narrow(rng: np.random.RandomState, e: int, k: int, out: tuple[int, ...], bits: int, group: int) -> StackedNarrow:
    """Random narrow experts [E, K, *out] in ``ops/dequant.py``'s layout (int4: with offsets)."""
    if bits == 4:
        codes = rng.randint(0, 256, size=(e, k // group, group // 2, *out)).astype(np.uint8)
        offset = jnp.asarray(rng.randn(e, k // group, *out) * 0.05, jnp.float32)
    else:
        codes, offset = rng.randint(-127, 128, size=(e, k // group, group, *out)).astype(np.int8), None
    scale = jnp.asarray(rng.rand(e, k // group, *out) * 0.01, jnp.float32)
    return StackedNarrow(jnp.asarray(codes), scale, offset, bits, len(out), jnp.float32)


@pytest.mark.parametrize(("bits", "group"), [(8, 0), (4, 32), (8, 16)])
@pytest.mark.parametrize("t", [1, 6, 40])
def test_narrow_experts_equal_the_loop(bits: int, group: int, t: int) -> None:
    """Narrow experts widened in the kernel give the loop's numbers (which widens each expert whole
    first), for one decode token, a few tokens and a prefill's worth, and on an expert shard."""
    rng = np.random.RandomState(t + bits)
    e, h, i = 8, 64, 32
    gate_up = _narrow(rng, e, h, (2, i), bits, group or h)
    down = _narrow(rng, e, i, (h,), bits, group or i)
    x = jnp.asarray(rng.randn(t, h), jnp.float32)
    logits = rng.randn(t, e)
    logits[0, [1, 6]] += 10.0  # the first token reaches both shards
    weights, ids = route(jnp.asarray(logits, jnp.float32), 2, True)
    for first, stack in ((0, (gate_up, down)), (4, tuple(_shard(w, 4) for w in (gate_up, down)))):
        want = expert_mlp(x, ids, weights, *stack, jax.nn.silu, first_expert=first, impl="loop")
        got = expert_mlp(x, ids, weights, *stack, jax.nn.silu, first_expert=first, impl="pallas")
        top = float(np.abs(np.asarray(want)).max())
        assert top > 1e-3  # something routed here
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5 * top, rtol=1e-5)


def _shard(w: StackedNarrow, first: int) -> StackedNarrow:
    """Experts ``first`` onwards: one device's shard."""
    offset = None if w.offset is None else w.offset[first:]
    return StackedNarrow(w.codes[first:], w.scale[first:], offset, w.bits, w.n_out, w.dtype)


def test_tiles_cover_each_group_in_blocks() -> None:
    """Groups of 3, 0, 20 and 1 rows in tiles of 16: one, none, two and one tile; the tiles past
    them start at the spare rows and hold nothing."""
    group, first, valid = gpu_grouped_matmul.tiles_of(jnp.asarray([3, 0, 20, 1]), 6, 16, 24)
    assert np.asarray(group).tolist()[:4] == [0, 2, 2, 3]
    assert np.asarray(first).tolist() == [0, 3, 19, 23, 24, 24]
    assert np.asarray(valid).tolist() == [3, 16, 4, 1, 0, 0]


def test_it_lowers_to_triton_calls_reading_the_codes_as_stored(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exported for CUDA (no GPU needed to lower): int4 experts in bfloat16 are two Triton calls
    (the gate/up and the down matmul), and the packed codes reach them only reshaped: nothing
    widens them outside the kernel."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # not the interpreter: Triton
    rng = np.random.RandomState(0)
    e, h, i, t = 8, 128, 64, 16
    gate_up, down = _narrow(rng, e, h, (2, i), 4, 32), _narrow(rng, e, i, (h,), 4, 32)
    gate_up, down = (StackedNarrow(w.codes, w.scale, w.offset, 4, w.n_out, jnp.bfloat16) for w in (gate_up, down))
    x = jnp.asarray(rng.randn(t, h), jnp.bfloat16)
    weights, ids = route(jnp.asarray(rng.randn(t, e), jnp.float32), 2, True)
    step = jax.jit(lambda x, ids, w, gu, dn: expert_mlp(x, ids, w, gu, dn, jax.nn.silu, impl="pallas"))
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    with cuda_target():
        text = jax.export.export(step, platforms=["cuda"], disabled_checks=[triton])(
            x, ids, weights, gate_up, down
        ).mlir_module()
    assert sum("custom_call @__gpu$xla.gpu.triton" in line for line in text.splitlines()) == 2
    codes = [line for line in text.splitlines() if "xui8>" in line and "=" in line and "func" not in line]
    assert codes and all(
        op in ("stablehlo.reshape", "stablehlo.custom_call") for op in (ln.split("=", 1)[1].split()[0] for ln in codes)
    ), codes


def test_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` per platform: the loop on CPU, this kernel on a GPU (the measured winner), ragged_dot
    on TPU; every implementation stays selectable by name."""
    assert resolve_moe_backend("auto") == "loop" and resolve_moe_backend("ragged_dot") == "ragged_dot"
    with pytest.raises(ConfigError, match="'pallas' needs a GPU"):
        resolve_moe_backend("pallas")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve_moe_backend("pallas") == "pallas" and resolve_moe_backend("auto") == "pallas"
    assert resolve_moe_backend("loop") == "loop" and resolve_moe_backend("ragged_dot") == "ragged_dot"
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert resolve_moe_backend("auto") == "ragged_dot"


def test_a_moe_model_served_on_the_kernel_matches_transformers(tiny_checkpoints, monkeypatch) -> None:
    """Qwen3-MoE with its experts on the kernel (interpreted): 32 greedy tokens equal transformers'
    under chunked prefill, preemption and prefix caching."""
    from served_parity import check_served_greedy

    monkeypatch.setattr("myserve.models.loading.resolve_moe_backend", lambda choice: "pallas")
    calls = []
    real = moe._expert_kernel
    monkeypatch.setattr(moe, "_expert_kernel", lambda *a: calls.append(1) or real(*a))
    # No step cache: its entries (keyed by the source, not by this test's patch) would skip the trace.
    check_served_greedy(tiny_checkpoints["qwen3_moe"], "engine.compilation_cache_dir=null")
    assert calls  # the kernel's path was traced


def _on_the_kernel(model):  # noqa: ANN001, ANN202
    """``model`` with every dense narrow weight marked for the kernel."""
    return jax.tree_util.tree_map(
        lambda w: dataclasses.replace(w, kernel=True) if isinstance(w, NarrowWeight) and not w.n_lead else w,
        model,
        is_leaf=lambda w: isinstance(w, NarrowWeight),
    )


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_dense_narrow_weights_on_the_kernel_give_the_dequantized_logits(
    quantization: str, tiny_checkpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny Llama with int8 / int4 weights (every projection, the MLP and the head) through the
    served step, a prefill chunk, two decode tokens and another chunk: the kernel's logits equal
    those of the weights dequantized by XLA."""
    from ragged_steps import chunked_logits

    from myserve.models.checkpoint import resolve_checkpoint
    from myserve.models.loading import load_model, open_source
    from myserve.models.sharding import axis_mapping
    from myserve.runtime.kv_cache import init_kv_cache
    from myserve.runtime.mesh import make_mesh
    from myserve.runtime.model_step import StepLogits

    source = open_source(resolve_checkpoint(tiny_checkpoints["llama3"]))
    mesh = make_mesh(1, 1)
    mapping = axis_mapping(source.spec, mesh)
    model = load_model(source, mesh, mapping, quantization=quantization)
    calls: list[int] = []
    real = gpu_grouped_matmul.dense_matmul
    monkeypatch.setattr(gpu_grouped_matmul, "dense_matmul", lambda *a: calls.append(1) or real(*a))
    ids = [int(t) for t in np.random.RandomState(3).randint(0, 256, size=45)]
    out = []
    for m in (model, _on_the_kernel(model)):
        cache = init_kv_cache(m.spec, 4, 16, jnp.float32, mesh, mapping)
        logits, _ = chunked_logits(StepLogits.of(m, mesh, mapping, 16), cache, ids, [3, 0, 2, 1], [20, 1, 1, 23])
        out.append(logits)
    assert calls  # the kernel's path was traced
    top = float(np.abs(out[0]).max())
    assert top > 1.0
    np.testing.assert_allclose(out[1], out[0], atol=1e-5 * top, rtol=0)


def test_a_dense_narrow_matmul_lowers_to_one_triton_call_reading_the_codes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exported for CUDA: an int4 projection in bfloat16 ([16 tokens, 256] x [256, 384]) is one Triton
    call, the packed codes reaching it only reshaped."""
    from haliax import Axis

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    rng = np.random.RandomState(1)
    embed, out, pos = Axis("embed", 256), Axis("mlp", 384), Axis("position", 16)
    stack = _narrow(rng, 1, embed.size, (out.size,), 4, 128)
    codes = hax.named(stack.codes[0], (Axis("embed", 2), Axis("group", 64), out))
    scale = hax.named(stack.scale[0], (Axis("embed", 2), out))
    offset = hax.named(stack.offset[0], (Axis("embed", 2), out))  # type: ignore[index]
    weight = NarrowWeight(codes, scale, offset, 4, (embed,), 0, jnp.dtype(jnp.bfloat16), kernel=True)
    x = hax.named(jnp.asarray(rng.randn(16, 256), jnp.bfloat16), (pos, embed))
    step = jax.jit(lambda x, w: w.matmul(x, embed).array)
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    with cuda_target():
        text = jax.export.export(step, platforms=["cuda"], disabled_checks=[triton])(x, weight).mlir_module()
    assert sum("custom_call @__gpu$xla.gpu.triton" in line for line in text.splitlines()) == 1
    lines = [ln.strip() for ln in text.splitlines()]
    codes_ops = [ln.split("=", 1)[1].split()[0] for ln in lines if "xui8>" in ln and ln.startswith("%")]
    assert codes_ops and set(codes_ops) <= {"stablehlo.reshape", "stablehlo.custom_call"}, codes_ops


def test_quantized_matmul_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not gpu_grouped_matmul.resolve_quantized_matmul("auto", 1)
    with pytest.raises(ConfigError, match="'pallas' needs a GPU"):
        gpu_grouped_matmul.resolve_quantized_matmul("pallas", 1)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert gpu_grouped_matmul.resolve_quantized_matmul("pallas", 1)
    assert not gpu_grouped_matmul.resolve_quantized_matmul("xla", 1)
    with pytest.raises(ConfigError, match="one device per replica, not 2"):
        gpu_grouped_matmul.resolve_quantized_matmul("pallas", 2)


def test_an_int4_engine_on_the_kernel_serves_the_tokens_of_xlas(make_service, monkeypatch) -> None:
    """``engine.quantized_matmul=pallas`` through a whole deployment (its steps built early from
    abstract weights, then the real ones): the int4 tiny Llama's greedy tokens equal those of the
    same weights dequantized by XLA, and warmup compiled everything the requests ran."""
    from myserve.runtime.compile_counter import compile_count

    monkeypatch.setattr("myserve.models.loading.resolve_quantized_matmul", lambda choice, devices: choice == "pallas")
    rng = np.random.RandomState(11)
    prompts = [[int(t) for t in rng.randint(3, 256, size=n)] for n in (5, 70, 18)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = []
    for choice in ("xla", "pallas"):
        svc = make_service("model.quantization=int4", f"engine.quantized_matmul={choice}")
        kernel = svc.replicas[0].runner.device.model.layers[0].down_proj.kernel
        assert kernel == (choice == "pallas")
        # (the decode calls build in the background after ready: what the requests compile is asked)
        assert svc.replicas[0].runner.device.background_builds_done(600)
        warm = compile_count()
        tokens.append([collect(svc.submit(p, params))[0] for p in prompts])
        assert compile_count() == warm
    assert tokens[0] == tokens[1] and all(len(t) == 12 for t in tokens[1])
