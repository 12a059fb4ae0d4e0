"""The dtype ``auto`` picks on a CPU: bfloat16 where the CPU computes bfloat16 dots natively.

XLA:CPU's bfloat16 dots run on AVX512-BF16 (``vdpbf16ps``) where the CPU has it, and there they beat
float32 once a product has two rows: a SmolLM2-shaped stack of its 30 layers' matmuls and its head,
single-threaded on the reference machine (a 2-core Xeon with AVX512-BF16), 48 against 81 ms at 32
rows and 72 against 112 at 64; served over HTTP, 64 chat streams of the bundled model decoded 1.9x
faster (docs/performance.md, "bfloat16 on CPUs that compute it"). Without the instructions XLA
emulates bfloat16 through float32 conversions and float32 is the faster choice, as before.

A one-row bfloat16 product is the exception (Eigen's matrix-vector kernel: a one-row head 45.7
against 5.0 ms in float32); ``models/dense_dot.py`` computes those as two rows.

A checkpoint that declares float32 (its config.json) keeps float32: its numbers are the ones its
author asked for, as the host-bound yardsticks' random float32 checkpoints compared against
llama-server on the same float32 weights. A bfloat16 or float16 checkpoint, or a file that declares
none (a GGUF's quantized blocks), computes in bfloat16 there, as vLLM's CPU backend does.
"""

from __future__ import annotations

import functools
from pathlib import Path

NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
"""``/proc/cpuinfo`` flags of x86 CPUs whose bfloat16 dot products XLA:CPU runs natively."""


@functools.cache
def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first CPU's feature flags from ``cpuinfo`` (empty where the file is absent: macOS, Windows)."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def native_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether this host's CPU computes bfloat16 dots natively (``flags``: as ``cpu_flags`` reads them)."""
    return bool(NATIVE_BF16_FLAGS & (cpu_flags() if flags is None else flags))


def cpu_auto_dtype(declared: str | None, flags: frozenset[str] | None = None) -> str:
    """``auto``'s dtype on a CPU for a checkpoint that declares ``declared`` (None: says none)."""
    return "bfloat16" if native_bf16(flags) and declared != "float32" else "float32"
