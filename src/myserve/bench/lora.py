"""``python -m myserve.bench.lora``: what serving LoRA adapters costs, engine level, in one process.

Three engines' worth of rounds, alternated so that machine noise hits them alike:

- ``base``: an engine without adapters, ``--concurrency`` greedy requests of the base model;
- ``lora-base``: an engine with ``--adapters`` slots (rank ``--rank``), the same requests of the
  base model (the low-rank path runs, masked to nothing);
- ``lora-mixed``: that engine, the requests spread round-robin over the adapters.

The adapters are random PEFT checkpoints of the served model's shapes (every projection), written
to a temporary directory. Tokens/s of each round, and the ratios of the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from myserve.bench.engine import add_pair_args, bench_myserve, builtin_chat_prompts, report, wait_built
from myserve.models.spec import ModelSpec

_SHAPES = {  # module -> (in, out) of ``spec``
    "self_attn.q_proj": lambda s: (s.hidden_size, s.num_heads * s.head_dim),
    "self_attn.k_proj": lambda s: (s.hidden_size, s.num_kv_heads * s.head_dim),
    "self_attn.v_proj": lambda s: (s.hidden_size, s.num_kv_heads * s.head_dim),
    "self_attn.o_proj": lambda s: (s.num_heads * s.head_dim, s.hidden_size),
    "mlp.gate_proj": lambda s: (s.hidden_size, s.intermediate_size),
    "mlp.up_proj": lambda s: (s.hidden_size, s.intermediate_size),
    "mlp.down_proj": lambda s: (s.intermediate_size, s.hidden_size),
}


def write_random_adapter(spec: ModelSpec, directory: Path, rank: int, seed: int) -> Path:
    """A PEFT LoRA checkpoint of random A and B for every projection of every layer."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(spec.num_layers):
        for module, shape in _SHAPES.items():
            n_in, n_out = shape(spec)
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, n_in)) / n_in**0.5).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((n_out, rank)) * 0.01).astype(np.float32)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "adapter_model.safetensors")
    targets = [m.split(".")[-1] for m in _SHAPES]
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets, "bias": "none"}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m myserve.bench.lora", description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    add_pair_args(parser)
    args = parser.parse_args(argv)

    from myserve.models.checkpoint import resolve_checkpoint
    from myserve.models.loading import open_source
    from myserve.testing import start_service
    from myserve.wire.params import SamplingParams

    spec = open_source(resolve_checkpoint(args.checkpoint)).spec
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"a{i}" for i in range(args.adapters)]
        modules = ",".join(
            f'"{n}={write_random_adapter(spec, Path(tmp) / n, args.rank, i)}"' for i, n in enumerate(names)
        )
        checkpoint = None if args.checkpoint is None else Path(args.checkpoint)
        plain = start_service(checkpoint, *args.set)
        lora = start_service(
            checkpoint,
            *args.set,
            "engine.enable_lora=true",
            f"engine.max_loras={args.adapters}",
            f"engine.max_lora_rank={args.rank}",
            f"engine.lora_modules=[{modules}]",
        )
        try:
            wait_built(plain, lora)
            prompts = builtin_chat_prompts(plain.tokenizer, args.concurrency)

            def mixed(i: int) -> SamplingParams:
                return SamplingParams(
                    max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, adapter=names[i % len(names)]
                )

            runs: dict[str, list[float]] = {"base": [], "lora-base": [], "lora-mixed": []}
            bench_myserve(plain, prompts[:2], 4)  # first requests pay one-off costs
            bench_myserve(lora, prompts[:2], 4, params=mixed)
            for _ in range(args.rounds):
                runs["base"].append(bench_myserve(plain, prompts, args.max_tokens)["tokens_per_s"])
                runs["lora-base"].append(bench_myserve(lora, prompts, args.max_tokens)["tokens_per_s"])
                runs["lora-mixed"].append(bench_myserve(lora, prompts, args.max_tokens, params=mixed)["tokens_per_s"])
        finally:
            plain.shutdown()
            lora.shutdown()
    medians = {k: statistics.median(v) for k, v in runs.items()}
    result = {
        "adapters": args.adapters,
        "rank": args.rank,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "tokens_per_s": runs,
        "median_tokens_per_s": medians,
        "lora_base_vs_base": medians["lora-base"] / medians["base"],
        "lora_mixed_vs_base": medians["lora-mixed"] / medians["base"],
    }
    report(result, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
