"""``python -m myserve.bench.engine``: engine-level throughput against transformers ``generate``.

Both sides run greedy decoding of the same chat prompts with a fixed number of new tokens (EOS
ignored), in the same process on the same machine:

- myserve: N requests submitted at once to a warmed-up ``GenerationService`` (continuous batching);
- transformers: one static batch of N prompts (left-padded), ``generate`` with ``min_new_tokens``.

Also measures single-request decode speed (tokens/s after the first token). myserve is timed in
its steady state only (``steady.py``: background builds done, every executable run once, else it
fails past ``--steady-timeout``); ``single`` and ``myserve`` say which executables each called and
the tokens per call, and the command exits 1 when one contradicts the steady state
(``steady_state_errors``: something compiled while timed, K > 1 and no decode loop ran).
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from myserve.wire.params import SamplingParams

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


def random_prompts(vocab_size: int, n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids drawn uniformly (seeded) from the tokenizer's vocabulary."""
    import numpy as np

    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(0, vocab_size, size=length)] for _ in range(n)]


def builtin_chat_prompts(tokenizer, n: int) -> list[list[int]]:
    """The first ``n`` built-in prompts of ``python -m myserve.bench`` as chat-templated token ids."""
    from myserve.bench.prompts import builtin_prompts

    return [tokenizer.apply_chat_template(p.payload("chat")["messages"]) for p in builtin_prompts(n)]


def add_pair_args(parser: argparse.ArgumentParser, rounds: int = 3) -> None:
    """The flags of a benchmark of two engines of one model: ``--checkpoint``, ``--rounds``,
    ``--set`` (both engines) and ``--output``."""
    parser.add_argument("--checkpoint", default=None, help="HF directory or .gguf (default: the bundled SmolLM2)")
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override (both engines)"
    )
    parser.add_argument("--output", default=None, help="write the results as JSON here")


def report(result: dict, output: str | None) -> None:
    """Print ``result`` as JSON, and write it to ``output`` when given."""
    print(json.dumps(result, indent=2))
    if output:
        Path(output).write_text(json.dumps(result, indent=2))


def wait_built(*services) -> None:
    """Until every engine's background builds (wider context buckets, several-token calls) are
    done: measured while they compile, an engine shares the CPU with the compiler (``steady``'s
    ``wait_steady`` also waits for every executable's first run, and fails past a limit)."""
    for service in services:
        for replica in service.replicas:
            replica.runner.device.background_builds_done(timeout=None)


def bench_myserve(
    service, prompts: list[list[int]], max_tokens: int, params: Callable[[int], SamplingParams] | None = None
) -> dict:
    """Submit all prompts at once; wall time until every request finished, and TTFTs.

    Each stream is drained by its own thread so first-token times are taken when they happen.
    ``params(i)``: request ``i``'s parameters (default: greedy, ``max_tokens``, EOS ignored).
    The two phases apart: ``prefill_s`` runs until the last request's first token (every prompt
    read; ``prefill_tokens_per_s`` = prompt tokens over it), and ``decode_tokens_per_s`` counts the
    tokens that came after it over the time left (no prompt shares those steps).
    """
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    params = params or (lambda i: greedy)
    ttfts: list[float] = []
    counts: list[int] = []
    arrivals: list[tuple[float, int]] = []
    lock = threading.Lock()

    def drain(stream, t0: float) -> None:
        first, n, seen = None, 0, []
        for out in stream:
            now = time.perf_counter() - t0
            if out.token_ids and first is None:
                first = now
            n += len(out.token_ids)
            seen.append((now, len(out.token_ids)))
        with lock:
            ttfts.append(first if first is not None else float("nan"))
            counts.append(n)
            arrivals.extend(seen)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=drain, args=(service.submit(p, params(i)), t0)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    generated = sum(counts)
    ttfts.sort()
    prefill_s = ttfts[-1]
    after = sum(n for at, n in arrivals if at > prefill_s)
    return {
        "requests": len(prompts),
        "generated_tokens": generated,
        "seconds": elapsed,
        "tokens_per_s": generated / elapsed,
        "ttft_p50_s": ttfts[len(ttfts) // 2],
        "prefill_s": prefill_s,
        "prefill_tokens_per_s": sum(map(len, prompts)) / prefill_s if prefill_s > 0 else None,
        "decode_tokens_per_s": after / (elapsed - prefill_s) if after and elapsed > prefill_s else None,
    }


def bench_single_decode(service, prompt: list[int], max_tokens: int, ignore_eos: bool = True) -> dict:
    """One greedy request alone: decode tokens/s after its first token."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    t0 = time.perf_counter()
    first, n = None, 0
    for out in service.submit(prompt, params):
        if out.token_ids:
            n += len(out.token_ids)
            if first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    return {"ttft_s": first - t0, "decode_tokens_per_s": (n - 1) / (end - first), "tokens": n}


def load_transformers(checkpoint: str | None, device: str, dtype: str) -> Any:
    """transformers' own load of what myserve served: None (the bundled GGUF), a ``.gguf`` or an HF dir."""
    import torch
    import transformers

    from myserve.bundled import bundled_gguf_path

    path = bundled_gguf_path() if checkpoint is None else Path(checkpoint)
    kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype)}
    if path.suffix == ".gguf":
        source, kwargs["gguf_file"] = str(path.parent), path.name
    else:
        source = str(path)
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(source, **kwargs)
    return model.to(device).eval()


