"""Run in a subprocess with 8 fake CPU devices: logits on several meshes, printed as JSON.

Usage: python tests/sharding_worker.py CHECKPOINT_OR_BUNDLED MESH [MESH ...]  (MESH: "1x2" = data x model)
"""

from __future__ import annotations

import json
import sys

from fake_devices import use_fake_cpu_devices

use_fake_cpu_devices(8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from ragged_steps import chunked_logits  # noqa: E402

from myserve.models.checkpoint import resolve_checkpoint  # noqa: E402
from myserve.models.loading import load_model, open_source  # noqa: E402
from myserve.models.sharding import axis_mapping  # noqa: E402
from myserve.runtime.kv_cache import init_kv_cache  # noqa: E402
from myserve.runtime.mesh import make_mesh  # noqa: E402
from myserve.runtime.model_step import StepLogits  # noqa: E402


def logits_on(source, data: int, model_size: int) -> tuple[np.ndarray, dict]:
    """Prefill 20 tokens in chunks of 8 then decode 4 through the served step, on a (data, model)
    mesh; all logits [24, V]."""
    mesh = make_mesh(data, model_size)
    mapping = axis_mapping(source.spec, mesh)
    model = load_model(source, mesh, mapping)
    cache = init_kv_cache(model.spec, 16, 4, jnp.float32, mesh, mapping)
    ids = [int(t) for t in np.random.RandomState(0).randint(0, min(256, model.spec.vocab_size), size=24)]
    pages = [9, 2, 14, 5, 0, 11]
    forward = StepLogits.of(model, mesh, mapping, 4)
    logits, cache = chunked_logits(forward, cache, ids, pages, [8, 8, 4, 1, 1, 1, 1])
    layout = {
        "mlp": str(model.layers[0].gate_up_proj.array.sharding.spec),
        "heads": str(model.layers[0].qkv_proj.array.sharding.spec),
        "vocab": str(model.embed.array.sharding.spec),
        "kv_cache": str(cache.k.sharding.spec),
        "devices": len(model.layers[0].gate_up_proj.array.sharding.device_set),
    }
    return logits, layout


def main() -> None:
    checkpoint = None if sys.argv[1] == "bundled" else sys.argv[1]
    source = open_source(resolve_checkpoint(checkpoint))
    base, _ = logits_on(source, 1, 1)
    result = {}
    for mesh in sys.argv[2:]:
        data, model_size = (int(x) for x in mesh.split("x"))
        logits, layout = logits_on(source, data, model_size)
        result[mesh] = {"max_abs_diff": float(np.abs(logits - base).max()), "layout": layout}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
