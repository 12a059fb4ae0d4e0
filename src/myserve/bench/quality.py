"""``python -m myserve.bench.quality``: what a serving variant (quantized weights, another dtype)
does to the model's answers, over HTTP: perplexity of a shipped text, and greedy agreement with a
reference variant.

Variants: ``--variant LABEL=SPEC`` (repeatable; the first is the reference). SPEC is a running
server's URL (``http://...``), or serve arguments (one shell-quoted string, may be empty) for a
``python -m myserve.serve`` launched for that variant alone, after the serve arguments given after
``--`` (shared by every launched variant). Without ``--variant``: ``--url`` if given, else one
server launched with the arguments after ``--``. Launched variants run one after the other.

**Perplexity**: the text (``--text``; default ``data/perplexity.txt``, see ``data/README.md``) is
tokenized by the server (``POST /tokenize``, no special tokens) and cut into windows of
``--window`` tokens (default: the reference's ``max_model_len`` - 1, which leaves the one token of
room a completion needs), each sent as token ids to ``/v1/completions`` with ``echo``,
``logprobs: 0``, temperature 0 and ``max_tokens: 0`` (1 where a server refuses 0): the server
scores every prompt token but the window's first. Windows start ``--stride`` tokens apart
(default window - 1: consecutive windows share one token), and each scores only the tokens no
earlier window scored, so every token but the text's first is scored exactly once. With the
default stride a token sees only the context of its own window (little near a window's start,
alike for every variant); a smaller stride gives each token at least window - stride tokens of
context, at the cost of recomputing them. ppl = exp(-mean logprob).

**Greedy agreement**: each of ``PARITY_PROMPTS`` as a chat user message, ``--max-tokens`` greedy
tokens with EOS ignored (so every output has exactly that many), each token's bytes read from the
chat logprobs. Against the reference: the fraction of prompts whose tokens are identical, and the
mean length of the common token prefix / ``--max-tokens``.

Requests go one at a time, so no variant's numbers depend on how its server batched them. Prints
a table, and writes everything (outputs included) to ``--output`` as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import shlex
import sys
import time
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from myserve.bench.launch import LaunchedServer
from myserve.bench.loadgen import first_model_id, import_httpx

PARITY_PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
)
"""The prompts of the bundled SmolLM2's greedy parity with transformers (tests/test_gguf_parity.py)."""


@dataclasses.dataclass(frozen=True)
class Variant:
    """A labelled server: a running one's ``url``, or the ``serve_args`` to launch one with."""

    label: str
    url: str | None = None
    serve_args: tuple[str, ...] = ()


