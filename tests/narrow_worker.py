"""Run in a subprocess with 8 fake CPU devices: a narrow (int8/int4) model's logits on several meshes
against a dequantize-then-float32 reference of the same weights on one device, as JSON.

Usage: python tests/narrow_worker.py CHECKPOINT QUANTIZATION MESH [MESH ...]
(MESH: "1x2" = data x model, "1x2x2" = data x expert x model)
"""

from __future__ import annotations

import json
import sys

from fake_devices import use_fake_cpu_devices

use_fake_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from ragged_steps import chunked_logits  # noqa: E402

from myserve.models.checkpoint import resolve_checkpoint  # noqa: E402
from myserve.models.llama import LlamaModel  # noqa: E402
from myserve.models.loading import load_model, open_source  # noqa: E402
from myserve.models.narrow import NarrowWeight  # noqa: E402
from myserve.models.sharding import axis_mapping  # noqa: E402
from myserve.runtime.kv_cache import init_kv_cache  # noqa: E402
from myserve.runtime.mesh import make_mesh  # noqa: E402
from myserve.runtime.model_step import StepLogits  # noqa: E402


def logits(model: LlamaModel, mesh, mapping) -> np.ndarray:  # noqa: ANN001
    """Prefill 20 tokens in chunks of 8 then decode 4 through the served step: logits [24, V]."""
    cache = init_kv_cache(model.spec, 16, 4, jnp.float32, mesh, mapping)
    ids = [int(t) for t in np.random.RandomState(0).randint(0, min(256, model.spec.vocab_size), size=24)]
    forward = StepLogits.of(model, mesh, mapping, 4)
    out, _ = chunked_logits(forward, cache, ids, [9, 2, 14, 5, 0, 11], [8, 8, 4, 1, 1, 1, 1])
    return out


def dequantized_on_one_device(model: LlamaModel) -> LlamaModel:
    """The same weights widened to float32 on the host, then placed on device 0: the reference."""
    device = jax.devices()[0]

    def widen(leaf):  # noqa: ANN001, ANN202
        if isinstance(leaf, NarrowWeight):
            leaf = leaf.dequantize(jnp.dtype(jnp.float32))
        return jax.tree.map(lambda a: jax.device_put(np.asarray(a), device), leaf)

    return jax.tree.map(widen, model, is_leaf=lambda x: isinstance(x, NarrowWeight))


def narrow_layout(model: LlamaModel) -> dict:
    """Where the narrow codes and scales of a few weights live."""
    layer = model.layers[0]
    weights = {"o_proj": layer.o_proj, "embed": model.embed}
    if layer.moe is not None:
        weights |= {"experts_gate_up": layer.moe.gate_up, "experts_down": layer.moe.down}
    else:
        weights |= {"down_proj": layer.down_proj, "gate_up_proj": layer.gate_up_proj}
    out = {}
    for name, w in weights.items():
        assert isinstance(w, NarrowWeight), (name, type(w))
        out[name] = {
            "codes": str(w.codes.array.sharding.spec),
            "scale": str(w.scale.array.sharding.spec),
            "devices": len(w.codes.array.sharding.device_set),
            "codes_dtype": str(w.codes.array.dtype),
        }
    return out


def main() -> None:
    checkpoint, quantization = sys.argv[1], sys.argv[2]
    source = open_source(resolve_checkpoint(checkpoint))
    one = make_mesh(1, 1)
    result = {}
    for mesh_name in sys.argv[3:]:
        sizes = [int(x) for x in mesh_name.split("x")]
        data, expert, model_size = sizes if len(sizes) == 3 else (sizes[0], 1, sizes[1])
        mesh = make_mesh(data, model_size, expert=expert)
        mapping = axis_mapping(source.spec, mesh)
        model = load_model(source, mesh, mapping, quantization=quantization)
        got = logits(model, mesh, mapping)
        want = logits(dequantized_on_one_device(model), one, axis_mapping(source.spec, one))
        result[mesh_name] = {
            "max_abs_diff": float(np.abs(got - want).max()),
            "max_abs_logit": float(np.abs(want).max()),
            "layout": narrow_layout(model),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
