"""``python -m myserve.bench``: load-test any OpenAI-compatible server over HTTP.

Sends streamed chat or completion requests at each level of a concurrency sweep (each level a
separate run with at most that many requests in flight), times TTFT, inter-token latency, TPOT and
end-to-end latency per request, and reports throughput and percentiles per level: a table on
stdout, optionally a JSON file and a PNG. Works against myserve, vLLM or llama.cpp's llama-server.

Examples::

    # a running server (the model defaults to the first id of GET /v1/models)
    python -m myserve.bench --base-url http://127.0.0.1:8080 --concurrency 1,8,32,64 \\
        --max-tokens 128 --ignore-eos --label llama.cpp --output llamacpp.json --plot llamacpp.png

    # launch python -m myserve.serve for the run: its arguments go after "--" (or in --launch-args)
    python -m myserve.bench --launch --concurrency 1,8 --output myserve.json -- --max-num-seqs 16

    # compare saved runs side by side
    python -m myserve.bench plot myserve.json llamacpp.json --output compare.png

Requests per level: ``--num-prompts`` if given, else max(32, 4 x concurrency). Levels never reuse
a built-in prompt verbatim, so a prefix cache cannot serve a whole prompt from an earlier level.
Exit code 1 when every request of some level failed, 2 for a usage or startup error, 0 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import os
import platform
import random
import shlex
import signal
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from myserve.bench.images import IMAGE_MODES, with_images
from myserve.bench.launch import LaunchedServer
from myserve.bench.loadgen import RequestRecord, Target, first_model_id, make_client, run_level
from myserve.bench.metrics import LevelSummary, format_table, summarize
from myserve.bench.prompts import ENDPOINTS, DatasetError, Prompt, load_prompts

_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The benchmark command line (the ``plot`` subcommand has its own)."""
    p = argparse.ArgumentParser(
        prog="python -m myserve.bench",
        usage="%(prog)s [options] [-- SERVE_ARGS ...]\n"
        "       %(prog)s plot RESULTS.json [RESULTS.json ...] --output FIG.png",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (a trailing /v1 is fine)")
    p.add_argument("--model", help="model id to request (default: the first of GET /v1/models)")
    p.add_argument("--endpoint", choices=ENDPOINTS, default="chat", help="chat completions or completions")
    p.add_argument("--concurrency", type=_levels, default=[1, 8, 32, 64], help="sweep, e.g. 1,8,32,64")
    p.add_argument("--num-prompts", type=int, help="requests per level (default max(32, 4 x concurrency))")
    p.add_argument("--request-rate", type=_rate, default=math.inf, help="Poisson arrivals per s; inf = all at once")
    p.add_argument("--dataset", default="builtin", help='"builtin" or a JSONL file of {"prompt"} / {"messages"}')
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--images",
        choices=IMAGE_MODES,
        default="none",
        help="chat: one image per prompt, distinct per request (each encoded) or the same for all (cached)",
    )
    p.add_argument("--image-size", type=int, default=336, help="pixels per side of --images' images")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true (vLLM, llama-server, myserve)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--extra-body",
        type=_json_object,
        default={},
        help='JSON object merged into every request, e.g. \'{"response_format": {"type": "json_object"}}\'',
    )
    p.add_argument("--seed", type=int, help="sent as the request seed; also seeds Poisson arrivals (default 0)")
    p.add_argument("--api-key", help="sent as a Bearer token")
    p.add_argument("--label", help="this server's name in tables and plots (default: from the model id)")
    p.add_argument("--warmup", type=int, default=2, help="requests sent and discarded before the sweep")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request, whole stream")
    p.add_argument("--output", help="write results JSON here")
    p.add_argument("--plot", help="write a PNG of throughput and latencies vs concurrency here")
    p.add_argument("--launch", action="store_true", help="start python -m myserve.serve for the run, then stop it")
    p.add_argument("--launch-args", default="", help='serve arguments as one string, e.g. "--max-num-seqs 16"')
    p.add_argument("--launch-timeout", type=float, default=600.0, help="seconds to wait for the server's /health")
    args = p.parse_args(argv)
    if args.images != "none" and args.endpoint != "chat":
        p.error("--images needs --endpoint chat")
    if args.max_tokens < 1 or args.warmup < 0 or (args.num_prompts is not None and args.num_prompts < 1):
        p.error("--max-tokens and --num-prompts must be positive, --warmup not negative")
    return args


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be positive integers")
    return levels


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--extra-body must be a JSON object")
    return value


def _rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not rate > 0:
        raise argparse.ArgumentTypeError("the request rate must be positive (inf = closed loop)")
    return rate


def requests_per_level(num_prompts: int | None, concurrency: int) -> int:
    """``--num-prompts``, or enough requests to keep ``concurrency`` slots busy for a while."""
    return num_prompts if num_prompts is not None else max(32, 4 * concurrency)