def parse_variant(spec: str, common: Sequence[str] = ()) -> Variant:
    """``LABEL=URL`` or ``LABEL=SERVE ARGS`` (launched after ``common``)."""
    label, sep, value = spec.partition("=")
    if not sep or not label:
        raise argparse.ArgumentTypeError(f"a variant is LABEL=URL or LABEL=SERVE_ARGS, got {spec!r}")
    if value.startswith(("http://", "https://")):
        return Variant(label, url=value.rstrip("/"))
    return Variant(label, serve_args=(*common, *shlex.split(value)))


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[Variant]]:
    """Options, and the variants (the reference first)."""
    args = list(argv)
    ours, serve = (args, []) if "--" not in args else (args[: args.index("--")], args[args.index("--") + 1 :])
    p = argparse.ArgumentParser(
        prog="python -m myserve.bench.quality",
        usage="%(prog)s [options] [--variant LABEL=URL|LABEL=ARGS ...] [-- SERVE_ARGS ...]",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--variant", action="append", default=[], help="LABEL=URL or LABEL=SERVE_ARGS (repeatable)")
    p.add_argument("--url", help="a running server (without --variant)")
    p.add_argument("--model", help="the model name (default: the first /v1/models lists)")
    p.add_argument("--text", type=Path, help="the text to score (default: the shipped data/perplexity.txt)")
    p.add_argument("--window", type=int, help="tokens per request (default: max_model_len - 1)")
    p.add_argument("--stride", type=int, help="tokens between window starts (default: window - 1)")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--api-key", help="sent as a Bearer token")
    p.add_argument("--output", type=Path, help="write the results here as JSON")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    ns = p.parse_args(ours)
    if ns.variant and ns.url:
        p.error("give --url or --variant, not both")
    if ns.variant:
        try:
            variants = [parse_variant(v, serve) for v in ns.variant]
        except argparse.ArgumentTypeError as e:
            p.error(str(e))
    else:
        variants = [Variant("server", url=ns.url.rstrip("/")) if ns.url else Variant("server", serve_args=tuple(serve))]
    if len({v.label for v in variants}) != len(variants):
        p.error("variant labels must differ")
    return ns, variants


def windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored) of each window over ``n`` tokens: tokens [start, end) are sent and
    [first scored, end) counted; together the windows count tokens 1 to n - 1 once each."""
    if not 1 <= stride < window:
        raise ValueError(f"need 1 <= stride < window, got stride {stride}, window {window}")
    spans, start, scored = [], 0, 1
    while scored < n:
        end = min(start + window, n)
        spans.append((start, end, scored))
        start, scored = start + stride, end
    return spans


class Session:
    """One server's HTTP API, as the measurements use it."""

    def __init__(self, base: str, model: str | None, api_key: str | None, timeout_s: float) -> None:
        httpx = import_httpx()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base = base
        self.client = httpx.Client(base_url=base, headers=headers, timeout=timeout_s)
        self.model = model or first_model_id(base, headers, timeout_s)
        self.echo_max_tokens = 0  # raised to 1 if the server refuses 0

    def post(self, path: str, body: dict[str, Any], refused_ok: bool = False) -> dict[str, Any] | None:
        """The JSON answer; None for a 400 when ``refused_ok``; raises on any other failure."""
        response = self.client.post(path, json={"model": self.model, **body})
        if refused_ok and response.status_code == 400:
            return None
        if response.status_code != 200:
            raise RuntimeError(f"POST {self.base}{path}: HTTP {response.status_code}: {response.text[:500]}")
        return dict(response.json())

    def tokenize(self, text: str) -> tuple[list[int], int | None]:
        """The text's token ids (no special tokens), and the server's max_model_len if it says."""
        out = self.post("/tokenize", {"prompt": text, "add_special_tokens": False})
        assert out is not None
        return [int(t) for t in out["tokens"]], out.get("max_model_len")

    def prompt_logprobs(self, ids: list[int]) -> list[float | None]:
        """The logprob of each prompt token given those before it (None for the first)."""
        body = {"prompt": ids, "echo": True, "logprobs": 0, "temperature": 0.0}
        out = self.post("/v1/completions", {**body, "max_tokens": self.echo_max_tokens}, refused_ok=True)
        if out is None and self.echo_max_tokens == 0:
            self.echo_max_tokens = 1
            out = self.post("/v1/completions", {**body, "max_tokens": 1})
        if out is None:
            raise RuntimeError(f"{self.base} refused an echo request of {len(ids)} tokens")
        scores = out["choices"][0]["logprobs"]["token_logprobs"]
        if len(scores) < len(ids):
            raise RuntimeError(f"{self.base} scored {len(scores)} of a {len(ids)}-token prompt")
        return scores[: len(ids)]  # a generated token (max_tokens 1) follows the prompt's

    def greedy(self, prompt: str, max_tokens: int) -> tuple[list[bytes], str]:
        """``max_tokens`` greedy tokens (EOS ignored) answering ``prompt``: each token's bytes, and the text."""
        body = {
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "logprobs": True,
        }
        out = self.post("/v1/chat/completions", body)
        assert out is not None
        choice = out["choices"][0]
        return [bytes(t["bytes"]) for t in choice["logprobs"]["content"]], choice["message"]["content"] or ""


def perplexity(session: Session, ids: list[int], window: int, stride: int) -> dict[str, Any]:
    """Score ``ids`` in windows; the summed and mean logprob, and the perplexity."""
    total, count = 0.0, 0
    for start, end, first in windows(len(ids), window, stride):
        scores = session.prompt_logprobs(ids[start:end])[first - start :]
        if any(s is None for s in scores):
            raise RuntimeError(f"{session.base} gave no logprob for a token after a window's first")
        total += math.fsum(s for s in scores if s is not None)
        count += len(scores)
    mean = total / count
    return {"tokens_scored": count, "logprob_sum": total, "mean_logprob": mean, "ppl": math.exp(-mean)}


