"""``python -m myserve.serve``: the OpenAI-compatible server. No arguments: bundled SmolLM2 on 127.0.0.1:8000.

The program is ``myserve.entrypoints.serve``; this module keeps ``python -m myserve.serve`` working."""

import sys

from myserve.entrypoints.serve import main

if __name__ == "__main__":
    sys.exit(main())
