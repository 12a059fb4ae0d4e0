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


def test_recent_builds_name_the_function_and_the_thread() -> None:
    import threading

    import jax
    import jax.numpy as jnp

    from myserve.runtime.compile_counter import compile_count, recent_builds

    def an_odd_name_to_find(v: jax.Array) -> jax.Array:
        return jnp.tanh(v) * 3.25

    before = compile_count()
    thread = threading.Thread(target=lambda: jax.jit(an_odd_name_to_find)(jnp.ones(5)).block_until_ready(), name="t-x")
    thread.start()
    thread.join()
    built = recent_builds(compile_count() - before)
    assert ("jit(an_odd_name_to_find)", "t-x") in built
    assert recent_builds(0) == []
