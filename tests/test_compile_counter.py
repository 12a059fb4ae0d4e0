"""Executables are counted once each, as compiled on a cold cache and as loaded on a warm one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PROGRAM = """
import json, sys
import jax, jax.numpy as jnp
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
from myserve.runtime.compile_counter import compile_count, compile_counts
x = jnp.ones(7)
before = compile_counts()
jax.jit(lambda v: jnp.sin(v) * 2)(x).block_until_ready()
jax.jit(lambda v: jnp.cos(v) + 1)(x).block_until_ready()
after = compile_counts()
print(json.dumps([after[0] - before[0], after[1] - before[1], compile_count()]))
"""


def test_cold_compiles_and_warm_cache_loads_are_told_apart(tmp_path: Path) -> None:
    def run() -> list[int]:
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        out = subprocess.run(
            [sys.executable, "-c", PROGRAM, str(tmp_path)], capture_output=True, text=True, env=env, check=True
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    compiled, loaded, total = run()
    assert (compiled, loaded) == (2, 0) and total >= 2
    compiled, loaded, total = run()
    assert (compiled, loaded) == (0, 2) and total >= 2  # each loaded executable counted once
