"""``python -m myserve.bench.engine``: engine-level throughput against transformers ``generate``.

Both sides run greedy decoding of the same chat prompts with a fixed number of new tokens (EOS
ignored), in the same process on the same machine:

- myserve: N requests submitted at once to a warmed-up ``GenerationService`` (continuous batching);
- transformers: one static batch of N prompts (left-padded), ``generate`` with ``min_new_tokens``.

Also measures single-request decode speed (tokens/s after the first token).
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import threading
import time
from collections.abc import Sequence
from typing import Any

from myserve.engine.params import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis to a child.",
    "Write a short poem about autumn leaves.",
    "Give me three tips for learning a new language.",
    "What are the main causes of climate change?",
    "Describe how a bicycle works.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.",
]


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    """``n`` chat-templated prompts cycling through a fixed question list."""
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (#{i})"}])
        for i in range(n)
    ]


def bench_myserve(service, prompts: list[list[int]], max_tokens: int) -> dict:
    """Submit all prompts at once; wall time until every request finished, and TTFTs.

    Each stream is drained by its own thread so first-token times are taken when they happen.
    """
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ttfts: list[float] = []
    counts: list[int] = []
    lock = threading.Lock()

    def drain(stream, t0: float) -> None:
        first, n = None, 0
        for out in stream:
            if out.token_ids and first is None:
                first = time.perf_counter() - t0
            n += len(out.token_ids)
        with lock:
            ttfts.append(first if first is not None else float("nan"))
            counts.append(n)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=drain, args=(service.submit(p, params), t0)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    generated = sum(counts)
    ttfts.sort()
    return {
        "requests": len(prompts),
        "generated_tokens": generated,
        "seconds": elapsed,
        "tokens_per_s": generated / elapsed,
        "ttft_p50_s": ttfts[len(ttfts) // 2],
    }


def bench_single_decode(service, prompt: list[int], max_tokens: int) -> dict:
    """One request alone: decode tokens/s after its first token."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    first, n = None, 0
    for out in service.submit(prompt, params):
        if out.token_ids:
            n += len(out.token_ids)
            if first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    return {"ttft_s": first - t0, "decode_tokens_per_s": (n - 1) / (end - first)}


def bench_transformers(prompts: list[list[int]], max_tokens: int, pad_id: int) -> dict:
    """One static batch through transformers ``generate`` on the same GGUF, float32, CPU."""
    import torch
    import transformers

    from myserve.bundled import bundled_gguf_path

    torch.set_num_threads(max(1, torch.get_num_threads()))
    path = bundled_gguf_path()
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    model.eval()
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding, as decoder-only generation needs
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
        elapsed = time.perf_counter() - t0
    generated = (out.shape[1] - width) * len(prompts)
    return {
        "requests": len(prompts),
        "generated_tokens": generated,
        "seconds": elapsed,
        "tokens_per_s": generated / elapsed,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point."""
    parser = argparse.ArgumentParser(prog="python -m myserve.bench.engine", description=__doc__)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from myserve.config import load_config
    from myserve.engine.service import GenerationService
    from myserve.runtime.deployment import Deployment

    config = load_config(None, args.set)
    dep = Deployment.load(config)
    service = GenerationService.from_deployment(dep)
    t0 = time.perf_counter()
    service.start()
    warmup_s = time.perf_counter() - t0
    prompts = chat_prompts(dep.tokenizer, args.concurrency)
    bench_myserve(service, prompts[:2], 4)  # first-request effects out of the measurement
    results = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "python": platform.python_version(),
        },
        "config": args.set,
        "warmup_s": warmup_s,
        "single": bench_single_decode(service, prompts[0], args.max_tokens),
        "myserve": bench_myserve(service, prompts, args.max_tokens),
        "stats": service.stats().__dict__,
    }
    service.shutdown()
    if not args.skip_transformers:
        results["transformers"] = bench_transformers(prompts, args.max_tokens, dep.tokenizer.eos_token_ids[0])
        results["ratio"] = results["myserve"]["tokens_per_s"] / results["transformers"]["tokens_per_s"]
    print(json.dumps(results, indent=2))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
