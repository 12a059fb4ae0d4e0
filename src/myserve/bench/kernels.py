"""``python -m myserve.bench.kernels``: each GPU kernel against its reference on this device.

The kernels of issue 46 (``ops/gpu_ragged_attention.py``, ``ops/gpu_grouped_matmul.py``) at the
shapes the benchmarks serve (Llama-3.2-1B's attention at a 4,096-token context, ``moe-1b``'s experts,
a 1B-sized narrow projection), each case run through the kernel and through the path it would
replace (the reference attention, the experts' loop, XLA's dequantize-then-dot), jitted, in
bfloat16: the largest absolute difference (and relative to the reference's largest value) and the
median time of each. One table on stdout, JSON at ``--output``.

On a CPU it runs tiny shapes by itself, the kernels in Pallas's interpreter: a check that the
command works, not a speed. It needs no model nor tokenizer (``--tokenizer DIR`` is accepted, as
``bench.device`` takes it, so that a device script passes both the same flags).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from myserve.bench.device_worker import median_s
from myserve.ops import gpu_grouped_matmul, gpu_ragged_attention
from myserve.ops.attention import _view_attention
from myserve.ops.dequant import StackedNarrow, dequantize
from myserve.ops.moe import expert_mlp, route
from myserve.ops.paged_cache import KVCache
from myserve.ops.ragged_batch import AttentionView


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The shapes of one mode."""

    heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    context: int
    rows: int
    block: int
    hidden: int
    expert_width: int
    experts: int
    top_k: int
    dense_in: int
    dense_out: int


FULL = Sizes(32, 8, 64, 16, 4096, 64, 32, 1024, 576, 32, 4, 2048, 8192)
TINY = Sizes(4, 2, 16, 4, 64, 4, 8, 64, 32, 8, 2, 64, 128)


def _compare(name: str, reference: Callable[..., Any], kernel: Callable[..., Any], args: tuple, n: int) -> dict:
    """One case: both paths jitted on ``args``; their difference and times."""
    ref, ker = jax.jit(reference), jax.jit(kernel)
    want, got = (np.asarray(f(*args), np.float32) for f in (ref, ker))
    top = float(np.abs(want).max())
    diff = float(np.abs(got - want).max())
    return {
        "case": name,
        "max_abs_diff": diff,
        "relative_diff": diff / top if top else None,
        "reference_s": median_s(ref, *args, n=n),
        "kernel_s": median_s(ker, *args, n=n),
    }


