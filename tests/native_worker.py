"""Run in a subprocess with 2 fake CPU devices: load a model from an Orbax or Levanter checkpoint
and from the safetensors of the same weights on a mesh of ``MODEL`` devices along the model axis,
and print (as JSON) whether every array is equal, with the same sharding; with ``serve``, also the
greedy tokens of an engine on that mesh serving each (``tokens``: [safetensors', native's]).

Usage: python tests/native_worker.py HF_DIR NATIVE_DIR MODEL [serve]
"""

from __future__ import annotations

import json
import sys

from fake_devices import use_fake_cpu_devices

use_fake_cpu_devices(2)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from myserve.models.checkpoint import resolve_checkpoint  # noqa: E402
from myserve.models.loading import load_model, open_source  # noqa: E402
from myserve.models.sharding import axis_mapping  # noqa: E402
from myserve.runtime.mesh import make_mesh  # noqa: E402


def main() -> None:
    hf, native, model = sys.argv[1], sys.argv[2], int(sys.argv[3])
    mesh = make_mesh(1, model)
    resolved = resolve_checkpoint(hf)
    sources = [open_source(resolved), open_source(resolved, native)]
    mapping = axis_mapping(sources[0].spec, mesh)
    models = [load_model(s, mesh, mapping) for s in sources]
    leaves = [jax.tree_util.tree_leaves(m) for m in models]
    same = all(
        a.sharding == b.sharding and np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(*leaves, strict=True)
    )
    split = sum(len(a.sharding.device_set) > 1 and not a.sharding.is_fully_replicated for a in leaves[1])
    result: dict[str, object] = {"same": same, "arrays": len(leaves[1]), "split": split}
    if sys.argv[4:] == ["serve"]:
        result["tokens"] = [served(hf, None, model), served(hf, native, model)]
    print(json.dumps(result))


def served(hf: str, native: str | None, model: int) -> list[list[int]]:
    """Greedy tokens of two prompts from an engine on a (1, model) mesh serving ``native``'s weights
    (with ``hf``'s configuration), or ``hf``'s safetensors."""
    from myserve.bundled import bundled_gguf_path
    from myserve.testing import TINY_ENGINE, collect, start_service
    from myserve.wire.params import SamplingParams

    weights = [f"model.checkpoint_path={native}", f"model.hf_config={hf}"] if native else [f"model.checkpoint={hf}"]
    weights.append(f"model.tokenizer={bundled_gguf_path()}")
    service = start_service(None, *TINY_ENGINE, "engine.num_pages=64", f"mesh.model={model}", *weights)
    try:
        greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        return [collect(service.submit(p, greedy))[0] for p in ([5, 17, 42, 99, 7, 3], [200, 201, 3, 4, 77, 1, 90])]
    finally:
        service.shutdown()


if __name__ == "__main__":
    main()
