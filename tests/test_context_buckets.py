"""Context buckets (host only, milliseconds): warmup builds every token bucket at the widest
context bucket before ready (and on CPU the small ones at the narrowest too) and the rest in the
background; a step runs in the narrowest context bucket that holds its longest row and is built,
else in a wider one, never waiting."""

from __future__ import annotations

import dataclasses

from myserve.config import EngineConfig, load_config
from myserve.runtime.buckets import EARLY_TOKENS, FEW_SINGLES, Buckets, default_context_buckets
from myserve.runtime.sampling_rows import HEAD_MODES
from myserve.runtime.step_layout import Span

CFG = EngineConfig(
    page_size=16, max_num_seqs=8, max_num_batched_tokens=64, token_buckets=(1, 8, 64), context_buckets=(128, 512)
)
BUCKETS = Buckets.from_config(CFG, 2048)  # widths 128, 512 and 2048 tokens: 8, 32 and 128 pages
ACC = Buckets.from_config(CFG, 2048, platform="gpu")  # the same on an accelerator


def decode(pages: int) -> Span:
    return Span(token_ids=[5], start=pages * 16 - 1, pages=list(range(pages)), samples=True)


def test_warmup_builds_the_widest_now_and_the_narrower_in_the_background_narrowest_first() -> None:
    wide = dataclasses.replace(BUCKETS, early_tokens=0)  # an accelerator's: nothing narrow before ready
    now, later = wide.compile_ops()
    assert {s.width for s in now.shapes} == {128} and [s.tokens for s in now.shapes] == [1, 8, 64]
    assert now.heads and now.scores and not now.background
    assert later.background and [(s.width, s.tokens) for s in later.shapes] == [
        (8, 1), (8, 8), (8, 64), (32, 1), (32, 8), (32, 64)
    ]  # fmt: skip
    assert later.loops == ()
    # On CPU the token buckets up to EARLY_TOKENS at the narrowest bucket are urgent: the first
    # background builds, made whatever the engine does, so that a few streams' first decodes after
    # start run where a primed server's do.
    assert BUCKETS.early_tokens == EARLY_TOKENS == 8 and ACC.early_tokens == 0 and later.urgent == ()
    now, later = BUCKETS.compile_ops()
    assert [(s.width, s.tokens) for s in now.shapes] == [(128, 1), (128, 8), (128, 64)]
    assert [(s.width, s.tokens) for s in later.urgent] == [(8, 1), (8, 8)]
    assert [(s.width, s.tokens) for s in later.shapes] == [(8, 64), (32, 1), (32, 8), (32, 64)]
    _, with_loops = BUCKETS.compile_ops(decode_steps=4)
    assert with_loops.shapes == later.shapes and with_loops.loops
    # K = 1 builds decode calls too: a decode-only step is one call whatever K.
    _, one = BUCKETS.compile_ops(decode_steps=1)
    assert one.loops and {steps for _, steps, _ in one.loops} == {1}


def test_decode_calls_take_the_narrowest_built_width_that_holds_every_row() -> None:
    """Decode calls are built at every context bucket, narrowest first, for each row count and
    sampler mode (on an accelerator: CPU stops at 512 tokens, below); a call takes the narrowest
    built one that holds its longest page table (a one-row decode's attention reads the whole
    bucket each token)."""
    assert ACC.decode_widths == [8, 32, 128]
    _, later = ACC.compile_ops(decode_steps=4)
    loops = [(shape.width, shape.singles, steps, mode) for shape, steps, mode in later.loops]
    assert loops == [(w, r, 4, m) for w in (8, 32, 128) for r in (1, 8) for m in HEAD_MODES]
    assert all(shape.blocks == 0 and shape.tokens == shape.singles for shape, _, _ in later.loops)
    assert ACC.fit_decode([decode(3), decode(8)]) == ACC.decode_shape(8, 8)
    assert ACC.fit_decode([decode(9)]) == ACC.decode_shape(1, 32) == ACC.decode_shape(1)
    assert ACC.fit_decode([decode(33)]).width == 128 and ACC.fit_decode([decode(129)]) is None
    assert ACC.fit_decode([decode(2)] * 9) is None  # more rows than the largest decode call
    # Built in the background: none built, none fits; a wider built one serves a short context.
    assert ACC.fit_decode([decode(3)], lambda shape: False) is None
    only_one_row = {ACC.decode_shape(1, 8), ACC.decode_shape(8, 128)}
    assert ACC.fit_decode([decode(3)], lambda shape: shape in only_one_row) == ACC.decode_shape(1, 8)
    assert ACC.fit_decode([decode(3)] * 2, lambda shape: shape in only_one_row) == ACC.decode_shape(8, 128)
    assert ACC.fit_decode([decode(9)], lambda shape: shape in only_one_row) is None


