"""The served step executables hold no device-decided control flow: no ``conditional`` and no
``while`` whose trip count XLA does not know.

On a GPU, XLA runs such control flow from the host: it copies the predicate (or the loop's
condition) to the host and waits for it, so the host cannot plan step N+1 while the device runs
step N (``docs/design/runtime.md``). The host knows what a step needs and picks the executable
instead; these tests read the compiled executables the engine serves (XLA:CPU's HLO has the same
structure) so that such control flow cannot come back unnoticed.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from myserve.ops import tiled_decode
from myserve.runtime.deployment import Deployment, executor_for, step_buckets
from myserve.runtime.sampling_rows import HEAD_MODES

_WHILE = re.compile(r"\bwhile\(")
_CONDITIONAL = re.compile(r"\bconditional\(")


def device_decided_control_flow(hlo: str) -> list[str]:
    """The instructions of compiled HLO text that branch or loop on device data: every
    ``conditional``, and every ``while`` without a ``known_trip_count`` but the CPU's loop over
    the decode rows' tiles (``ops/tiled_decode.py``: a CPU decides it on the thread running the
    executable, no round trip; a GPU never runs it)."""
    bad = []
    for line in hlo.splitlines():
        tiles = jax.default_backend() == "cpu" and f"{tiled_decode.LOOP_SCOPE}/while" in line
        if _CONDITIONAL.search(line) or (_WHILE.search(line) and "known_trip_count" not in line and not tiles):
            bad.append(line.strip()[:200])
    return bad


def test_the_check_sees_a_conditional_and_a_data_dependent_loop() -> None:
    """The check itself can fail: a ``lax.cond`` on data and a ``fori_loop`` to a traced bound are
    caught; a loop of static length is not."""

    def branchy(x: jax.Array, n: jax.Array) -> jax.Array:
        y = lax.cond(x.sum() > 0, lambda: x * 2, lambda: x)
        return lax.fori_loop(0, n, lambda i, c: c + i, y)

    def static(x: jax.Array) -> jax.Array:
        return lax.fori_loop(0, 5, lambda i, c: c * 1.5 + i, x)

    bad = device_decided_control_flow(jax.jit(branchy).lower(jnp.ones(4), 3).compile().as_text())
    assert any("conditional(" in line for line in bad) and any("while(" in line for line in bad)
    assert device_decided_control_flow(jax.jit(static).lower(jnp.ones(4)).compile().as_text()) == []


def test_every_executable_the_tiny_engine_serves(tiny_service) -> None:
    """After warmup: every forward, every head mode, every prompt scorer; the forward of a wider
    context bucket than the engine's (its attention loop is longer, still static); and the
    several-token decode call of every mode."""
    executor = tiny_service.replicas[0].runner.device
    built = executor.executables()
    kinds = {key[0] for key in built}
    # Decode calls ("loop") are built in the background after warmup: some may exist by now.
    assert {"forward", "head", "score"} <= kinds <= {"forward", "head", "score", "loop"}
    assert {key[2] for key in built if key[0] == "head"} == set(HEAD_MODES)
    buckets = tiny_service.replicas[0].runner.buckets
    wide = buckets.shape(8, 4 * buckets.shape(8).width)
    texts = {key: step.as_text() for key, step in built.items()}
    texts[("forward", wide)] = executor.lower(("forward", wide)).compile().as_text()
    for mode in HEAD_MODES:  # several-token decode calls (engine.decode_steps): a loop of static length
        key = ("loop", buckets.decode_shape(8), 4, mode)
        texts[key] = executor.lower(key).compile().as_text()
    for key, text in texts.items():
        assert device_decided_control_flow(text) == [], key
    # The attention's context loops are in the forward, as loops of known length.
    assert "known_trip_count" in texts[("forward", wide)]


@pytest.mark.parametrize("arch", ["qwen3_moe", "gemma2"])
def test_the_moe_experts_and_sliding_windows(tiny_checkpoints, arch: str) -> None:
    """A MoE model's expert tiles and a Gemma 2 model's sliding windows and soft caps, in a
    decode step and a prefill step."""
    from myserve.bundled import bundled_gguf_path
    from myserve.config import load_config
    from myserve.testing import TINY_ENGINE

    config = load_config(
        None,
        [
            "model.dtype=float32",
            f"model.checkpoint={tiny_checkpoints[arch]}",
            f"model.tokenizer={bundled_gguf_path()}",
            *TINY_ENGINE,
        ],
    )
    deployment = Deployment.load(config)
    executor = executor_for(config, deployment.models[0], deployment.meshes[0], deployment.mapping)
    buckets = step_buckets(config, deployment.max_model_len)
    for tokens in (1, 64):
        text = executor.lower(("forward", buckets.shape(tokens))).compile().as_text()
        assert device_decided_control_flow(text) == [], tokens
