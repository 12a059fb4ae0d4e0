"""Static step shapes: the token buckets, the context buckets, and the fixed parts of every step's layout.

A step runs the executable of the smallest token bucket that holds its tokens (and its one-token
rows and prefill blocks: ``StepShape.fits``), whatever its mix of prefill and decode, and of the
smallest context bucket that holds its longest page table: the attention's context loop has the
static length of the page tables' width (no data-dependent trip count: on a GPU each iteration
of such a loop is a host round trip). So each (token, context) pair is one executable of the
model; the sampler's are separate (``runtime/model_step.py``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from myserve.config import EngineConfig
from myserve.runtime.sampling_rows import HEAD_MODES
from myserve.runtime.step_layout import Span, StepShape, count
from myserve.runtime.step_ops import CompileSteps

BLOCK_TOKENS = 32
"""Query tokens per block of a prefill chunk in the attention (``ops/ragged_batch.py``): a
block's tokens share one gathered context, so larger blocks gather less but pad more."""

CHUNK_TOKENS = 128
"""Context tokens the attention reads per loop iteration (rounded to whole pages)."""


DEFAULT_FIRST_CONTEXT = 512
"""The narrowest default context bucket on accelerators (tokens), what most chat steps need; also
the least context of the several-token decode calls (``first_width``)."""

CPU_FIRST_CONTEXTS = (128, 256)
"""On CPU the default context buckets start with these: the attention's loop costs per chunk it
reads even where the chunk is padding, so a short prompt's prefill in a 512-token bucket cost the
yardstick twice its 128-token one, and a 150-token prompt's on 16 layers 70 ms in a 512-token
bucket against 44 in a 256-token one (``docs/performance.md``)."""


FEW_SINGLES = 8
"""Larger token buckets also have a variant with this many single-view rows (or the most of the
token buckets' row counts below it) and half the blocks: a step of one long prompt samples one row
and fills half the blocks, and the full variant's ``max_num_seqs`` rows and padding blocks each read
the whole context bucket (on the 16-layer yardstick a 200-token prompt's first token came in 56 ms
with 8 rows, 72 with 64; a 300-token prompt's in 49 ms with 16 blocks, 73 with 32)."""


def _powers_of_four(start: int, stop: int) -> tuple[int, ...]:
    values, v = [], start
    while v < stop:
        values.append(v)
        v *= 4
    return tuple(sorted({*values, stop}))


def default_context_buckets(max_model_len: int, platform: str) -> tuple[int, ...]:
    """``engine.context_buckets`` when null: ``DEFAULT_FIRST_CONTEXT`` tokens, then x4 up to
    ``max_model_len``; on CPU ``CPU_FIRST_CONTEXTS`` first (those below ``max_model_len``)."""
    contexts = _powers_of_four(DEFAULT_FIRST_CONTEXT, max_model_len)
    if platform == "cpu":
        contexts = (*(c for c in CPU_FIRST_CONTEXTS if c < max_model_len), *contexts)
    return contexts


def _powers(start: int, stop: int) -> tuple[int, ...]:
    values, v = [], start
    while v < stop:
        values.append(v)
        v *= 2
    return tuple(sorted({*values, stop}))


