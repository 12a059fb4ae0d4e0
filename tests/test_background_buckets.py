"""The narrower context buckets and the few-rows variants built after ready, on the real engine and
the tiny random Llama: requests served while they build (in the widest bucket, every row) give the
tokens they give once built (in the narrowest that holds them, with 8 single-view rows where a step
samples no more), and a second start loads them from the step cache in the background while its
first steps run."""

from __future__ import annotations

import threading
import time

from myserve.testing import TINY_ENGINE, collect, start_service
from myserve.wire.params import SamplingParams

# A 64-token context bucket below the 512-token widest; 16 rows, so the 64-token bucket has a variant
# of 8 rows (``FEW_SINGLES``).
ENGINE = (
    *[s for s in TINY_ENGINE if not s.startswith(("engine.context_buckets", "engine.max_num_seqs"))],
    "engine.context_buckets=[64]",
    "engine.max_num_seqs=16",
)
PROMPTS = [[(5 * i + 7 * j) % 200 + 3 for j in range(4 + 9 * i)] for i in range(6)]  # 4-49 tokens
MANY = [[(3 * i + 11 * j) % 200 + 3 for j in range(4)] for i in range(12)]  # 12 decodes: the full 16 rows


def serve(service) -> list[list[int]]:
    out = []
    for prompts in (PROMPTS, MANY):
        streams = [service.submit(p, SamplingParams(max_tokens=10, temperature=0.0)) for p in prompts]
        out += [collect(s)[0] for s in streams]
    return out


def widths_run(service) -> set[int]:
    return {s.width for s in service.replicas[0].runner._usable}


def rows_run(service) -> set[tuple[int, int]]:
    """(tokens, single-view rows) of the shapes steps ran in."""
    return {(s.tokens, s.singles) for s in service.replicas[0].runner._usable}


def test_steps_before_and_after_the_narrower_buckets_are_built_give_the_same_tokens(tiny_checkpoints) -> None:
    for start in ("first", "second"):  # the second start loads from the step cache the first stored
        service = start_service(tiny_checkpoints["llama3"], *ENGINE)
        try:
            runner = service.replicas[0].runner
            early = serve(service)  # while the 64-token bucket builds (or loads) in the background
            assert runner.device.background_builds_done(600), start
            late = serve(service)
            assert early == late, start
            narrow, widest = runner.buckets.widths  # (the attention's chunks round 64 tokens up)
            assert widths_run(service) == {narrow}, "the steps now run in the narrow bucket"
            assert {(64, 8), (64, 16)} <= rows_run(service), "both variants of the 64-token bucket"
            built = {k[1].width for k in runner.device.executables() if k[0] == "forward"}
            assert built == {narrow, widest}, start
        finally:
            service.shutdown()


def test_an_idle_engine_runs_every_built_executable_once(tiny_checkpoints) -> None:
    """Warmup builds without running, and an executable's first run costs far more than the next
    (XLA:CPU links its kernels then): the idle engine runs each one once (``PrimeSteps``), those
    built in the background too, and requests served meanwhile are unharmed."""
    service = start_service(tiny_checkpoints["llama3"], *ENGINE, "engine.decode_steps=4")
    try:
        runner = service.replicas[0].runner
        executor = runner.device
        served = serve(service)  # while the engine primes between requests
        assert runner.device.background_builds_done(600)
        deadline = time.monotonic() + 120
        while runner._to_prime and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not runner._to_prime, "every executable primed"
        assert set(executor.executables()) <= executor.ran
        assert {key[0] for key in executor.ran} == {"forward", "head", "score", "loop"}
        assert serve(service) == served
    finally:
        service.shutdown()


def test_the_small_narrow_forwards_are_the_first_background_builds_and_do_not_wait(tiny_checkpoints) -> None:
    """On CPU the forwards of the token buckets up to ``EARLY_TOKENS`` at the narrowest context
    bucket are *urgent*: the first background builds after ready, wanted, so they do not wait for
    the engine to be idle (a few streams' first decodes after start run in them). An engine kept
    busy gets them well within the 10 s the other builds wait."""
    from myserve.runtime.buckets import EARLY_TOKENS

    service = start_service(tiny_checkpoints["llama3"], *ENGINE)
    try:
        runner = service.replicas[0].runner
        compiled = runner.device.compiled
        _, later = runner.compile_ops()
        assert [s.tokens for s in later.urgent] == [t for t in (1, 8, 64) if t <= EARLY_TOKENS] == [1, 8]
        assert {s.width for s in later.urgent} == {runner.buckets.widths[0]}
        urgent = [("forward", s) for s in later.urgent]
        assert list(compiled._pending)[: len(urgent)] == urgent  # queued first
        # Keep the engine busy (two requests always in flight): a spell of serving holds the other
        # background builds back for 10 s, not the urgent ones.
        stop = threading.Event()

        def load() -> None:
            params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
            while not stop.is_set():
                a = service.submit(PROMPTS[1], params)
                b = service.submit(PROMPTS[2], params)
                collect(a), collect(b)

        busy = threading.Thread(target=load, daemon=True)
        busy.start()
        try:
            deadline = time.monotonic() + 8
            while not all(compiled.ready(k) for k in urgent) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert all(compiled.ready(k) for k in urgent), "the urgent builds waited for idleness"
            # (A wider bucket's forward: the steps here fit the narrowest, so none wants it.)
            held = ("forward", next(s for s in later.shapes if s.width != runner.buckets.widths[0]))
            assert not compiled.ready(held), "a build that is not urgent started while the engine served"
        finally:
            stop.set()
            busy.join(60)
        assert runner.device.background_builds_done(600)
    finally:
        service.shutdown()
