"""``python -m myserve.bench.prefix_tier``: multi-turn chat with and without the host tier of the
prefix cache (``engine.kv_offloading_size``).

Conversations share a few system prompts; each runs its turns one after another (a turn's prompt
is the conversation so far: the system prompt, the user turns and the model's greedy replies), turn
by turn over all conversations, ``--concurrency`` requests at a time, on a device pool that holds
the requests in flight but not every conversation's prefix (``--num-pages``). Each
setting gets a fresh in-process engine, measured in its steady state (``steady.wait_steady``), and
the settings alternate over ``--rounds``. Reported per run: prompt tokens computed, tokens served
from each tier, time to first token (median, p90), wall time, and whether the pool and the tier
went back to idle; across runs, whether every reply was the same token for token.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

from myserve.bench.engine import QUESTIONS
from myserve.wire.params import SamplingParams

SYSTEMS = [
    "You are a patient tutor. Explain each idea step by step, check the student's understanding, "
    "and give one short exercise at the end of every answer. Keep a friendly tone, avoid jargon "
    "unless you define it, and prefer concrete examples from everyday life over abstract ones.",
    "You are a concise technical assistant for a team of software engineers. Answer with the "
    "essential facts first, then the caveats. When code helps, give a minimal example. Never "
    "invent APIs; say so when you are not sure, and name what the reader should check.",
    "You are a travel guide who knows history, food and local customs. Suggest what to see, what "
    "to eat and how to get around, with an eye on budget and season. Mention one thing most "
    "visitors miss, and one common mistake to avoid.",
    "You are a careful editor. Improve clarity and flow without changing the author's meaning. "
    "Point out ambiguous sentences, repeated words and claims that need a source, then give the "
    "revised text. Keep the author's voice and the length within ten percent.",
]


def conversation_turns(conversations: int, turns: int) -> list[list[str]]:
    """Each conversation's user turns (the question list, rotated per conversation)."""
    return [
        [f"{QUESTIONS[(c + t) % len(QUESTIONS)]} (conversation {c}, turn {t})" for t in range(turns)]
        for c in range(conversations)
    ]


def run_workload(
    service: Any, tokenizer: Any, conversations: int, turns: int, max_tokens: int, concurrency: int
) -> dict[str, Any]:
    """Turn by turn: every conversation's next turn, ``concurrency`` requests at a time (the others
    wait, as users between turns do, while their prefixes age in the cache); the replies' token
    ids and the TTFTs."""
    from concurrent.futures import ThreadPoolExecutor

    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    users = conversation_turns(conversations, turns)
    chats = [[{"role": "system", "content": SYSTEMS[c % len(SYSTEMS)]}] for c in range(conversations)]
    replies: list[list[list[int]]] = [[] for _ in range(conversations)]
    ttfts: list[float] = []
    prompt_tokens = [0]
    lock = threading.Lock()

    def turn(c: int, t: int) -> None:
        chats[c].append({"role": "user", "content": users[c][t]})
        prompt = tokenizer.apply_chat_template(chats[c])
        t0 = time.perf_counter()
        first, ids = None, []
        for out in service.submit(prompt, greedy):
            if out.token_ids and first is None:
                first = time.perf_counter() - t0
            ids += out.token_ids
        replies[c].append(ids)
        chats[c].append({"role": "assistant", "content": tokenizer.decode(ids)})
        with lock:
            ttfts.append(first if first is not None else float("nan"))
            prompt_tokens[0] += len(prompt)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for t in range(turns):
            list(pool.map(turn, range(conversations), [t] * conversations))
    ttfts.sort()
    return {
        "seconds": time.perf_counter() - t0,
        "requests": len(ttfts),
        "prompt_tokens": prompt_tokens[0],
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
        "replies": replies,
    }


