"""``myserve``: the command a pip install puts on the PATH, with vLLM's shape.

- ``myserve serve [MODEL] [flags]``: the OpenAI-compatible server (``python -m myserve.serve``);
  ``vllm serve``'s flags are read with vLLM's meaning (``vllm_flags``).
- ``myserve run-batch -i IN -o OUT [flags]``: an OpenAI batch file (``python -m myserve.run_batch``).
- ``myserve generate [flags]``: one completion on the command line (``python -m myserve.generate``).
- ``myserve --version``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

COMMANDS = {
    "serve": "the OpenAI-compatible server (vllm serve's flags)",
    "run-batch": "run an OpenAI batch file",
    "generate": "one completion on the command line",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to the subcommand; returns its exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print("usage: myserve {serve,run-batch,generate} ... | --version\n")
        for name, what in COMMANDS.items():
            print(f"  {name:10} {what}")
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        try:
            print(f"myserve {version('myserve')}")
        except PackageNotFoundError:
            print("myserve (not installed)")
        return 0
    command, rest = args[0], args[1:]
    if command == "serve":
        from myserve.entrypoints import serve

        return serve.main(rest, prog="myserve serve")
    if command == "run-batch":
        from myserve.entrypoints import run_batch

        return run_batch.main(rest)
    if command == "generate":
        from myserve.entrypoints import generate

        return generate.main(rest)
    print(f"myserve: unknown command {command!r}; one of: {', '.join(COMMANDS)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
