"""XLA:CPU's dots single-threaded on small hosts (runtime/cpu_threads.py): host logic, no device."""

from __future__ import annotations

import pytest

from myserve.runtime.cpu_threads import FLAG, SMALL_HOST_CPUS, single_threaded_dots_on_small_hosts


def test_a_two_core_host_gets_single_threaded_dots_beside_the_flags_it_had() -> None:
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    assert single_threaded_dots_on_small_hosts(env, cpus=2, backends_started=False)
    assert env["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=2", FLAG]
    empty: dict[str, str] = {}
    assert single_threaded_dots_on_small_hosts(empty, cpus=1, backends_started=False)
    assert empty["XLA_FLAGS"] == FLAG


@pytest.mark.parametrize(
    ("flags", "cpus", "started"),
    [
        ("", SMALL_HOST_CPUS + 1, False),  # a bigger host: a large dot needs its threads
        ("--xla_cpu_multi_thread_eigen=true", 2, False),  # the user's choice, either way
        ("--xla_cpu_multi_thread_eigen=false", 2, False),
        ("", 2, True),  # JAX already started: too late, and the step cache would key a flag not used
    ],
)
def test_the_flags_are_left_alone(flags: str, cpus: int, started: bool) -> None:
    env = {"XLA_FLAGS": flags}
    assert not single_threaded_dots_on_small_hosts(env, cpus=cpus, backends_started=started)
    assert env == {"XLA_FLAGS": flags}


def test_this_test_process_started_jax_so_its_flags_stay() -> None:
    import jax

    jax.devices()  # (the backends of this worker start here if no test started them before)
    env = {"XLA_FLAGS": ""}
    assert not single_threaded_dots_on_small_hosts(env, cpus=1)
    assert env["XLA_FLAGS"] == ""