def _attention_cases(s: Sizes, rng: np.random.RandomState, n: int) -> list[dict]:
    """Decode rows at a full context (many rows; one row, split K) and a prompt's blocks."""
    width = s.context // s.page_size
    pages = s.rows * width + 1
    keys = jax.random.split(jax.random.key(int(rng.randint(1 << 30))), 2)
    shape = (1, s.kv_heads, pages, s.page_size, s.head_dim)
    cache = KVCache.of([jax.random.normal(key, shape, jnp.bfloat16) for key in keys])
    scale = s.head_dim**-0.5

    def view(rows: int, queries: int, last: int) -> tuple[AttentionView, jax.Array]:
        """``rows`` rows of ``queries`` consecutive queries ending at position ``last`` (each row its
        own pages), and the flat queries [rows * queries + 1, heads, D] they gather."""
        t = rows * queries
        idx = jnp.arange(t, dtype=jnp.int32).reshape(rows, queries)
        first = last + 1 - queries * (jnp.arange(rows, dtype=jnp.int32)[::-1] + 1) if queries > 1 else None
        positions = (first[:, None] + jnp.arange(queries)) if first is not None else jnp.full((rows, 1), last)
        kv_lens = jnp.max(positions, axis=1) + 1
        table = 1 + jnp.arange(rows * width, dtype=jnp.int32).reshape(rows, width) % (pages - 1)
        q = jnp.asarray(rng.randn(t + 1, s.heads, s.head_dim), jnp.bfloat16).at[t].set(0)
        return AttentionView(idx, positions.astype(jnp.int32), kv_lens.astype(jnp.int32), table), q

    out = []
    blocks = s.context // s.block
    for name, (rows, queries) in (
        (f"attention decode {s.rows} rows @{s.context}", (s.rows, 1)),
        (f"attention decode 1 row @{s.context}", (1, 1)),
        (f"attention prefill {s.context} tokens in {blocks} blocks", (blocks, s.block)),
    ):
        v, q = view(rows, queries, s.context - 1)
        t = rows * queries
        # The block rows of a prompt share its pages: one row's table for all of them.
        if queries > 1:
            v = AttentionView(v.idx, v.positions, v.kv_lens, jnp.broadcast_to(v.pages[:1], v.pages.shape))

        def reference(q: jax.Array, cache: KVCache, v: AttentionView) -> jax.Array:
            chunk = math.gcd(width, max(1, 128 // s.page_size))  # the served step's chunk of 128 tokens
            return _view_attention(q, cache, 0, v, chunk_pages=chunk, sm_scale=scale, heads_sharded=False)

        def kernel(q: jax.Array, cache: KVCache, v: AttentionView, t: int = t) -> jax.Array:
            return gpu_ragged_attention.view_attention(q, cache, 0, v, num_tokens=t, sm_scale=scale)

        out.append(_compare(name, reference, kernel, (q, cache, v), n))
    return out


def _narrow(rng: np.random.RandomState, shape: tuple[int, ...], group: int) -> StackedNarrow:
    """int4 codes with offsets, ``shape`` = (E, K, *out), groups of ``group``, bfloat16."""
    e, k, *out = shape
    codes = jnp.asarray(rng.randint(0, 256, size=(e, k // group, group // 2, *out)), jnp.uint8)
    scale = jnp.asarray(rng.rand(e, k // group, *out) * 0.004, jnp.float32)
    offset = jnp.asarray(-8 * scale)
    return StackedNarrow(codes, scale, offset, 4, len(out), jnp.dtype(jnp.bfloat16))


def _expert_cases(s: Sizes, rng: np.random.RandomState, n: int) -> list[dict]:
    """``moe-1b``'s experts for one token and for 64 (bfloat16, and int4 for one token)."""
    e, h, i = s.experts, s.hidden, s.expert_width
    gate_up = jnp.asarray(rng.randn(e, h, 2, i) * 0.02, jnp.bfloat16)
    down = jnp.asarray(rng.randn(e, i, h) * 0.02, jnp.bfloat16)
    group = 64 if i % 64 == 0 else 32
    narrow = (_narrow(rng, (e, h, 2, i), group), _narrow(rng, (e, i, h), group))
    out = []
    for label, tokens, weights in (("bf16", 1, (gate_up, down)), ("bf16", 64, (gate_up, down)), ("int4", 1, narrow)):
        x = jnp.asarray(rng.randn(tokens, h), jnp.bfloat16)
        w, ids = route(jnp.asarray(rng.randn(tokens, e), jnp.float32), s.top_k, True)

        def loop(x: jax.Array, ids: jax.Array, w: jax.Array, gu: Any, dn: Any) -> jax.Array:
            return expert_mlp(x, ids, w, gu, dn, jax.nn.silu, impl="loop")

        def kernel(x: jax.Array, ids: jax.Array, w: jax.Array, gu: Any, dn: Any) -> jax.Array:
            return expert_mlp(x, ids, w, gu, dn, jax.nn.silu, impl="pallas")

        name = f"experts {label} {tokens} token(s), {e} x top-{s.top_k}"
        out.append(_compare(name, loop, kernel, (x, ids, w, *weights), n))
    return out


def _dense_cases(s: Sizes, rng: np.random.RandomState, n: int) -> list[dict]:
    """A narrow int4 projection [T, K] x [K, N] for one token and for 64: XLA's dequantize-then-dot
    against the kernel."""
    w = _narrow(rng, (1, s.dense_in, s.dense_out), 128 if s.dense_in % 128 == 0 else 32)
    out = []
    for tokens in (1, 64):
        x = jnp.asarray(rng.randn(tokens, s.dense_in), jnp.bfloat16)

        def xla(x: jax.Array, w: StackedNarrow) -> jax.Array:
            wide = dequantize(w.codes[0], w.scale[0], w.offset[0] if w.offset is not None else None, 4, 1, x.dtype)
            return jnp.dot(x, wide, preferred_element_type=jnp.float32)

        out.append(
            _compare(
                f"int4 matmul {tokens} x {s.dense_in} x {s.dense_out}", xla, gpu_grouped_matmul.dense_matmul, (x, w), n
            )
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: every case, a table, and the JSON."""
    p = argparse.ArgumentParser(prog="python -m myserve.bench.kernels", description=__doc__)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (the default on a CPU)")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per path (median)")
    p.add_argument("--output", type=Path, help="results JSON")
    p.add_argument(
        "--tokenizer", type=Path, metavar="DIR",
        help="an HF tokenizer folder, as bench.device takes (no case here reads one: accepted so that one "
        "device script passes both commands the same flags, checked and recorded)",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.tokenizer is not None and not (args.tokenizer / "tokenizer.json").is_file():
        print(f"error: --tokenizer {args.tokenizer}: no tokenizer.json (an HF tokenizer folder)", file=sys.stderr)
        return 2
    cpu = jax.default_backend() == "cpu"
    sizes = TINY if args.tiny or cpu else FULL
    repeats = 2 if cpu else args.repeats
    rng = np.random.RandomState(0)
    cases = (
        _attention_cases(sizes, rng, repeats) + _expert_cases(sizes, rng, repeats) + _dense_cases(sizes, rng, repeats)
    )
    device = jax.devices()[0].device_kind
    print(f"{device} (jax {jax.__version__}){' tiny, interpreted' if cpu else ''}")
    print(f"{'case':<48} {'max |diff|':>11} {'relative':>9} {'reference ms':>13} {'kernel ms':>10}")
    for c in cases:
        rel = "-" if c["relative_diff"] is None else f"{c['relative_diff']:.1e}"
        print(
            f"{c['case']:<48} {c['max_abs_diff']:>11.2e} {rel:>9} "
            f"{c['reference_s'] * 1e3:>13.3f} {c['kernel_s'] * 1e3:>10.3f}"
        )
    if args.output:
        doc = {"device": device, "jax": jax.__version__, "sizes": dataclasses.asdict(sizes), "cases": cases}
        doc["tokenizer"] = None if args.tokenizer is None else str(args.tokenizer)
        args.output.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
