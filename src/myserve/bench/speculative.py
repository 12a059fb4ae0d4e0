"""``python -m myserve.bench.speculative``: one stream's decode speed with prompt-lookup (ngram)
speculative decoding (or a draft model: ``--draft DIR``) against without, engine level, in one process.

Two engines of the same model, one speculating (``--k`` draft tokens, n-grams up to
``--lookup-max``), the other not, answer the same greedy requests one at a time, in alternating
rounds, on prompts whose answers repeat their input (a code edit, a JSON echo, quoting a text):
the case prompt lookup is for. Reports each engine's tokens/s, the ratio of the medians, and the
speculating engine's acceptance rate (draft tokens that held / proposed) and tokens per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path

from myserve.bench.engine import add_pair_args, bench_single_decode, report, wait_built

CODE = """def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(value)
"""
RECORD = {"id": 4182, "name": "Ada Lovelace", "role": "analyst", "tags": ["math", "engines", "notes"], "active": True}
TEXT = (
    "The engine was designed to weave algebraic patterns just as the Jacquard loom weaves flowers and "
    "leaves. It could act upon other things besides number, were objects found whose mutual "
    "relations could be expressed by those of the abstract science of operations."
)
PROMPTS = [
    f"Fix the bug in this function and reply with the whole corrected function only:\n\n{CODE}",
    f"Reply with exactly this JSON object, unchanged:\n\n{json.dumps(RECORD)}",
    f'Quote this passage word for word, then say in one sentence what it is about:\n\n"{TEXT}"',
]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m myserve.bench.speculative", description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=4, help="draft tokens per speculating decode")
    parser.add_argument("--lookup-max", type=int, default=5)
    parser.add_argument("--lookup-min", type=int, default=1)
    parser.add_argument("--draft", help="a draft model's checkpoint (same vocabulary): draft_model instead of ngram")
    parser.add_argument("--max-tokens", type=int, default=128)
    add_pair_args(parser)
    args = parser.parse_args(argv)

    from myserve.testing import start_service

    checkpoint = None if args.checkpoint is None else Path(args.checkpoint)
    plain = start_service(checkpoint, *args.set)
    method = (
        ["engine.speculative_method=draft_model", f"engine.speculative_model={args.draft}"]
        if args.draft
        else ["engine.speculative_method=ngram"]
    )
    spec = start_service(
        checkpoint,
        *args.set,
        *method,
        f"engine.num_speculative_tokens={args.k}",
        f"engine.prompt_lookup_max={args.lookup_max}",
        f"engine.prompt_lookup_min={args.lookup_min}",
    )
    try:
        wait_built(plain, spec)
        prompts = [plain.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
        for service in (plain, spec):  # first requests pay one-off costs
            bench_single_decode(service, prompts[0], 4, ignore_eos=False)
        kind = "draft" if args.draft else "ngram"
        runs: dict[str, list[float]] = {"plain": [], kind: []}
        before = spec.stats()
        for _ in range(args.rounds):
            for prompt in prompts:
                for name, service in (("plain", plain), (kind, spec)):
                    decode = bench_single_decode(service, prompt, args.max_tokens, ignore_eos=False)
                    runs[name].append(decode["decode_tokens_per_s"])
        after = spec.stats()
    finally:
        plain.shutdown()
        spec.shutdown()
    proposed = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    generated = after.generated_tokens - before.generated_tokens
    steps = after.steps - before.steps
    medians = {name: statistics.median(values) for name, values in runs.items()}
    result = {
        "k": args.k,
        "lookup": [args.lookup_min, args.lookup_max],
        "max_tokens": args.max_tokens,
        "decode_tokens_per_s": runs,
        "median_decode_tokens_per_s": medians,
        f"{kind}_vs_plain": medians[kind] / medians["plain"],
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "drafts": after.spec_drafts - before.spec_drafts,
        "tokens_per_step": generated / steps if steps else 0.0,
    }
    report(result, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