def bench_transformers(model: Any, prompts: list[list[int]], max_tokens: int, pad_id: int) -> dict:
    """One static batch of ``prompts`` (left-padded) through ``generate``, exactly ``max_tokens`` each."""
    import torch

    device = model.device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding, as decoder-only generation needs
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)

    def run(new_tokens: int) -> tuple[int, float]:
        if device.type != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad_id,
            )
        if device.type != "cpu":
            torch.cuda.synchronize()
        return (out.shape[1] - width) * len(prompts), time.perf_counter() - t0

    if device.type != "cpu":
        run(4)  # CUDA kernels and cuBLAS handles out of the measurement
    generated, elapsed = run(max_tokens)
    return {
        "requests": len(prompts),
        "generated_tokens": generated,
        "seconds": elapsed,
        "tokens_per_s": generated / elapsed,
    }


def weight_bytes(model) -> int:
    """Bytes of every weight array of the model: what one decode step must read at least once."""
    import jax

    return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(model) if hasattr(leaf, "nbytes"))


def device_bandwidth(gib: float = 2.0) -> float:
    """Measured device memory bandwidth in bytes/s: a large on-device copy, bytes read plus written."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((int(gib * (1 << 30)) // 4,), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0001)
    jax.block_until_ready(copy(x))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(copy(x))
        times.append(time.perf_counter() - t0)
    return 2 * x.nbytes / sorted(times)[len(times) // 2]


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point."""
    from myserve.bench.random_checkpoint import SHAPES
    from myserve.bench.steady import Section, wait_steady

    parser = argparse.ArgumentParser(prog="python -m myserve.bench.engine", description=__doc__)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument(
        "--random",
        default=None,
        choices=sorted(SHAPES),
        metavar="SHAPE",
        help="serve a random-weight checkpoint of this shape built in a temp dir: tiny-llama (the host-bound "
        "yardstick), tiny-llama-16 (the same with 16 layers), llama-3.2-1b, ... (random_checkpoint.SHAPES)",
    )
    parser.add_argument("--hf-device", default=None, help="torch device of the transformers run (default: the JAX one)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument(
        "--floor-batches",
        type=lambda v: [int(x) for x in v.split(",") if x],
        default=[],
        metavar="1,8,32,64",
        help="also time transformers generate with static batches of these sizes (the serving floor)",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=0,
        metavar="N",
        help="prompts of N random token ids instead of the chat prompts (long contexts: attention's share)",
    )
    parser.add_argument(
        "--steady-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds to wait after ready for the background builds and the priming (then fail)",
    )
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import jax

    from myserve.config import load_config
    from myserve.entrypoints.service import GenerationService
    from myserve.runtime.cpu_threads import single_threaded_dots_on_small_hosts
    from myserve.runtime.deployment import Deployment
    from myserve.runtime.host_memory import keep_freed_memory

    single_threaded_dots_on_small_hosts()  # as `serve` does (before JAX starts)
    overrides = list(args.set)
    hf_device = args.hf_device or ("cpu" if jax.default_backend() == "cpu" else "cuda")
    tmp = tempfile.TemporaryDirectory()
    if args.random:
        from myserve.bench.random_checkpoint import make_random_llama

        # Stored in the dtype the engine computes in: bfloat16 on accelerators, float32 on CPU.
        dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
        directory = make_random_llama(args.random, Path(tmp.name) / args.random, dtype=dtype)
        overrides = [f"model.checkpoint={directory}", *overrides]
    config = load_config(None, overrides)
    if jax.default_backend() == "cpu":
        keep_freed_memory()  # as `serve` does
    dep = Deployment.load(config)
    service = GenerationService.from_deployment(dep)
    t0 = time.perf_counter()
    service.start()
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    wait_steady(service, args.steady_timeout)  # nothing is timed on a half-warm engine
    steady_s = time.perf_counter() - t0
    if args.prompt_tokens:
        prompts = random_prompts(
            min(dep.tokenizer.vocab_size, dep.model.spec.vocab_size), args.concurrency, args.prompt_tokens
        )
    else:
        prompts = chat_prompts(dep.tokenizer, args.concurrency)
    bench_myserve(service, prompts[:2], 4)  # first-request effects out of the measurement
    device = jax.devices()[0]
    results: dict[str, Any] = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "python": platform.python_version(),
            "jax": jax.__version__,
            "device": f"{device.platform} {device.device_kind}",
        },
        "argv": list(argv) if argv is not None else sys.argv[1:],
        "dtype": dep.dtype.name,
        "warmup_s": warmup_s,
        "steady_s": steady_s,
    }
    problems: list[str] = []
    for label, one in (("single", True), ("myserve", False)):
        section = Section(service)
        if one:
            run = bench_single_decode(service, prompts[0], args.max_tokens)
        else:
            run = bench_myserve(service, prompts, args.max_tokens)
        figures, found = section.finish(
            run["tokens"] - 1 if one else run["generated_tokens"], one_stream=one, decode=args.max_tokens > 1
        )
        results[label] = run | figures
        problems += [f"{label}: {p}" for p in found]
    results["stats"] = service.stats().__dict__
    service.shutdown()
    if device.platform != "cpu":
        # The memory-bandwidth roofline of decode: every step reads all weights once (KV reads ignored).
        weights = weight_bytes(dep.model)
        bandwidth = device_bandwidth()
        results["roofline"] = {
            "weight_bytes": weights,
            "bandwidth_bytes_per_s": bandwidth,
            "single_tokens_per_s": bandwidth / weights,
            "concurrent_tokens_per_s": args.concurrency * bandwidth / weights,
        }
    tokenizer, pad_id = dep.tokenizer, dep.tokenizer.eos_token_ids[0]
    del service, dep  # device memory back before transformers loads its copy
    if not args.skip_transformers:
        hf = load_transformers(config.model.checkpoint, hf_device, results["dtype"])
        tf = {
            "batch": bench_transformers(hf, prompts, args.max_tokens, pad_id),
            "single": bench_transformers(hf, prompts[:1], args.max_tokens, pad_id),
        }
        results["transformers"] = tf
        results["ratio"] = results["myserve"]["tokens_per_s"] / tf["batch"]["tokens_per_s"]
        results["single_ratio"] = results["single"]["decode_tokens_per_s"] / tf["single"]["tokens_per_s"]
        # The floor a static-batch server would reach at each concurrency, on the HTTP load
        # generator's built-in chat prompts (``python -m myserve.bench``), padded to the longest.
        results["transformers_floor"] = {
            b: bench_transformers(hf, builtin_chat_prompts(tokenizer, b), args.max_tokens, pad_id)["tokens_per_s"]
            for b in args.floor_batches
        }
    tmp.cleanup()
    results["steady_state_errors"] = problems
    print(json.dumps(results, indent=2))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)
    for problem in problems:
        print(f"error: not the steady state: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
