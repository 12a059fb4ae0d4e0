"""Run in a subprocess with 8 fake CPU devices: greedy tokens of a LoRA-serving engine on a mesh of
``MODEL`` devices along the model axis (tensor parallel), printed as JSON.

Usage: python tests/lora_worker.py BASE MODEL NAME=PATH [NAME=PATH ...]
"""

from __future__ import annotations

import json
import sys

from fake_devices import use_fake_cpu_devices

use_fake_cpu_devices(8)

from myserve.testing import TINY_ENGINE, collect, start_service  # noqa: E402
from myserve.wire.params import SamplingParams  # noqa: E402

PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11, 64, 8, 19], [200, 201, 3, 4, 77, 1, 90, 45, 33, 12, 9, 60, 13]]


def main() -> None:
    base, model, modules = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    listed = ",".join(f'"{m}"' for m in modules)
    svc = start_service(
        base,
        *TINY_ENGINE,
        "engine.num_pages=64",
        f"mesh.model={model}",
        "engine.enable_lora=true",
        "engine.max_loras=2",
        "engine.max_lora_rank=8",
        f"engine.lora_modules=[{listed}]",
    )
    try:
        names = [None, *(m.split("=", 1)[0] for m in modules)]
        streams = {
            str(name): [
                svc.submit(p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, adapter=name))
                for p in PROMPTS
            ]
            for name in names
        }
        tokens = {name: [collect(s)[0] for s in ss] for name, ss in streams.items()}
        executor = svc.replicas[0].runner.device
        lora = [executor.layers[0][j] for j in executor._lora_leaves]  # LoraLayer order: qkv_a, qkv_b, ...
        specs = {"qkv_b": str(lora[1].sharding.spec), "down_b": str(lora[7].sharding.spec)}
    finally:
        svc.shutdown()
    print(json.dumps({"tokens": tokens, "specs": specs}))


if __name__ == "__main__":
    main()
