"""``python -m myserve.generate``: greedy generation for one prompt through the served step.

The program is ``myserve.entrypoints.generate``; this module keeps ``python -m myserve.generate`` working."""

import sys

from myserve.entrypoints.generate import main

if __name__ == "__main__":
    sys.exit(main())
