"""``python -m myserve.client``: ask a running server from the terminal.

    python -m myserve.client chat "What is the capital of France?"
    python -m myserve.client complete "Once upon a time" --max-tokens 64
    python -m myserve.client wait --timeout 300

``chat`` and ``complete`` stream the answer as it is generated (``--no-stream``: print it whole).
The server and key come from ``--base-url``/``--api-key`` or ``MYSERVE_BASE_URL``/``MYSERVE_API_KEY``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Sequence

from myserve.client.errors import ClientError
from myserve.client.setup import DEFAULT_URL
from myserve.client.sync_client import Client
from myserve.client.types import Chunk, Completion


def parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(prog="python -m myserve.client", description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default=os.environ.get("MYSERVE_BASE_URL", DEFAULT_URL))
    p.add_argument("--api-key", default=os.environ.get("MYSERVE_API_KEY"))
    p.add_argument("--model", help="a served model name (default: the server's first)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per connect and per read")
    commands = p.add_subparsers(dest="command", required=True)
    for name, what in (("chat", "a user message"), ("complete", "a prompt to continue")):
        c = commands.add_parser(name, help=f"{name}: stream the answer to {what}")
        c.add_argument("text", help=what)
        c.add_argument("--max-tokens", type=int, default=256)
        c.add_argument("--temperature", type=float)
        c.add_argument("--seed", type=int)
        c.add_argument("--no-stream", action="store_true", help="print the answer once whole")
        if name == "chat":
            c.add_argument("--system", help="a system message first")
    w = commands.add_parser("wait", help="return once /health answers 200")
    w.add_argument("--wait-timeout", type=float, default=120.0, help="seconds before giving up (exit 1)")
    return p


def _print_stream(chunks: Iterator[Chunk]) -> None:
    ended = None
    for chunk in chunks:
        # Each piece is written as it arrives: the terminal shows the answer being generated.
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        ended = chunk.finish_reason or ended
    sys.stdout.write("\n")
    if ended == "length":
        print("[cut at --max-tokens]", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; the exit status (1 after an error, printed to stderr)."""
    args = parser().parse_args(argv)
    with Client(args.base_url, api_key=args.api_key, model=args.model, timeout=args.timeout) as client:
        try:
            if args.command == "wait":
                client.wait_ready(args.wait_timeout)
                return 0
            extra = {} if args.seed is None else {"seed": args.seed}
            sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature)
            if args.command == "chat":
                if args.no_stream:
                    _print_whole(client.chat(args.text, system=args.system, **sampling, **extra))
                else:
                    _print_stream(client.chat_stream(args.text, system=args.system, **sampling, **extra))
            elif args.no_stream:
                _print_whole(client.complete(args.text, **sampling, **extra))
            else:
                _print_stream(client.complete_stream(args.text, **sampling, **extra))
        except (ClientError, TimeoutError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    return 0


def _print_whole(answer: Completion) -> None:
    print(answer.text)


if __name__ == "__main__":
    sys.exit(main())
