"""The step cache: step executables stored by one start load on the next without tracing, serve
the same tokens, and a bad entry is rebuilt rather than trusted (``runtime/step_cache.py``)."""

from __future__ import annotations

import logging
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from myserve.errors import ConfigError
from myserve.runtime import executable_args as executor_module
from myserve.runtime.compile_counter import compile_counts, recent_builds
from myserve.runtime.step_cache import SUBDIRECTORY, StepCache, check_trusted_directory
from myserve.testing import TINY_ENGINE, collect, start_service
from myserve.wire.params import SamplingParams

PROMPTS = [[5, 9, 23, 42, 7], [100, 3, 3, 8], [17] * 20]


def greedy(service) -> list[list[int]]:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    return [collect(service.submit(p, params))[0] for p in PROMPTS]


class _NoTracing:
    def lower(self, *args: object) -> None:
        raise AssertionError("a step was traced although the step cache holds it")


@pytest.fixture(autouse=True)
def fresh_process() -> None:
    """Each start here stands for a new process: JAX's in-process cache would hand a compile the
    executable an earlier engine ran (the engine runs every executable once while idle), and
    XLA:CPU cannot serialize one that has run a sort, so it would not be stored."""
    jax.clear_caches()


def test_a_warm_start_loads_every_step_without_tracing_and_serves_the_same_tokens(
    tiny_checkpoints, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    engine = (*TINY_ENGINE, "engine.num_pages=64", f"engine.compilation_cache_dir={tmp_path}")
    cold = start_service(tiny_checkpoints["llama3"], *engine)
    try:
        expected = greedy(cold)
        assert cold.replicas[0].runner.device.background_builds_done(600)
    finally:
        cold.shutdown()
    entries = sorted((tmp_path / SUBDIRECTORY).iterdir())
    # Per token bucket (TINY_ENGINE: 1, 8, 64) a forward and a prompt scorer; per sampling-row
    # count (1, 8) the three sampler heads and (built in the background) the three decode calls;
    # the four small ops (the KV cache's zeros, page copy, penalty-slot clear and write).
    assert len(entries) == 3 + 3 + 2 * 3 + 2 * 3 + 4

    # The next start builds its steps early from abstract weights, as serve does: same keys.
    with monkeypatch.context() as patch:
        for name in ("forward_step", "head_step", "score_step", "decode_loop"):
            patch.setattr(executor_module, name, _NoTracing())
        before = compile_counts()
        warm = start_service(tiny_checkpoints["llama3"], *engine, prebuild=True)
        assert warm.replicas[0].runner.device.background_builds_done(600)
        compiled, loaded = (now - then for now, then in zip(compile_counts(), before, strict=True))
    try:
        # A warm start compiles nothing: every step, decode call and small op is loaded (JAX's
        # own cache is off beside the step cache).
        assert (compiled, loaded) == (0, 22), recent_builds(compiled)
        assert greedy(warm) == expected
    finally:
        warm.shutdown()

    assert stat.S_IMODE((tmp_path / SUBDIRECTORY).stat().st_mode) == 0o700
    assert {stat.S_IMODE(entry.stat().st_mode) for entry in entries} == {0o600}
    # Damaged entries: corrupt, truncated, empty: a warning each, then built and stored again.
    damaged = [b"not an executable", entries[1].read_bytes()[:1000], b""]
    for entry, data in zip(entries[:3], damaged, strict=True):
        entry.write_bytes(data)
    jax.clear_caches()  # (a new process: see ``fresh_process``)
    with caplog.at_level(logging.WARNING, logger="myserve.runtime.step_cache"):
        rebuilt = start_service(tiny_checkpoints["llama3"], *engine)
        assert rebuilt.replicas[0].runner.device.background_builds_done(600)  # (a damaged decode call's too)
    try:
        assert sum("unreadable" in r.getMessage() for r in caplog.records) == 3
        assert greedy(rebuilt) == expected
        assert all(entry.read_bytes() not in damaged for entry in entries[:3])
    finally:
        rebuilt.shutdown()


def test_two_starts_at_once_build_each_step_once_and_share_it(tiny_checkpoints, tmp_path: Path) -> None:
    """Two engines warming up the same steps at the same time over one cache directory (replicas on
    one host): each step is compiled by one of them and loaded by the other, not compiled twice."""
    engine = (*TINY_ENGINE, "engine.num_pages=64", f"engine.compilation_cache_dir={tmp_path}")
    before = compile_counts()
    with ThreadPoolExecutor(2) as pool:
        starts = [pool.submit(start_service, tiny_checkpoints["llama3"], *engine) for _ in range(2)]
        services = [start.result() for start in starts]
    try:
        assert all(s.replicas[0].runner.device.background_builds_done(600) for s in services)
        assert len(list((tmp_path / SUBDIRECTORY).iterdir())) == 12 + 6 + 4
        # The 12 steps and 6 decode calls each one start compiled and the other loaded (the small
        # ops, milliseconds each, are not claimed: both may compile them).
        assert compile_counts()[1] - before[1] >= 12 + 6
        assert greedy(services[0]) == greedy(services[1])
    finally:
        for service in services:
            service.shutdown()


def test_a_claim_excludes_other_builders_until_released(tmp_path: Path) -> None:
    cache = StepCache(tmp_path)
    held = cache.claim("entry", wait=False)
    assert held is not None
    assert cache.claim("entry", wait=False) is None  # another builder (another open file) must wait
    other = cache.claim("other entry", wait=False)
    assert other is not None
    held.release()
    again = cache.claim("entry", wait=True)
    assert again is not None
    again.release()
    other.release()
    assert list((tmp_path / SUBDIRECTORY).glob("*")) == []  # the lock files live outside the entries


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777])
def test_a_cache_directory_others_can_write_is_refused_in_one_line(tiny_checkpoints, tmp_path: Path, mode: int) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(ConfigError) as refused:
        start_service(tiny_checkpoints["llama3"], *TINY_ENGINE, f"engine.compilation_cache_dir={shared}")
    message = str(refused.value)
    assert "\n" not in message and str(shared) in message and f"chmod go-w {shared}" in message, message
    shared.chmod(0o755)  # ours, writable by us alone: trusted
    assert check_trusted_directory(shared) == shared


