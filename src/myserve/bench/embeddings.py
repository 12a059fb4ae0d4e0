"""``python -m myserve.bench.embeddings``: embeddings throughput over HTTP, and what an embedding
load costs concurrent chat streams.

Three phases against one server (launched from the serve arguments after ``--``, by default the
bundled SmolLM2 with ``model.task=generate+embed``; or ``--url`` for a running one):

1. **Embeddings**: ``--inputs`` inputs of ``--input-tokens`` token ids each, one input per request,
   ``--embed-concurrency`` requests in flight; inputs/s.
2. **Chat alone**: ``--chat-concurrency`` streamed chat requests (``--max-tokens`` each, EOS
   ignored); generated tokens/s.
3. **Chat with an embedding load**: the same chat load while another process (another client, so
   that one client's CPU does not throttle the other) keeps ``--embed-concurrency`` embedding
   requests in flight until the chat requests are done; both rates.

Inputs are random token ids (no prefix-cache hits between them). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import random
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from myserve.bench.launch import LaunchedServer
from myserve.bench.loadgen import Target, first_model_id, make_client, run_level
from myserve.bench.metrics import summarize
from myserve.bench.prompts import builtin_prompts

DEFAULT_SERVE = ["--set", "model.task=generate+embed"]


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Options, and the serve arguments after ``--``."""
    args = list(argv)
    ours, serve = (args, []) if "--" not in args else (args[: args.index("--")], args[args.index("--") + 1 :])
    p = argparse.ArgumentParser(prog="python -m myserve.bench.embeddings", description=__doc__)
    p.add_argument("--url", help="a running server (else one is launched with the serve arguments after --)")
    p.add_argument("--model", help="the model name (default: the first /v1/models lists)")
    p.add_argument("--inputs", type=int, default=256)
    p.add_argument("--input-tokens", type=int, default=64)
    p.add_argument("--embed-concurrency", type=int, default=32)
    p.add_argument("--chat-concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--vocab", type=int, default=49152, help="token ids are drawn below this")
    p.add_argument("--timeout", type=float, default=600.0)
    return p.parse_args(ours), serve or list(DEFAULT_SERVE)


async def _embed(client: Any, url: str, body: dict[str, Any]) -> int:
    """One embeddings request; the inputs it embedded (0 on failure)."""
    response = await client.post(url, json=body)
    return len(response.json()["data"]) if response.status_code == 200 else 0


async def _embed_load(client: Any, url: str, bodies: list[dict[str, Any]], concurrency: int) -> tuple[int, float]:
    """Send ``bodies`` with ``concurrency`` in flight; (inputs embedded, seconds)."""
    slots = asyncio.Semaphore(concurrency)

    async def one(body: dict[str, Any]) -> int:
        async with slots:
            return await _embed(client, url, body)

    t0 = time.perf_counter()
    done = await asyncio.gather(*(one(b) for b in bodies))
    return sum(done), time.perf_counter() - t0


def _embedding_load(url: str, model: str, tokens: int, vocab: int, concurrency: int, events: Any, out: Any) -> None:
    """In a process of its own (its client's CPU is not the chat client's): keep ``concurrency``
    embedding requests in flight; set ``events[0]`` (ready) once the first answered, count the
    inputs embedded while ``events[1]`` (measure) is set, stop at ``events[2]`` (stop). Puts
    (inputs, median latency s) on ``out``."""
    ready, measure, stop = events
    rng = random.Random(1)

    async def load() -> tuple[int, float]:
        count, latencies = 0, list[float]()

        async def worker() -> None:
            nonlocal count
            while not stop.is_set():
                body = {"model": model, "input": [rng.randrange(3, vocab) for _ in range(tokens)]}
                started, counting = time.perf_counter(), measure.is_set()
                done = await _embed(client, url, body)
                ready.set()
                if counting and measure.is_set():  # sent and answered inside the measured window
                    count += done
                    latencies.append(time.perf_counter() - started)

        async with make_client(concurrency, 600.0) as client:
            await asyncio.gather(*(worker() for _ in range(concurrency)))
        return count, statistics.median(latencies) if latencies else float("nan")

    out.put(asyncio.run(load()))


async def run(args: argparse.Namespace, base: str) -> dict[str, Any]:
    """The three phases against the server at ``base``."""
    model = args.model or first_model_id(base, {})
    rng = random.Random(0)
    url = f"{base}/v1/embeddings"

    def embed_body() -> dict[str, Any]:
        return {"model": model, "input": [rng.randrange(3, args.vocab) for _ in range(args.input_tokens)]}

    chat_target = Target(f"{base}/v1/chat/completions", {}, args.timeout)
    n_chat = 4 * args.chat_concurrency

    def chat_bodies(offset: int) -> list[dict[str, Any]]:
        return [
            {
                "model": model,
                **p.payload("chat"),
                "max_tokens": args.max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            for p in builtin_prompts(offset + n_chat)[offset:]
        ]

    results: dict[str, Any] = {"model": model}
    async with make_client(args.embed_concurrency + args.chat_concurrency + 8, args.timeout) as client:
        await _embed_load(client, url, [embed_body() for _ in range(8)], 8)  # warm the route
        done, seconds = await _embed_load(
            client, url, [embed_body() for _ in range(args.inputs)], args.embed_concurrency
        )
        results["embeddings"] = {
            "inputs": done,
            "input_tokens": args.input_tokens,
            "concurrency": args.embed_concurrency,
            "seconds": round(seconds, 2),
            "inputs_per_s": round(done / seconds, 1),
        }
        alone = summarize(await run_level(client, chat_target, chat_bodies(0), args.chat_concurrency))
        spawn = multiprocessing.get_context("spawn")
        events, out = (spawn.Event(), spawn.Event(), spawn.Event()), spawn.Queue()
        load_args = (url, model, args.input_tokens, args.vocab, args.embed_concurrency, events, out)
        loader = spawn.Process(target=_embedding_load, args=load_args, daemon=True)
        loader.start()
        await asyncio.to_thread(events[0].wait)  # the load is running before the chat starts
        events[1].set()
        t0 = time.perf_counter()
        mixed_run = await run_level(client, chat_target, chat_bodies(n_chat), args.chat_concurrency)
        elapsed = time.perf_counter() - t0
        events[1].clear()
        events[2].set()
        embedded, latency = await asyncio.to_thread(out.get)
        loader.join()
        mixed = summarize(mixed_run)
    for name, summary in (("chat_alone", alone), ("chat_with_embeddings", mixed)):
        results[name] = {
            "concurrency": summary.concurrency,
            "requests_ok": summary.requests_ok,
            "output_tokens_per_s": round(summary.output_tokens_per_s, 1),
            "tpot_ms_p50": round(summary.tpot_ms.p50, 2) if summary.tpot_ms.p50 is not None else None,
        }
    results["chat_with_embeddings"]["embedding_inputs_per_s"] = round(embedded / elapsed, 1)
    results["chat_with_embeddings"]["embedding_latency_ms_p50"] = round(latency * 1000, 1)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print its JSON."""
    args, serve = parse_args(sys.argv[1:] if argv is None else argv)
    with contextlib.ExitStack() as stack:
        base = args.url
        if base is None:
            server = stack.enter_context(LaunchedServer(serve))
            base = server.url
        results = asyncio.run(run(args, base.rstrip("/")))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
