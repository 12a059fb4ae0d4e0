"""``python -m myserve.run_batch -i requests.jsonl -o results.jsonl``: an OpenAI Batch API file, offline.

The program is ``myserve.entrypoints.run_batch``; this module keeps ``python -m myserve.run_batch`` working."""

import sys

from myserve.entrypoints.run_batch import main

if __name__ == "__main__":
    sys.exit(main())
