"""Environment for the test workers that run on several fake CPU devices (imported before JAX
initializes a backend): ``n`` host devices, and LLVM's lowest optimization level.

The workers serve tiny models, and their time is nearly all XLA compiles: at optimization level 0 a
mesh worker's three meshes of the tiny Llama took 23 s against 36 s (41 % less CPU). The tokens
compared are those of one worker's own meshes, all built at the same level."""

from __future__ import annotations

import os

FLAGS = "--xla_backend_optimization_level=0"


def use_fake_cpu_devices(n: int) -> None:
    """Make JAX (not yet initialized) see ``n`` CPU devices, compiling at the lowest level."""
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n} {FLAGS}"
    os.environ["JAX_PLATFORMS"] = "cpu"
