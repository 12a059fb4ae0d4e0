"""The executables of a step, built once each: compiled, or loaded from the step cache, now or in
the background.

A step is up to three executables (``runtime/model_step.py``), and a several-token decode call is
a fourth kind; each is named by a ``BuildKey``. ``Executables`` builds what warmup lists (several
at once: loads from the step cache run on worker threads without tracing, and compiles overlap
tracing), starts the builds warmup defers (narrower context buckets, several-token calls) on one
background thread after serving begins, says which are done (``ready``: a step runs in a wider
context bucket until its narrower one is), and hands each step the executable it needs: built,
waited for if its background build is under way, or built on first use.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax

from myserve.runtime.background_builds import BackgroundBuilds
from myserve.runtime.compile_counter import count_loaded, thread_cache_hits
from myserve.runtime.kv_cache import Cache
from myserve.runtime.model_step import ForwardOutput
from myserve.runtime.sampler import SampleOutput
from myserve.runtime.step_cache import Claim, StepCache
from myserve.runtime.step_layout import StepShape
from myserve.runtime.step_ops import Progress

logger = logging.getLogger(__name__)

_COMPILE_THREADS = max(1, min(4, os.cpu_count() or 1))
"""Executables compiled (or loaded from the persistent cache) at once during warmup. Loading is
native work that mostly runs without the GIL: a warm start of the bundled model on the 2-core CPU
took 6.1-6.9 s of warmup with two threads against 7.3-7.9 s with one."""

BuildKey = tuple[Any, ...]
"""One executable: ``("forward", shape)``, ``("forward_images", shape)`` (a step holding image tokens),
``("head", sampling rows, mode)``, ``("score", tokens)`` or ``("loop", shape, steps, mode)``
(``runtime/model_step.py``)."""

Step = Callable[..., Any]
"""A compiled executable, called with its dynamic arguments."""

CallArgs = Callable[[BuildKey], tuple[Any, tuple[object, ...], tuple[object, ...]]]
"""(jitted function, static arguments, dynamic arguments or their stand-ins) of a key."""


class Executables:
    """The built executables of one executor, by ``BuildKey``."""

    def __init__(
        self,
        call_args: CallArgs,
        out_trees: dict[str, jax.tree_util.PyTreeDef],
        devices: tuple[jax.Device, ...],
        step_cache: StepCache | None,
    ):
        """``call_args`` gives what a key is traced with; ``out_trees`` each kind's output treedef
        (a step loaded from the step cache unflattens its outputs with it); ``devices`` the mesh's."""
        self._call_args = call_args
        self._out_trees = out_trees
        self._devices = devices
        self._step_cache = step_cache
        self.built: dict[BuildKey, Step] = {}
        self._pending: dict[BuildKey, Future[Step]] = {}
        self._background: BackgroundBuilds | None = None

    def get(self, key: BuildKey) -> Step:
        """The executable of ``key``: built, being built in the background (waited for), or built now."""
        step = self.built.get(key)
        if step is not None:
            return step
        if key in self._pending:
            self.want(key)  # (waited for: built next, whatever the engine is doing)
        pending = self._pending.pop(key, None)
        if pending is not None:
            t0 = time.perf_counter()
            step = self.built[key] = pending.result()
            logger.info("waited %.1fs for %s, built in the background", time.perf_counter() - t0, describe(key))
            return step
        # Not warmed up (tests, tools, a variant no warmup listed): built on first use.
        logger.info("building %s on first use", describe(key))
        step = self.built[key] = self._build_one(key)
        return step

    def ready(self, key: BuildKey) -> bool:
        """Whether ``key`` is built, without waiting (a finished background build counts)."""
        if key in self.built:
            return True
        pending = self._pending.get(key)
        if pending is None or not pending.done():
            return False
        self.built[key] = pending.result()
        self._pending.pop(key, None)  # a waiter on another thread (background_done) may pop it first
        return True

    def build_in_background(self, keys: Sequence[BuildKey], wanted: Collection[BuildKey] = ()) -> None:
        """Start building ``keys`` on a background thread, one at a time, in order and out of the
        way of serving (``background_builds``); a step that needs one first waits for it (``get``).
        Those also ``wanted`` go first, without waiting for idleness (``want``)."""
        todo = [key for key in keys if key not in self.built and key not in self._pending]
        if not todo:
            return
        if self._background is None:
            self._background = BackgroundBuilds(self._build_one)
        self._pending.update(self._background.submit(todo))  # type: ignore[arg-type]
        for key in todo:
            if key in wanted:
                self._background.want(key)

    def want(self, key: BuildKey) -> None:
        """Build ``key`` next and without waiting for idleness, if it is a background build not yet
        started (a step would run in it now, and runs in a slower one meanwhile)."""
        if self._background is not None and key in self._pending:
            self._background.want(key)

    def background_done(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the background builds; whether they are all done."""
        for key, future in list(self._pending.items()):
            try:
                self.built[key] = future.result(timeout)
            except TimeoutError:
                return False
            self._pending.pop(key, None)
        return True

    def stop_background(self) -> None:
        """Drop the background builds not yet started: a stopped engine leaves at most the build
        under way behind it. That one is not waited for (an XLA compile cannot be interrupted, and
        a core process exits without it)."""
        if self._background is not None:
            self._background.stop()
            self._background = None
        self._pending = {key: f for key, f in self._pending.items() if not f.cancelled()}

    def build(self, keys: Sequence[BuildKey], progress: Progress | None = None) -> dict[BuildKey, Step]:
        """The executables of ``keys``. One in the step cache is loaded on a worker thread without
        tracing. Otherwise tracing and lowering hold the GIL and run here, while compiling (or
        loading from JAX's persistent cache) runs on worker threads meanwhile, so a warm start
        takes about the loads' time rather than the sum of both."""
        built: dict[BuildKey, Step] = {}
        with ThreadPoolExecutor(_COMPILE_THREADS, thread_name_prefix="compile") as pool:
            futures = []
            busy: list[BuildKey] = []  # being built by another process sharing the step cache
            for wait, batch in ((False, keys), (True, busy)):  # those others build: waited for last
                for key in batch:
                    entry, args, cached = self._entry(key)
                    how = self._claimed(entry, cached, wait)
                    if how is None:
                        busy.append(key)
                        continue
                    futures.append((key, self._submit(pool, key, entry, args, *how), entry, args))
            for i, (key, future, entry, args) in enumerate(futures):
                step = future.result()
                if step is None:  # an entry that did not load: built as on a miss
                    step = self._compile(key, self._lowered(key), entry, args)
                built[key] = step
                if progress is not None:
                    progress(i + 1, len(futures))
        return built

    def _build_one(self, key: BuildKey) -> Step:
        """One executable while steps may run: loaded from the step cache, else compiled (and stored)."""
        entry, args, cached = self._entry(key)
        how = self._claimed(entry, cached, wait=True)
        assert how is not None
        cached, claim = how
        step = self._load(key, entry, args) if cached else None
        return step if step is not None else self._compile(key, self._lowered(key, claim), entry, args, claim)

    def _claimed(self, entry: str, cached: bool, wait: bool) -> tuple[bool, Claim | None] | None:
        """For an entry not ``cached``: the claim on building it, and whether another process
        stored it meanwhile (then it is loaded and the claim already released); None when another
        process is building it and ``wait`` is false."""
        cache = self._step_cache
        if cached or cache is None:
            return cached, None
        claim = cache.claim(entry, wait)
        if claim is None:
            return None
        if cache.has(entry):  # stored by the process whose claim this waited for
            claim.release()
            return True, None
        return False, claim

    def _submit(
        self,
        pool: ThreadPoolExecutor,
        key: BuildKey,
        entry: str,
        args: tuple[object, ...],
        cached: bool,
        claim: Claim | None,
    ) -> Future[Step | None]:
        """A load of a cached entry, or a compile of one traced here (holding ``claim``), on ``pool``."""
        if cached:
            return pool.submit(self._load, key, entry, args)
        return pool.submit(self._compile, key, self._lowered(key, claim), entry, args, claim)

    def _entry(self, key: BuildKey) -> tuple[str, tuple[object, ...], bool]:
        """(step-cache entry of ``key``, its dynamic arguments, whether the cache holds the entry)."""
        _, static, args = self._call_args(key)
        cache = self._step_cache
        entry = StepCache.key((key[0], *static), args) if cache is not None else ""
        return entry, args, cache is not None and cache.has(entry)

    def _lowered(self, key: BuildKey, claim: Claim | None = None) -> jax.stages.Lowered:
        """``key`` traced and lowered; a failure releases ``claim`` (no compile will, and other
        processes would wait for it as long as this one lives)."""
        fn, static, args = self._call_args(key)
        try:
            return fn.lower(*static, *args)
        except BaseException:
            if claim is not None:
                claim.release()
            raise

    def _load(self, key: BuildKey, entry: str, args: tuple[object, ...]) -> Step | None:
        assert self._step_cache is not None
        step = self._step_cache.load(entry, args, self._out_trees[key[0]], self._devices)
        if step is not None:
            count_loaded()
        return step

    def _compile(
        self,
        key: BuildKey,
        lowered: jax.stages.Lowered,
        entry: str,
        args: tuple[object, ...],
        claim: Claim | None = None,
    ) -> Step:
        """Compile ``lowered`` and store it in the step cache, then release ``claim`` (if held)."""
        try:
            hits = thread_cache_hits()
            compiled = lowered.compile()
            if self._step_cache is not None:
                if thread_cache_hits() == hits:
                    self._step_cache.store(entry, compiled, args, self._out_trees[key[0]])
                else:  # XLA:CPU serializes an executable it loaded without its code: never store one
                    logger.info("a step came from JAX's persistent cache: not stored in the step cache")
            return compiled
        finally:
            if claim is not None:
                claim.release()


def describe(key: BuildKey) -> str:
    """A key in words, for logs."""
    if key[0] in ("forward", "forward_images"):
        shape = key[1]
        assert isinstance(shape, StepShape)
        what = "forward step" if key[0] == "forward" else "forward step with images"
        return f"the {what} of {shape.tokens} tokens x {shape.width} pages"
    if key[0] == "head":
        return f"the {key[2]} head of {key[1]} rows"
    if key[0] == "loop":
        return f"the {key[3]} decode loop of {key[1].singles} rows x {key[2]} tokens"
    return f"the prompt scorer of {key[1]} tokens"


def out_trees(cache: Cache) -> dict[str, jax.tree_util.PyTreeDef]:
    """What each kind of executable returns with a cache like ``cache``, as treedefs (the stored
    executable's own treedef does not survive pickling)."""
    zeros = jax.tree.map(lambda _: 0, cache)
    return {
        "forward": jax.tree_util.tree_structure((ForwardOutput(0, 0, 0, 0, 0, 0), zeros)),  # type: ignore[arg-type]
        "forward_images": jax.tree_util.tree_structure((ForwardOutput(0, 0, 0, 0, 0, 0), zeros)),  # type: ignore[arg-type]
        "head": jax.tree_util.tree_structure((SampleOutput(0, 0, 0, 0), 0, 0)),  # type: ignore[arg-type]
        "score": jax.tree_util.tree_structure((0, 0, 0, 0)),
        "loop": jax.tree_util.tree_structure((SampleOutput(0, 0, 0, 0), zeros, 0, 0)),  # type: ignore[arg-type]
    }
