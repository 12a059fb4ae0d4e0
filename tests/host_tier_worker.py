"""Run in a subprocess with 4 fake CPU devices: a multi-turn workload through a GenerationService
with and without the host tier of the prefix cache, on each mesh, printed as JSON.

Usage: python tests/host_tier_worker.py CHECKPOINT MESH [MESH ...]  (MESH: "1x2" = data x model)

With ``KERNEL_CONTRACT=1`` the engines take the TPU kernel's cache layout (pages on axis 1, K and V
interleaved per head), with ``kernel_contract.py`` standing in for the kernel.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from fake_devices import use_fake_cpu_devices

use_fake_cpu_devices(4)

from myserve.testing import TINY_ENGINE, collect, start_service  # noqa: E402
from myserve.wire.params import SamplingParams  # noqa: E402

KERNEL = os.environ.get("KERNEL_CONTRACT") == "1"
if KERNEL:
    from kernel_contract import contract_attention

    from myserve.ops import tpu_attention
    from myserve.runtime import deployment

    tpu_attention._tpu_kernel = lambda: contract_attention  # type: ignore[assignment]
    deployment.resolve_backend = lambda *a, **k: "pallas"  # type: ignore[assignment]

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
ENGINE = (*TINY_ENGINE, "engine.num_pages=64", "engine.decode_steps=1")


def workload() -> list[list[int]]:
    """6 conversations of 4 turns on a shared 40-token system prompt, turn by turn (the pool of 64
    pages holds two thirds of their prefixes)."""
    import random

    rng = random.Random(3)
    head = [rng.randrange(3, 200) for _ in range(40)]
    convs = [list(head) for _ in range(6)]
    prompts = []
    for _ in range(4):
        for c in convs:
            c += [rng.randrange(3, 200) for _ in range(32)]
            prompts.append(list(c))
    return prompts


def run(checkpoint: Path, mesh: str, tier: bool) -> dict:
    data, model = (int(x) for x in mesh.split("x"))
    extra = ["engine.attention_backend=pallas"] if KERNEL else []
    if tier:
        extra.append("engine.kv_offloading_size=0.0002")
    service = start_service(checkpoint, *ENGINE, f"mesh.data={data}", f"mesh.model={model}", *extra)
    try:
        tokens = [collect(service.submit(p, GREEDY))[0] for p in workload()]
        stats = service.stats()
        return {
            "tokens": tokens,
            "host_hit_tokens": stats.host_tier_hit_tokens,
            "layout": type(service.replicas[0].runner.device.kv_cache).__name__,
        }
    finally:
        service.shutdown()


def main() -> None:
    checkpoint = Path(sys.argv[1])
    print(
        json.dumps(
            {mesh: {"off": run(checkpoint, mesh, False), "on": run(checkpoint, mesh, True)} for mesh in sys.argv[2:]}
        )
    )


if __name__ == "__main__":
    main()
