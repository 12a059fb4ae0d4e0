"""The runtime's contract with whoever plans its steps: a ``Device`` takes ops, hands back reads.

The core (``core/runner.py``) plans each step as plain data (``runtime/step_ops.py``, laid out by
``runtime/step_layout.py`` and ``runtime/sampling_rows.py``) and gives it to a ``Device``: an
``Executor`` on this process's mesh, a multi-host broadcaster in front of one, or a scripted fake
in the core's tests (``myserve.testing.FakeDevice``). ``run`` dispatches without waiting; the
step's outputs stay opaque handles (device arrays on a real device) until ``read`` brings the
numbers the host needs back in one transfer. Nothing here imports JAX.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from myserve.runtime.step_layout import StepShape
from myserve.runtime.step_ops import Op, Progress


class StepRead(NamedTuple):
    """A step's results on the host, per sampling row ``r`` (``N1`` rows) and flat token ``t`` (``T``)."""

    tokens: np.ndarray
    """int32 [N1]: the token each sampling row drew (rows past the step's samples are padding);
    [steps, N1] for a several-token decode call, as ``logprobs`` (and ``top_*``: [steps, N1, K])."""
    logprobs: np.ndarray
    """float32 [N1]: its log-probability under the raw model distribution."""
    top_ids: np.ndarray | None
    """int32 [N1, K]: each row's most likely tokens; None unless the read asked for them (``tops``)."""
    top_logprobs: np.ndarray | None
    """float32 [N1, K]: their log-probabilities, descending; None as ``top_ids``."""
    scores: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None
    """For scored prompt tokens: (logprob of the following token [T], top ids [T, K], top
    logprobs [T, K], the following token's rank [T], 1 = most likely); None unless the read asked
    for them (``scored``)."""
    pooled: np.ndarray | None = None
    """float32 [N1, embed]: each pooling row's summed hidden states; None unless asked (``pooled``)."""


class Device(Protocol):
    """Where a runner's ops run."""

    def run(self, ops: Sequence[Op], progress: Progress | None = None) -> list[Any]:
        """Apply ``ops`` in order, dispatched and not awaited; one output handle per ``StepCall``
        among them. ``progress(done, total)`` is told of each executable a ``CompileSteps`` builds."""
        ...

    def read(self, output: Any, *, tops: bool, scored: bool, pooled: bool = False) -> StepRead:
        """Wait for a step's output and bring its results to the host: the samples, their top
        logprobs when ``tops``, the prompt scores when ``scored``, the pooled rows when ``pooled``."""
        ...

    def background_builds_done(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the executables a background ``CompileSteps`` asked
        for; whether they are all built."""
        ...

    def stop_background_builds(self) -> None:
        """Cancel the background builds not yet started, without waiting for the one under way (at
        shutdown, so that no thread keeps compiling for a stopped engine)."""
        ...

    def memory_stats(self) -> list[dict[str, int]]:
        """Each device's allocator figures (``peak_bytes_in_use``, ``bytes_limit``); empty dicts, or
        none, where the platform reports none."""
        ...

    def step_ready(self, shape: StepShape) -> bool:
        """Whether the forward executable of ``shape`` is built, without waiting (one of a narrower
        context bucket is built in the background after ready)."""
        ...

    def loop_ready(self, shape: StepShape, steps: int) -> bool:
        """Whether the several-token decode executables of ``shape`` and ``steps`` are built for
        every sampler mode, without waiting (they are built in the background after ready)."""
        ...

    def want_step(self, shape: StepShape) -> None:
        """The forward of ``shape`` is what a step would run in now: if it is a background build
        not yet started, start it next, whatever the engine is doing."""
        ...
