"""The ops a device step is made of: plain data the core builds and the runtime applies.

Everything the device does is described here, as msgspec Structs of numpy arrays and ints: which
pages to copy, which penalty slots to fill, which step executables to build, and each model
call's packed host arrays. The core's runner builds them (``core/runner.py``); an ``Executor``
applies them (``runtime/executor.py``); a multi-host leader sends them to its followers as typed
data (``runtime/step_channel.py``). This module imports no JAX, so the core plans steps without it.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import numpy as np

from myserve.runtime.step_layout import StepShape

SLOT_CHUNK = 256
"""Token ids written into a penalty slot per ``WriteSlot``."""


class CopyPage(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """Copy one page's K/V in every layer and head (copy-on-write of a shared prompt's last page)."""

    src: int
    dst: int


class SavePages(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """Copy device pages to host-tier slots (``runtime/host_kv.py``): prefix pages the pool evicts,
    before the step that reuses them writes them."""

    pages: np.ndarray
    """int32 [n]: the device pages."""
    slots: np.ndarray
    """int32 [n]: the host slot each goes to."""


class LoadPages(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """Fill device pages from host-tier slots: a prefix found in host memory, instead of computed."""

    slots: np.ndarray
    """int32 [n]: the host slots."""
    pages: np.ndarray
    """int32 [n]: the device page each fills."""


class ClearSlot(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """Reset a penalty slot."""

    slot: int


class WriteSlot(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """Record ``ids[:n]`` (int32 [SLOT_CHUNK]) in a penalty slot: prompt tokens, or generated ones."""

    slot: int
    ids: np.ndarray
    n: int
    to_prompt: bool


class CompileSteps(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """Build step executables (warmup): the forward of each shape, the head of each (sampling rows,
    mode) and the prompt scorer of each token count. Every process of a multi-host run builds the
    same ones, so the ops it replays later find them. ``background``: start building them and
    return at once (a step that needs one before it is built waits for it)."""

    shapes: tuple[StepShape, ...]
    heads: tuple[tuple[int, str], ...] = ()
    scores: tuple[int, ...] = ()
    loops: tuple[tuple[StepShape, int, str], ...] = ()
    """Several-token decode calls: (one-token-rows shape, tokens per call, sampler mode)."""
    background: bool = False
    images: tuple[StepShape, ...] = ()
    """Forwards that take image embeddings (a vision-language model's steps holding image tokens)."""
    urgent: tuple[StepShape, ...] = ()
    """With ``background``: forwards built first, without waiting for the engine to be idle (the
    first requests after start run in them)."""

    @property
    def count(self) -> int:
        """Executables this op builds."""
        forwards = len(self.urgent) + len(self.shapes) + len(self.images)
        return forwards + len(self.heads) + len(self.scores) + len(self.loops)


class StepCall(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """One engine step: the model over a ragged token batch, then the sampler, then (when asked)
    the prompt scores (``runtime/model_step.py``)."""

    batch: np.ndarray
    """int32, the step's tokens and attention metadata packed by ``HostStep.pack``."""
    shape: StepShape
    """The step's token and context buckets: which forward executable runs it."""
    ints: np.ndarray
    """``SamplingRows.ints`` [N1, ...]."""
    floats: np.ndarray
    """``SamplingRows.floats`` [N1, ...]."""
    bitmask: np.ndarray | None = None
    """int32 [R, ceil(V / 32)]: the grammar masks of the step's R constrained rows; None when no row
    is constrained (the executor passes its own all-ones mask)."""
    mask_rows: np.ndarray | None = None
    """int32 [R]: which sampling rows ``bitmask`` masks. Only constrained rows travel (to the
    device, and to a multi-host deployment's followers): V / 8 bytes each, 16 KiB at a 128k vocabulary."""
    mode: str = "argmax"
    """The sampler executable (``sampling_rows.HEAD_MODES``), chosen by the host from the rows."""
    score: bool = False
    """Some span scores prompt positions: the prompt scorer runs after the step."""
    steps: int = 0
    """0: the forward, then the head (and the scorer); K >= 1: a decode call (``decode_loop``: the
    forward, head and sampler in one executable) of K iterations; ``shape`` is then one of one-token
    rows only, and each row decodes its own ``STEPS`` tokens of them."""
    weights: int = 0
    """The weight slot the step runs on (two while a new version of the weights replaces the old
    one: ``core/engine_weights.py``)."""
    images: np.ndarray | None = None
    """float32 [T, embed]: the vision tower's embeddings of the step's image tokens, at their flat
    positions (zeros elsewhere); None when the step holds none (``("forward_images", shape)`` runs it)."""
    image_ends: np.ndarray | None = None
    """int32 [T]: for a flat token taking its embedding from ``images``, the position after its
    image's last token (what a token of an image attending both ways sees, Gemma 3's); 0 elsewhere."""
    image_rope: np.ndarray | None = None
    """int32 [3, T]: added to the M-RoPE streams of the step's image chunks' tokens (an image
    token's row and column; the tokens after an image within its chunk); zeros elsewhere."""


class WriteAdapter(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """Write a LoRA adapter into a device slot of every layer's stacks (``models/lora.py``):
    ``arrays`` is ``LoraAdapter.flat()``, every layer's fields in order (same shapes each time)."""

    slot: int
    arrays: tuple[np.ndarray, ...]


class PrimeSteps(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """Run once, on an empty batch, each executable of ``steps`` that is built and has never run.
    An executable's first run costs far more than the next ones (on XLA:CPU 0.1-0.3 s for a step
    of the 16-layer yardstick, loaded from the step cache or compiled: its kernels are linked
    then), and warmup builds without running; the engine primes them while it is idle, so that no
    request pays for it. The empty batch writes no KV (padding writes are dropped), counts in the
    scratch penalty slot only, and feeds nothing: the real ``fed`` is left as it is."""

    steps: CompileSteps

    def units(self) -> list[PrimeSteps]:
        """One ``PrimeSteps`` per executable, in ``steps``' order (forwards, urgent first; heads, scorers,
        loops, image forwards)."""
        s = self.steps
        return [
            *(PrimeSteps(CompileSteps((shape,))) for shape in (*s.urgent, *s.shapes)),
            *(PrimeSteps(CompileSteps((), heads=(head,))) for head in s.heads),
            *(PrimeSteps(CompileSteps((), scores=(tokens,))) for tokens in s.scores),
            *(PrimeSteps(CompileSteps((), loops=(loop,))) for loop in s.loops),
            *(PrimeSteps(CompileSteps((), images=(shape,))) for shape in s.images),
        ]


Op = CopyPage | SavePages | LoadPages | ClearSlot | WriteSlot | WriteAdapter | CompileSteps | PrimeSteps | StepCall
"""The ops are msgspec Structs, tagged by class name, so that a multi-host leader sends them to its
followers as typed data (``runtime/step_channel.py``), never as pickle."""


Progress = Callable[[int, int], None]
"""``progress(done, total)``: told of each step executable built."""
