"""Run in a subprocess with 2 fake CPU devices: load a model from an Orbax or Levanter checkpoint
and from the safetensors of the same weights on a mesh of ``MODEL`` devices along the model axis,
and print (as JSON) whether every array is equal, with the same sharding.

Usage: python tests/native_worker.py HF_DIR NATIVE_DIR MODEL
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

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
    print(json.dumps({"same": same, "arrays": len(leaves[1]), "split": split}))


if __name__ == "__main__":
    main()
