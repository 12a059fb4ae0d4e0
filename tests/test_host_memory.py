"""``keep_freed_memory``: a large block comes from malloc's heap (reused after free), not from a
fresh mmap that is faulted in again on every allocation.

Run in a subprocess: the setting is process-wide and irreversible.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROBE = """
import ctypes, ctypes.util, json
import numpy as np
from myserve.runtime.host_memory import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallInfo2

def mmapped_while_alive() -> int:
    # 48 MB: above glibc's largest mmap threshold (32 MiB), like a 64-row sampler's temporaries.
    block = np.ones(12_000_000, np.float32)
    mmapped = libc.mallinfo2().hblkhd
    del block
    return mmapped

default = mmapped_while_alive()
applied = keep_freed_memory()
kept = mmapped_while_alive()
print(json.dumps([applied, default, kept]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_large_blocks_come_from_the_heap_once_kept() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True)
    applied, default, kept = json.loads(out.stdout)
    assert applied
    assert default >= 48_000_000, "by default a 48 MB block is its own mmap"
    assert kept < 48_000_000, "kept: it comes from the heap, where a freed block is reused"