def test_a_step_takes_the_narrowest_built_context_bucket_that_holds_it() -> None:
    short, medium = [decode(3), decode(2)], [decode(3), decode(20)]
    assert BUCKETS.fit(short).width == 8 and BUCKETS.fit(medium).width == 32  # all built
    assert BUCKETS.fit(short, lambda shape: False).width == 128  # none built yet: the widest
    only_medium = {BUCKETS.shape(8, 32)}
    assert BUCKETS.fit(short, lambda shape: shape in only_medium).width == 32
    assert BUCKETS.fit(medium, lambda shape: shape in only_medium).width == 32
    # Built per token bucket: a one-token step whose bucket is not yet built goes wider.
    assert BUCKETS.fit([decode(3)], lambda shape: shape in only_medium).width == 128
    assert BUCKETS.fit([decode(100)], lambda shape: True).width == 128


def test_one_context_bucket_builds_nothing_in_the_background() -> None:
    one = Buckets.from_config(EngineConfig(**{**CFG.__dict__, "context_buckets": (512,)}), 512)
    now, later = one.compile_ops()
    assert len(now.shapes) == 3 and later.count == 0


def test_default_context_buckets_start_at_128_tokens_on_cpu() -> None:
    """Null ``engine.context_buckets``: 512 tokens then x4 up to max_model_len, with 128- and
    256-token buckets first on CPU (where the attention's loop costs per chunk it reads)."""
    assert default_context_buckets(8192, "cpu") == (128, 256, 512, 2048, 8192)
    assert default_context_buckets(8192, "gpu") == default_context_buckets(8192, "tpu") == (512, 2048, 8192)
    assert default_context_buckets(300, "cpu") == (128, 256, 300)
    assert default_context_buckets(256, "cpu") == (128, 256)
    assert default_context_buckets(128, "cpu") == (128,) and default_context_buckets(100, "gpu") == (100,)
    unset = EngineConfig(**{**CFG.__dict__, "context_buckets": ()})
    assert Buckets.from_config(unset, 2048, platform="cpu").widths == (8, 16, 32, 128)
    assert Buckets.from_config(unset, 2048, platform="gpu").widths == (32, 128)
    assert Buckets.from_config(unset, 2048, platform="cpu").first_width == 32  # several-token calls: 512


def prompt(tokens: int, pages: int) -> Span:
    return Span(token_ids=[5] * tokens, start=0, pages=list(range(pages)), samples=True)


