"""``python -m myserve.generate``: greedy generation for one prompt through the served step.

A small command-line check that a deployment loads and generates; serving many requests at once is
the engine's job. With no arguments it runs the bundled SmolLM2 on CPU.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Mapping, Sequence

import numpy as np
from jax.sharding import Mesh

from myserve.config import load_config
from myserve.entrypoints.hub import fetch_checkpoints
from myserve.errors import MyserveError
from myserve.models.llama import LlamaModel
from myserve.models.sharding import MeshAxes
from myserve.runtime.buckets import BLOCK_TOKENS, CHUNK_TOKENS
from myserve.runtime.kv_cache import init_kv_cache
from myserve.runtime.model_step import StepLogits
from myserve.runtime.step_layout import Span, StepShape


def greedy_generate(
    model: LlamaModel,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    mesh: Mesh,
    mapping: Mapping[str, MeshAxes],
    eos_ids: Sequence[int] = (),
    page_size: int = 16,
    chunk_size: int = 64,
    page_ids: Sequence[int] | None = None,
) -> list[int]:
    """Greedy-decode ``max_new_tokens`` after ``prompt_ids`` (stopping early at an EOS id).

    The prompt is prefilled in chunks of ``chunk_size`` tokens, then one token per step is decoded,
    all through the serving engine's ragged step and paged KV cache (``runtime/model_step.py``).
    The sequence uses pages ``page_ids`` (default ``0..n-1``) of a fresh cache placed on ``mesh`` by
    ``mapping``.
    """
    spec = model.spec
    total = len(prompt_ids) + max_new_tokens
    num_pages = math.ceil(total / page_size)
    pages = list(page_ids) if page_ids is not None else list(range(num_pages))
    dtype = model.dtype
    cache = init_kv_cache(spec, max(pages) + 1, page_size, dtype, mesh, mapping, model.attention_backend)
    forward = StepLogits.of(model, mesh, mapping, page_size)
    # Two step shapes: a prefill chunk's and a decode token's (a shorter chunk is padded to the first).
    shapes = {
        t: StepShape.of(
            t,
            max_num_seqs=1,
            block_tokens=min(BLOCK_TOKENS, t),
            max_pages=len(pages),
            chunk_pages=max(1, CHUNK_TOKENS // page_size),
        )
        for t in (chunk_size, 1)
    }

    tokens = list(prompt_ids)
    out: list[int] = []
    computed = 0
    while len(out) < max_new_tokens:
        pending = tokens[computed:]
        t = chunk_size if len(pending) > 1 else 1
        step = pending[:t]
        logits, cache = forward(cache, [Span(step, computed, pages, samples=True)], shapes[t])
        computed += len(step)
        if computed < len(tokens):
            continue  # still prefilling
        next_id = int(np.argmax(logits[-1]))
        out.append(next_id)
        tokens.append(next_id)
        if next_id in eos_ids:
            break
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the process exit code."""
    parser = argparse.ArgumentParser(prog="python -m myserve.generate", description=__doc__)
    parser.add_argument("--prompt", default="What is the capital of France?", help="user message or raw text")
    parser.add_argument("--config", default=None, help="deployment YAML (default: config/smollm2-135m-cpu.yaml)")
    parser.add_argument("--hf-checkpoint", default=None, help="HF directory, cached hub id or .gguf file")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--raw", action="store_true", help="do not apply the chat template")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        overrides = list(args.set)
        if args.hf_checkpoint:
            overrides.append(f"model.checkpoint={args.hf_checkpoint}")
        config = fetch_checkpoints(load_config(args.config, overrides))
        from myserve.runtime.deployment import Deployment

        dep = Deployment.load(config)
        tok = dep.tokenizer
        if args.raw or not tok.has_chat_template:
            prompt_ids = tok.encode(args.prompt)
        else:
            prompt_ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}])
        max_new = min(args.max_tokens, dep.max_model_len - len(prompt_ids))
        if max_new <= 0:
            raise MyserveError(f"prompt of {len(prompt_ids)} tokens leaves no room in {dep.max_model_len}")
        out = greedy_generate(
            dep.model,
            prompt_ids,
            max_new,
            mesh=dep.mesh,
            mapping=dep.mapping,
            eos_ids=tok.eos_token_ids,
            page_size=config.engine.page_size,
        )
    except MyserveError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(tok.decode(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