def test_a_step_cache_inside_others_can_write_or_a_writable_parent_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a" / SUBDIRECTORY).mkdir(parents=True)
    (tmp_path / "a" / SUBDIRECTORY).chmod(0o777)
    with pytest.raises(ConfigError, match=SUBDIRECTORY):
        check_trusted_directory(tmp_path / "a")
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    open_parent.chmod(0o777)  # anyone could rename the cache away and put their own in its place
    with pytest.raises(ConfigError, match="lies under"):
        check_trusted_directory(open_parent / "cache")
    open_parent.chmod(0o1777)  # sticky, as /tmp is: only the owner may rename what is inside
    made = check_trusted_directory(open_parent / "cache")
    assert made.is_dir() and stat.S_IMODE(made.stat().st_mode) == 0o700


def test_the_key_changes_with_every_argument_shape_dtype_sharding_and_static(tmp_path: Path) -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
    rep = NamedSharding(mesh, PartitionSpec())
    args = (jax.ShapeDtypeStruct((4, 8), np.float32, sharding=rep), np.zeros(3, np.int32))
    key = StepCache.key(("shape",), args)
    assert StepCache.key(("shape",), args) == key
    others = [
        StepCache.key(("other shape",), args),
        StepCache.key(("shape",), (jax.ShapeDtypeStruct((4, 16), np.float32, sharding=rep), args[1])),
        StepCache.key(("shape",), (jax.ShapeDtypeStruct((4, 8), np.float16, sharding=rep), args[1])),
        StepCache.key(("shape",), (jax.ShapeDtypeStruct((4, 8), np.float32), args[1])),
        StepCache.key(("shape",), (args[0], np.zeros(4, np.int32))),
        StepCache.key(("shape",), ((args[0],), args[1])),  # same leaves, another tree
    ]
    assert len({key, *others}) == len(others) + 1
    cache = StepCache(tmp_path)
    assert not cache.has(key) and cache.load(key, args, jax.tree_util.tree_structure(0), jax.devices()[:1]) is None
    assert StepCache.for_process(None) is None