def agreement(reference: list[list[str]], outputs: list[list[str]], max_tokens: int) -> tuple[float, float]:
    """(fraction of outputs identical to the reference's, mean common-prefix length / max_tokens)."""
    same = prefix = 0
    for ref, got in zip(reference, outputs, strict=True):
        same += ref == got
        common = next((i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), min(len(ref), len(got)))
        prefix += common
    n = len(reference)
    return same / n, prefix / (n * max_tokens)


def measure(session: Session, text: str, args: argparse.Namespace, window: int | None) -> dict[str, Any]:
    """Perplexity and greedy outputs of one server; ``window`` None: from its max_model_len."""
    t0 = time.perf_counter()
    ids, max_model_len = session.tokenize(text)
    if window is None:
        if max_model_len is None:
            raise RuntimeError(f"{session.base}/tokenize gives no max_model_len: pass --window")
        window = int(max_model_len) - 1
    stride = args.stride or window - 1
    result: dict[str, Any] = {"model": session.model, "max_model_len": max_model_len, "text_tokens": len(ids)}
    result.update(window=window, stride=stride, windows=len(windows(len(ids), window, stride)))
    result.update(perplexity(session, ids, window, stride))
    result["perplexity_s"] = round(time.perf_counter() - t0, 2)
    t1 = time.perf_counter()
    greedy = [session.greedy(p, args.max_tokens) for p in PARITY_PROMPTS]
    result["greedy_s"] = round(time.perf_counter() - t1, 2)
    # Bytes that are not whole UTF-8 characters become \xNN escapes: the strings compare as the bytes do.
    result["greedy"] = [
        {"prompt": p, "text": answer, "tokens": [t.decode("utf-8", "backslashreplace") for t in tokens]}
        for p, (tokens, answer) in zip(PARITY_PROMPTS, greedy, strict=True)
    ]
    return result


def compare(results: list[dict[str, Any]], max_tokens: int) -> None:
    """Add each result's ratios and agreement against the first (the reference), in place."""
    ref = results[0]
    for r in results:
        r["ppl_ratio"] = r["ppl"] / ref["ppl"]
        tokens = [g["tokens"] for g in r["greedy"]]
        r["greedy_identical"], r["greedy_prefix"] = agreement([g["tokens"] for g in ref["greedy"]], tokens, max_tokens)


def table(results: list[dict[str, Any]]) -> str:
    """One row per variant."""
    rows = [["variant", "tokens scored", "ppl", "ppl / ref", "greedy identical", "common prefix"]]
    for r in results:
        ppl, ratio, same, prefix = r["ppl"], r["ppl_ratio"], r["greedy_identical"], r["greedy_prefix"]
        rows.append([r["label"], str(r["tokens_scored"]), f"{ppl:.4f}", f"{ratio:.4f}", f"{same:.3f}", f"{prefix:.3f}"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows)


def run(args: argparse.Namespace, variants: list[Variant], text: str) -> list[dict[str, Any]]:
    """Measure every variant in turn (launching those without a URL); comparisons filled in."""
    results: list[dict[str, Any]] = []
    window = args.window  # None until the reference's max_model_len fixes it for every variant
    for v in variants:
        with contextlib.ExitStack() as stack:
            t0 = time.perf_counter()
            base = v.url or stack.enter_context(LaunchedServer(v.serve_args)).url
            launch_s = time.perf_counter() - t0
            session = Session(base, args.model, args.api_key, args.timeout)
            stack.callback(session.client.close)
            r = {"label": v.label, "url": v.url, "serve_args": list(v.serve_args), "launch_s": round(launch_s, 2)}
            r.update(measure(session, text, args, window))
        window = r["window"]
        print(f"{v.label}: ppl {r['ppl']:.4f} over {r['tokens_scored']} tokens", file=sys.stderr)
        results.append(r)
    compare(results, args.max_tokens)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """Run the measurements; print the table, write the JSON."""
    args, variants = parse_args(sys.argv[1:] if argv is None else argv)
    if args.text is not None:
        text = args.text.read_text(encoding="utf-8")
    else:
        text = resources.files("myserve.bench").joinpath("data/perplexity.txt").read_text(encoding="utf-8")
    results = run(args, variants, text)
    print(table(results))
    if args.output is not None:
        report = {
            "text": str(args.text) if args.text else "myserve/bench/data/perplexity.txt",
            "prompts": list(PARITY_PROMPTS),
            "max_tokens": args.max_tokens,
            "variants": results,
        }
        args.output.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
