"""Run in a subprocess with 8 fake CPU devices: greedy tokens of 8 concurrent requests through a
GenerationService on each mesh, printed as JSON.

Usage: python tests/mesh_worker.py CHECKPOINT_OR_BUNDLED MESH [MESH ...]  (MESH: "2x2" = data x model,
"1x2x2" = data x expert x model)

With ``KERNEL_CONTRACT=1`` in the environment the engines take the TPU kernel's path (its cache
layout, and ``shard_map`` over the model axis) with ``kernel_contract.py`` standing in for the kernel.
With ``GPU_KERNEL_INTERPRET=1`` they take the GPU decode kernel's path, the kernel itself run by
Pallas's interpreter.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading

from fake_devices import use_fake_cpu_devices

use_fake_cpu_devices(8)

import jax  # noqa: E402

from myserve.testing import start_service  # noqa: E402
from myserve.wire.params import SamplingParams  # noqa: E402

KERNEL = os.environ.get("KERNEL_CONTRACT") == "1"
if KERNEL:
    from kernel_contract import contract_attention

    from myserve.ops import tpu_attention
    from myserve.runtime import deployment

    tpu_attention._tpu_kernel = lambda: contract_attention  # type: ignore[assignment]
    deployment.resolve_backend = lambda *a, **k: "pallas"  # type: ignore[assignment]
GPU_KERNEL = os.environ.get("GPU_KERNEL_INTERPRET") == "1"
if GPU_KERNEL:
    import functools

    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    from myserve.ops import gpu_attention
    from myserve.runtime import deployment

    interpreted = functools.partial(paged_attention, interpret=True)
    gpu_attention._gpu_kernel = lambda: interpreted  # type: ignore[assignment]
    deployment.resolve_backend = lambda *a, **k: "pallas_gpu"  # type: ignore[assignment]
if os.environ.get("GPU_RAGGED_KERNEL") == "1":  # our kernel: interpreted on a CPU by itself
    from myserve.runtime import deployment

    deployment.resolve_backend = lambda *a, **k: "pallas_gpu_ragged"  # type: ignore[assignment]

# A small engine: few shapes to compile per mesh.
ENGINE = (
    "model.max_model_len=128",
    "engine.page_size=8",
    "engine.num_pages=128",
    "engine.max_num_seqs=8",
    "engine.max_num_batched_tokens=64",
    "engine.token_buckets=[8]",
    # One token per decode call: every request decodes in the steps that read the later prompts, so
    # the 8 share a decode step (at 8 tokens a call, a row whose prompt was read first can finish
    # before the last prompt is read). Still the decode call (``decode_loop``, one iteration) on
    # every mesh: its state must come back in the shardings it was built for.
    "engine.decode_steps=1",
)
PROMPTS = [[(7 * i + 3 * j) % 200 + 10 for j in range(3 + 5 * i)] for i in range(8)]


def decode_collectives(service) -> list[str]:
    """Collective ops (kind and shape) in the compiled step executable of an 8-token step."""
    runner = service.replicas[0].runner
    hlo = runner.device.lower_step(runner.buckets.shape(8)).compile().as_text()
    kinds = "all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter"
    return [f"{k} {shape}" for shape, k in re.findall(rf"= (\S+\[[^\]]*\])\S* ({kinds})[-a-z]*\(", hlo)]


def tokens_on(checkpoint: str | None, data: int, model: int, expert: int = 1) -> dict:
    from pathlib import Path

    from myserve.runtime.compile_counter import compile_count

    path = Path(checkpoint) if checkpoint else None
    extra = ["engine.attention_backend=pallas"] if KERNEL else []
    mesh = [f"mesh.data={data}", f"mesh.model={model}", f"mesh.expert={expert}"]
    service = start_service(path, *ENGINE, *mesh, *extra)
    try:
        # The decode calls build in the background after ready: the requests must compile nothing.
        assert all(r.runner.device.background_builds_done(600) for r in service.replicas)
        warm = compile_count()
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        outputs: list[list[int]] = [[] for _ in PROMPTS]
        streams = [service.submit(p, params) for p in PROMPTS]  # all queued before any finishes

        def drain(i: int) -> None:
            for out in streams[i]:
                outputs[i].extend(out.token_ids)

        threads = [threading.Thread(target=drain, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = service.stats()
        executor = service.replicas[0].runner.device
        cache = jax.tree.leaves(executor.kv_cache)[0]
        layer = executor.model.layers[0]
        return {
            "tokens": outputs,
            "layout": {  # the sharding specs of one layer's MLP and attention, and the vocabulary
                "mlp": None if layer.gate_up_proj is None else str(layer.gate_up_proj.array.sharding.spec),
                "heads": str(layer.qkv_proj.array.sharding.spec),
                "vocab": str(executor.model.embed.array.sharding.spec),
            },
            "max_decode_batch": stats.max_decode_batch,
            "compiles": stats.compile_count,
            "compiles_after_warmup": compile_count() - warm,
            "cache_layout": type(executor.kv_cache).__name__,
            "attention_backend": executor.model.attention_backend,
            "cache_spec": str(cache.sharding.spec),
            "cache_kept": cache.sharding.is_equivalent_to(executor.cache_sharding, 5),
            "decode_collectives": decode_collectives(service),
        }
    finally:
        service.shutdown()


def main() -> None:
    checkpoint = None if sys.argv[1] == "bundled" else sys.argv[1]
    result = {}
    for mesh in sys.argv[2:]:
        sizes = [int(x) for x in mesh.split("x")]
        data, expert, model = sizes if len(sizes) == 3 else (sizes[0], 1, sizes[1])
        result[mesh] = tokens_on(checkpoint, data, model, expert)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
