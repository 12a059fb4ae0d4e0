"""Context buckets (host only, milliseconds): warmup builds every token bucket at the widest
context bucket before ready and the narrower ones in the background; a step runs in the narrowest
context bucket that holds its longest row and is built, else in a wider one, never waiting."""

from __future__ import annotations

from myserve.config import EngineConfig
from myserve.runtime.buckets import Buckets, default_context_buckets
from myserve.runtime.step_layout import Span

CFG = EngineConfig(
    page_size=16, max_num_seqs=8, max_num_batched_tokens=64, token_buckets=(1, 8, 64), context_buckets=(128, 512)
)
BUCKETS = Buckets.from_config(CFG, 2048)  # widths 128, 512 and 2048 tokens: 8, 32 and 128 pages


def decode(pages: int) -> Span:
    return Span(token_ids=[5], start=pages * 16 - 1, pages=list(range(pages)), samples=True)


def test_warmup_builds_the_widest_now_and_the_narrower_in_the_background_narrowest_first() -> None:
    now, later = BUCKETS.compile_ops()
    assert {s.width for s in now.shapes} == {128} and [s.tokens for s in now.shapes] == [1, 8, 64]
    assert now.heads and now.scores and not now.background
    assert later.background and [(s.width, s.tokens) for s in later.shapes] == [
        (8, 1), (8, 8), (8, 64), (32, 1), (32, 8), (32, 64)
    ]  # fmt: skip
    assert later.loops == ()
    _, with_loops = BUCKETS.compile_ops(decode_steps=4)
    assert with_loops.shapes == later.shapes and with_loops.loops  # the loops after the forwards


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