def request_body(prompt: Prompt, args: argparse.Namespace, model: str) -> dict[str, Any]:
    """One streamed request's JSON body."""
    body: dict[str, Any] = {
        "model": model,
        **prompt.payload(args.endpoint),
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.seed is not None:
        body["seed"] = args.seed
    return {**body, **args.extra_body}


async def sweep(args: argparse.Namespace, target: Target, bodies: list[dict[str, Any]]) -> list[LevelSummary]:
    """Warm up, then run every concurrency level in turn over consecutive slices of ``bodies``."""
    from tqdm import tqdm

    rng = random.Random(args.seed or 0)
    async with make_client(max(args.concurrency) + args.warmup, args.timeout) as client:
        if args.warmup:
            warm = await run_level(client, target, bodies[: args.warmup], min(args.warmup, max(args.concurrency)))
            failed = [r for r in warm.records if not r.ok]
            if failed:
                print(
                    f"warning: {len(failed)}/{args.warmup} warmup requests failed: {_describe(failed[0])}",
                    file=sys.stderr,
                )
        offset, summaries = args.warmup, []
        for concurrency in args.concurrency:
            n = requests_per_level(args.num_prompts, concurrency)
            with tqdm(total=n, desc=f"concurrency {concurrency}", unit="req", file=sys.stderr) as bar:
                run = await run_level(
                    client,
                    target,
                    bodies[offset : offset + n],
                    concurrency,
                    args.request_rate,
                    rng,
                    on_done=lambda _: bar.update(1),
                )
            offset += n
            summaries.append(summarize(run))
    return summaries


def _describe(record: RequestRecord) -> str:
    return f"{record.error}: {record.error_detail[:300]}"


def machine_info() -> dict[str, Any]:
    """The client machine, without its hostname."""
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }


def redacted(argv: Sequence[str]) -> list[str]:
    """``argv`` with the value of ``--api-key`` hidden, so results files can be shared."""
    out, hide = [], False
    for arg in argv:
        if hide:
            out.append("***")
        elif arg.startswith("--api-key="):
            out.append("--api-key=***")
        else:
            out.append(arg)
        hide = arg == "--api-key"
    return out


def run_benchmark(args: argparse.Namespace, serve_args: list[str], argv: Sequence[str]) -> int:
    """The whole benchmark run for the parsed ``args`` of ``argv``; returns the exit code."""
    started = dt.datetime.now(dt.UTC)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with ExitStack() as stack:
        base_url = args.base_url.rstrip("/").removesuffix("/v1")
        if args.launch:
            server = stack.enter_context(LaunchedServer(serve_args, ready_timeout_s=args.launch_timeout))
            base_url = server.url
            print(f"launched {shlex.join(redacted(server.command))} at {base_url}", file=sys.stderr)
        model = args.model or first_model_id(base_url, headers)
        total = args.warmup + sum(requests_per_level(args.num_prompts, c) for c in args.concurrency)
        bodies = [request_body(p, args, model) for p in load_prompts(args.dataset, total, args.endpoint)]
        bodies = with_images(bodies, args.images, args.image_size)
        target = Target(base_url + _PATHS[args.endpoint], headers, args.timeout)
        summaries = asyncio.run(sweep(args, target, bodies))

    label = args.label or model.rstrip("/").rsplit("/", 1)[-1]
    results = [s.to_json() for s in summaries]
    print(format_table(results, title=f"{label} ({args.endpoint}, max_tokens={args.max_tokens}) at {base_url}"))
    doc = {
        "label": label,
        "base_url": base_url,
        "model": model,
        "endpoint": args.endpoint,
        "command": ["python", "-m", "myserve.bench", *redacted(argv)],
        "machine": machine_info(),
        "started_at": started.isoformat(timespec="seconds"),
        "finished_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "settings": {
            "max_tokens": args.max_tokens,
            "ignore_eos": args.ignore_eos,
            "temperature": args.temperature,
            "seed": args.seed,
            "extra_body": args.extra_body,
            "request_rate": None if math.isinf(args.request_rate) else args.request_rate,  # null = closed loop
            "num_prompts": args.num_prompts,  # null = max(32, 4 x concurrency) per level
            "concurrency": args.concurrency,
            "dataset": args.dataset,
            "warmup": args.warmup,
            "timeout_s": args.timeout,
            "launch_args": redacted(serve_args) if args.launch else None,
        },
        "results": results,
    }
    if args.output:
        Path(args.output).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    if args.plot:
        from myserve.bench.plot import plot_results

        plot_results([doc], args.plot)
    code = 0
    for s in summaries:
        if s.requests_ok == 0:
            reasons = "; ".join(f"{k} x{v}: {s.error_samples.get(k, '')[:200]}" for k, v in s.errors.items())
            print(f"error: every request at concurrency {s.concurrency} failed ({reasons})", file=sys.stderr)
            code = 1
    return code


def plot_main(argv: Sequence[str]) -> int:
    """``plot A.json [B.json ...] --output X.png``: one figure (and table) comparing saved runs."""
    p = argparse.ArgumentParser(prog="python -m myserve.bench plot", description="Compare saved results files.")
    p.add_argument("files", nargs="+", help="results JSON files written by --output")
    p.add_argument("--output", required=True, help="the figure to write (PNG)")
    p.add_argument("--title")
    args = p.parse_args(argv)
    from myserve.bench.plot import load_results, plot_results

    runs = load_results(args.files)
    for run in runs:
        print(
            format_table(run["results"], title=f"{run['label']} ({run.get('endpoint', '?')}) at {run.get('base_url')}")
        )
    plot_results(runs, args.output, title=args.title)
    print(f"wrote {args.output}")
    return 0


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # Unwinding (rather than dying) lets --launch stop its server in the ExitStack.
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = list(argv)
    try:
        if argv[:1] == ["plot"]:
            return plot_main(argv[1:])
        # Everything after a bare "--" goes to the launched server, unparsed.
        serve_args: list[str] = []
        if "--" in argv:
            cut = argv.index("--")
            argv, serve_args = argv[:cut], argv[cut + 1 :]
        args = parse_args(argv)
        serve_args = shlex.split(args.launch_args) + serve_args
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        return run_benchmark(args, serve_args, command)
    except (RuntimeError, DatasetError, ImportError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