def test_a_step_of_few_sampling_rows_takes_the_bucket_variant_with_few_rows() -> None:
    """A token bucket with more single-view rows than ``FEW_SINGLES`` has a variant with fewer, and
    half the blocks (built in the background): a prompt's step samples one row and fills half the
    blocks, and each row and block of the full variant reads its context bucket, padding or not."""
    many = Buckets.from_config(EngineConfig(**{**CFG.__dict__, "max_num_seqs": 64}), 2048)
    assert many.decode_rows() == [1, 8, 64] and many.few_singles == FEW_SINGLES == 8
    full, few = many.shape(64, 8), many.shape(64, 8, few=True)
    assert (full.singles, few.singles) == (64, 8) and (full.tokens, full.blocks, few.blocks) == (few.tokens, 4, 2)
    assert many.variants(64, 8) == [few, full] and many.variants(8, 8) == [many.shape(8, 8)]

    now, later = many.compile_ops()
    assert [(s.width, s.tokens, s.singles) for s in now.shapes] == [(128, 1, 1), (128, 8, 8), (128, 64, 64)]
    assert [(s.width, s.tokens, s.singles) for s in later.urgent] == [(8, 1, 1), (8, 8, 8)]
    assert [(s.width, s.tokens, s.singles) for s in later.shapes] == [
        (8, 64, 8), (8, 64, 64), (32, 1, 1), (32, 8, 8), (32, 64, 8), (32, 64, 64), (128, 64, 8),
    ]  # fmt: skip

    one_prompt = [prompt(40, 3)]
    assert many.fit(one_prompt) == few  # all built
    assert many.fit(one_prompt, lambda shape: False) == many.shape(64, 128)  # none built: the widest, full
    assert many.fit(one_prompt, lambda shape: shape.singles == 64) == full  # the full ones built first
    with_decodes = [prompt(40, 3), *(decode(2) for _ in range(8))]  # nine sampling rows: the full variant
    assert many.fit(with_decodes) == full and many.fit(with_decodes[:8]) == few
    pooled = [dataclasses.replace(prompt(5, 1), samples=False, pool=(0, 5)) for _ in range(2)]
    assert many.fit([*pooled, *(decode(2) for _ in range(6))]) == few
    assert many.fit([*pooled, *(decode(2) for _ in range(7))]) == full  # a pooled span's row is its index
    # The variant holds the blocks of one 64-token chunk: three prompts' chunks round up to three.
    assert many.fit([prompt(60, 4)]) == few and many.fit([prompt(20, 2) for _ in range(3)]) == full


def test_decode_steps_default_to_eight_tokens_a_call_on_every_platform() -> None:
    """``engine.decode_steps`` 0 (the default, and the CPU deployment's): K = 8 on CPU, GPU and TPU
    (measured: docs/performance.md, "Tokens per decode call")."""
    from myserve.runtime.deployment import default_decode_steps

    assert {p: default_decode_steps(p) for p in ("cpu", "gpu", "tpu")} == {"cpu": 8, "gpu": 8, "tpu": 8}


def test_decode_calls_on_cpu_stop_at_512_tokens_and_the_default_deployment_stays_under_its_mapping_budget() -> None:
    """On an accelerator a decode call exists at every context bucket; on CPU up to 512 tokens: each
    XLA:CPU executable maps its kernels one by one (300-800 mappings for a step of the bundled
    model), and the process limit of 65,530 mappings stopped the default server's engine when it
    built decode calls at its 2048-token bucket too. The default deployment's executables, counted
    here, are what that budget holds."""
    unset = EngineConfig(**{**CFG.__dict__, "context_buckets": ()})
    assert Buckets.from_config(unset, 2048, platform="gpu").decode_widths == [32, 128]
    assert Buckets.from_config(unset, 2048, platform="cpu").decode_widths == [8, 16, 32]
    config = load_config(None, [])
    buckets = Buckets.from_config(config.engine, config.model.max_model_len, platform="cpu")
    now, later = buckets.compile_ops(8)
    assert [w * 16 for w in buckets.decode_widths] == [128, 512]
    # 8 forwards, 18 heads, 8 scorers before ready; 3 urgent forwards (the narrowest bucket's of 1,
    # 4 and 8 tokens), 28 more (narrower buckets, few-rows variants) and 36 decode calls after.
    assert (now.count, len(later.urgent), len(later.shapes), len(later.loops)) == (34, 3, 28, 36)
