"""Executables' background builds, host only: a stopped engine leaves no build queued."""

from __future__ import annotations

import threading

from myserve.runtime.executables import BuildKey, Executables


def test_stopping_cancels_the_queued_builds_and_leaves_the_one_under_way_to_end() -> None:
    started, release = threading.Event(), threading.Event()
    calls: list[BuildKey] = []

    def build_one(key: BuildKey) -> str:
        calls.append(key)
        if key == ("score", 1):
            started.set()
            release.wait(10)
        return f"built {key[1]}"

    exe = Executables(lambda key: (None, (), ()), {}, (), None)
    exe._build_one = build_one  # type: ignore[method-assign]
    exe.build_in_background([("score", 1), ("score", 2), ("score", 3)])
    assert started.wait(10)
    pending = exe._pending[("score", 1)]
    exe.stop_background()  # returns at once: the build under way is not waited for
    assert not pending.done()
    release.set()
    assert pending.result(10) == "built 1"
    assert calls == [("score", 1)]  # the queued ones never started
    assert exe.ready(("score", 1)) and exe.get(("score", 1)) == "built 1"
    assert not exe.ready(("score", 2))
    assert exe.get(("score", 2)) == "built 2"  # a cancelled build is built on first use
    assert exe.background_done(0)