def measure(overrides: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """One fresh engine of ``overrides``, steady, through the workload; its figures."""
    from myserve.bench.steady import wait_steady
    from myserve.config import load_config
    from myserve.entrypoints.service import GenerationService
    from myserve.runtime.deployment import Deployment

    dep = Deployment.load(load_config(None, overrides))
    service = GenerationService.from_deployment(dep)
    service.start()
    try:
        wait_steady(service, args.steady_timeout)
        before = service.stats()
        got = run_workload(service, dep.tokenizer, args.conversations, args.turns, args.max_tokens, args.concurrency)
        after = service.stats()
        alloc = service.replicas[0].allocator
        got.update(
            prompt_tokens_computed=after.prompt_tokens_computed - before.prompt_tokens_computed,
            device_hit_tokens=after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens,
            host_hit_tokens=after.host_tier_hit_tokens - before.host_tier_hit_tokens,
            host_saved_pages=after.host_tier_saved_pages - before.host_tier_saved_pages,
            host_pages=[after.host_tier_pages_used, after.host_tier_pages_total],
            num_preemptions=after.num_preemptions - before.num_preemptions,
            idle=after.pages_used == 0 and alloc.transfers_owed == 0,
            pool_pages=after.pages_total,
        )
        return got
    finally:
        service.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; exits 1 when the settings' replies differ or a pool did not go idle."""
    parser = argparse.ArgumentParser(prog="python -m myserve.bench.prefix_tier", description=__doc__)
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per reply (greedy, EOS ignored)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    parser.add_argument(
        "--num-pages", type=int, default=384, help="the device pool (engine.num_pages): the requests in flight fit"
    )
    parser.add_argument("--offload-gib", type=float, default=1.0, help="the host tier (engine.kv_offloading_size)")
    parser.add_argument("--rounds", type=int, default=1, help="off/on pairs, alternating")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--steady-timeout", type=float, default=600.0, metavar="S")
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    parser.add_argument("--one", choices=("off", "on"), help=argparse.SUPPRESS)  # a child's one run
    parser.add_argument("--result", help=argparse.SUPPRESS)  # where the child writes it
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    base = [f"engine.num_pages={args.num_pages}", *args.set]
    settings = {"off": base, "on": [*base, f"engine.kv_offloading_size={args.offload_gib}"]}
    if args.one:
        with open(args.result, "w") as f:
            json.dump(measure(settings[args.one], args), f)
        return 0
    # Each run in a process of its own: fresh, and one engine's executables per process (XLA:CPU
    # maps ~50k memory regions for SmolLM2's: two engines pass Linux's default vm.max_map_count).
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    argv_here = list(argv) if argv is not None else sys.argv[1:]
    for _ in range(args.rounds):
        for name in settings:
            with tempfile.NamedTemporaryFile(suffix=".json") as result:
                child = [sys.executable, "-m", "myserve.bench.prefix_tier", *argv_here, "--one", name]
                subprocess.run([*child, "--result", result.name], check=True)
                runs[name].append(json.load(open(result.name)))
            shown = {k: v for k, v in runs[name][-1].items() if k != "replies"}
            print(name, json.dumps(shown), flush=True)
    reference = runs["off"][0]["replies"]
    same = all(r["replies"] == reference for rs in runs.values() for r in rs)
    summary: dict[str, Any] = {"argv": list(argv) if argv is not None else sys.argv[1:], "same_replies": same}
    for name, rs in runs.items():
        summary[name] = [{k: v for k, v in r.items() if k != "replies"} for r in rs]
    off, on = summary["off"], summary["on"]
    summary["ttft_p50_ratio_off_over_on"] = [a["ttft_p50_s"] / b["ttft_p50_s"] for a, b in zip(off, on, strict=True)]
    summary["computed_ratio_on_over_off"] = [
        b["prompt_tokens_computed"] / a["prompt_tokens_computed"] for a, b in zip(off, on, strict=True)
    ]
    text = json.dumps(summary, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    idle = all(r["idle"] for rs in runs.values() for r in rs)
    return 0 if same and idle else 1


if __name__ == "__main__":
    sys.exit(main())