EARLY_TOKENS = 8
"""On CPU the forwards of the token buckets up to this many at the narrowest context bucket are the
first background builds after ready, made whatever the engine is doing (``CompileSteps.urgent``):
the decode steps of up to 8 streams run in them, so a short chat's first requests after start run
where a primed server's do. A prompt's bucket is wanted when a step needs it (``ModelRunner``).
Loading them before ready cost a warm start 0.7-1.6 s (6 of them, up to 64 tokens); all 6 as urgent
builds kept loading through the third request (~0.4 s each beside serving)."""


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The step shapes of one engine."""

    tokens: tuple[int, ...]
    """Token buckets, ascending; the largest is ``max_num_batched_tokens``."""
    max_num_seqs: int
    page_size: int
    max_pages: int
    """Pages of the longest sequence (``max_model_len``)."""
    block_tokens: int = BLOCK_TOKENS
    chunk_pages: int = 1
    widths: tuple[int, ...] = ()
    """Page-table widths (pages, multiples of ``chunk_pages``, ascending): the context buckets. The
    last holds ``max_pages``; empty: that one only."""
    decode_everywhere: bool = True
    """Decode calls at every context bucket (accelerators), else only up to ``first_width`` (CPU:
    ``decode_widths``)."""
    early_tokens: int = 0
    """Token buckets up to this many at the narrowest context bucket are urgent background builds
    (``EARLY_TOKENS`` on CPU; 0: none)."""

    @staticmethod
    def from_config(cfg: EngineConfig, max_model_len: int, min_tokens: int = 1, platform: str = "cpu") -> Buckets:
        """Buckets from the config: ``engine.token_buckets``, or powers of two up to the step budget;
        ``engine.context_buckets``, or ``default_context_buckets``.

        ``min_tokens``: steps are padded to at least this many tokens (int8 matmuls are slow below 8 rows).
        ``platform``: whose defaults a null ``max_num_batched_tokens`` or ``context_buckets`` means.
        """
        top = cfg.token_budget(platform)
        chosen = set(cfg.token_buckets) if cfg.token_buckets else set(_powers(1, top))
        floor = min(min_tokens, top)
        tokens = tuple(sorted({max(t, floor) for t in chosen if t < top} | {top}))
        chunk_pages = max(1, CHUNK_TOKENS // cfg.page_size)
        max_pages = math.ceil(max_model_len / cfg.page_size)
        full = -(-max_pages // chunk_pages) * chunk_pages
        contexts = cfg.context_buckets or default_context_buckets(max_model_len, platform)
        widths = {min(full, -(-math.ceil(c / cfg.page_size) // chunk_pages) * chunk_pages) for c in contexts}
        return Buckets(
            tokens=tokens,
            max_num_seqs=cfg.max_num_seqs,
            page_size=cfg.page_size,
            max_pages=max_pages,
            block_tokens=min(BLOCK_TOKENS, top),
            chunk_pages=chunk_pages,
            widths=tuple(sorted(widths | {full})),
            decode_everywhere=platform != "cpu",
            early_tokens=EARLY_TOKENS if platform == "cpu" else 0,
        )

    def _widths(self) -> tuple[int, ...]:
        return self.widths or (-(-self.max_pages // self.chunk_pages) * self.chunk_pages,)

    def shape(self, tokens: int, width: int | None = None, few: bool = False) -> StepShape:
        """The shape of one token bucket at one page-table width (None: the widest); ``few``: its
        variant with ``few_singles`` single-view rows and half the blocks (the blocks of one chunk
        as long as the bucket)."""
        shape = StepShape.of(
            tokens,
            max_num_seqs=self.max_num_seqs,
            block_tokens=self.block_tokens,
            max_pages=self._widths()[-1] if width is None else width,
            chunk_pages=self.chunk_pages,
        )
        if not few:
            return shape
        # The full shape holds twice the blocks its tokens fill (every chunk rounds up to whole
        # blocks); the variant holds what they fill, so a prompt's step does not pay for the rest.
        blocks = max(1, tokens // self.block_tokens) if shape.blocks else 0
        return dataclasses.replace(shape, singles=min(shape.singles, self.few_singles), blocks=blocks)

    @property
    def few_singles(self) -> int:
        """Single-view rows of the few-rows variants: the most of the token buckets' row counts up to
        ``FEW_SINGLES`` (a head is built for each of those counts), else the least of them."""
        rows = self.decode_rows()
        return max((r for r in rows if r <= FEW_SINGLES), default=rows[0])

    def variants(self, tokens: int, width: int) -> list[StepShape]:
        """The shapes of one token bucket at one width: its few-rows variant first, when it has more
        rows than that, then the full one."""
        full = self.shape(tokens, width)
        if full.singles <= self.few_singles:  # (buckets of few rows have no variant: fewer builds)
            return [full]
        return [self.shape(tokens, width, few=True), full]

    def shapes(self) -> list[StepShape]:
        """Every step shape: every token bucket at every context bucket, the narrowest first, each
        bucket's few-rows variant before its full one."""
        return [v for w in self._widths() for t in self.tokens for v in self.variants(t, w)]

    @property
    def first_width(self) -> int:
        """The narrowest context bucket of at least ``DEFAULT_FIRST_CONTEXT`` tokens (else the widest):
        the default width of ``decode_shape``."""
        widths = self._widths()
        least = -(-DEFAULT_FIRST_CONTEXT // self.page_size)
        return next((w for w in widths if w >= least), widths[-1])

    @property
    def decode_widths(self) -> list[int]:
        """The context buckets of the decode calls (``decode_loop``), narrowest first: on an
        accelerator every one, so that a decode-only step is one call whatever its context; on CPU
        those up to ``first_width`` (512 tokens). XLA:CPU maps each kernel of an executable into
        memory on its own (~3 mappings a kernel: 300-800 for a step of the bundled model's 30
        layers), a process may hold 65,530 mappings, and decode calls at all three of the CPU
        deployment's buckets took its engine past that (``LLVM ERROR: Unable to allocate section
        memory``). A call's attention reads its whole context bucket for each row and token, so a
        row whose context fits a narrower one decodes in it (16-layer yardstick, one row: 0.80 ms
        a token in a 128-token bucket, 1.12 in 512)."""
        widths = self._widths()
        return [w for w in widths if self.decode_everywhere or w <= self.first_width]

    def first_shapes(self) -> list[StepShape]:
        """Every token bucket at the first context bucket (``first_width``)."""
        return [self.shape(t, self.first_width) for t in self.tokens]

    def compile_ops(self, decode_steps: int | None = None, images: bool = False) -> tuple[CompileSteps, CompileSteps]:
        """Warmup's two builds. Before serving: the forward of every token bucket at the widest context
        bucket (every step fits it), every sampler mode for each bucket's sampling rows, and the prompt
        scorer of each token bucket. Then in the background: first, without waiting for the engine to be
        idle, the few-rows forwards of the token buckets up to ``early_tokens`` at the narrowest context
        bucket (``urgent``: what a few streams' decode steps run in); then, once the engine is idle, context
        bucket by context bucket, narrowest first: its forwards (the few-rows variants first; a step uses
        one once it is built, ``fit``), then with ``decode_steps`` (K >= 1; None: none) the decode calls of
        K tokens at it (``decode_loop``: every row count and sampler mode), which make a decode-only step
        one call (``fit_decode``). Narrowest first because short contexts are the common case and a narrow
        bucket serves them fastest: a new server's first chats get their fast path first. Start-up so pays
        for one context bucket. ``images``: a vision-language model's forwards with image embeddings too,
        before serving, at the widest context bucket only (a step holding image tokens runs there:
        ``ModelRunner.plan``)."""
        rows = self.decode_rows()
        heads = tuple((r, mode) for r in rows for mode in HEAD_MODES)
        widths = self._widths()
        first = tuple(self.shape(t, widths[-1]) for t in self.tokens)
        narrow = (self.variants(t, widths[0])[0] for t in self.tokens if t <= self.early_tokens)
        early = tuple(s for s in narrow if s not in first)
        now = CompileSteps(first, heads, tuple(self.tokens), images=first if images else ())
        built = first + early
        shapes: list[StepShape] = []
        loops: list[tuple[StepShape, int, str]] = []
        for w in widths:
            shapes += [v for t in self.tokens for v in self.variants(t, w) if v not in built]
            if decode_steps is not None and w in self.decode_widths:
                loops += [(self.decode_shape(r, w), decode_steps, mode) for r in rows for mode in HEAD_MODES]
        return now, CompileSteps(tuple(shapes), loops=tuple(loops), background=True, urgent=early)

    def decode_rows(self) -> list[int]:
        """The sampling-row counts of the token buckets (also the several-token calls' row counts)."""
        return sorted({shape.singles for shape in self.first_shapes()})

    def decode_shape(self, rows: int, width: int | None = None) -> StepShape:
        """A step of ``rows`` one-token rows and no blocks at context bucket ``width`` (by default
        ``first_width``): the shape of a decode call (``decode_loop``)."""
        width = self.first_width if width is None else width
        return dataclasses.replace(self.shape(rows, width), tokens=rows, singles=rows, blocks=0)

    def fit_decode(self, spans: Sequence[Span], usable: Callable[[StepShape], bool] | None = None) -> StepShape | None:
        """The decode call shape that holds ``spans`` (one-token rows only): the fewest rows, then
        the narrowest of ``decode_widths`` that holds the longest page table and is ``usable``
        (built: they are built in the background after ready); None when none does."""
        pages = max((len(s.pages) for s in spans), default=0)
        rows = next((r for r in self.decode_rows() if r >= len(spans)), None)
        if rows is None:
            return None
        for width in self.decode_widths:
            shape = self.decode_shape(rows, width)
            if width >= pages and (usable is None or usable(shape)):
                return shape
        return None

    @property
    def max_prefill_chunks(self) -> int:
        """Most multi-token chunks one step may hold so that the largest bucket always fits them
        (each chunk rounds up to whole blocks; see ``StepShape.of``)."""
        top = self.shape(self.tokens[-1])
        return top.blocks - top.tokens // top.block_tokens

    def fit(self, spans: Sequence[Span], usable: Callable[[StepShape], bool] | None = None) -> StepShape:
        """The smallest shape that holds ``spans``: token bucket, then the narrowest context
        bucket that holds the longest row and is ``usable`` (built: a narrower bucket is built in
        the background after ready, and until then a step runs in a wider one; the widest, built
        before ready, is always usable), its few-rows variant where that holds the step and is built."""
        need = count(spans, self.block_tokens)
        pages = max((len(s.pages) for s in spans), default=0)
        widths = [w for w in self._widths() if w >= pages]
        if not widths:
            raise ValueError(f"a step of {pages} pages per row exceeds the widest context bucket")
        for t in self.tokens:
            widest = self.shape(t, widths[-1])
            if not widest.fits(*need):
                continue
            for width in widths:
                for shape in self.variants(t, width):
                    if shape.fits(*need) and (shape == widest or usable is None or usable(shape)):
                        return shape
        raise ValueError(f"a step of {need} (tokens, one-token rows, blocks) exceeds the largest bucket")
