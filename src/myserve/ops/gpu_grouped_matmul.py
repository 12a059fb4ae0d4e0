"""A grouped matmul for GPUs in Pallas (Triton): rows sorted by group times that group's weight,
float or narrow codes widened in registers.

What it replaces. The experts' per-tile loop (``ops/moe.py``) is a loop of small kernels on a GPU
(a slice, two dots and an update per tile, every layer), and ``lax.ragged_dot`` lowers on CUDA to
a dense product over every expert unless cuDNN's grouped GEMM takes it. Narrow weights widened
by XLA are written to memory at full width before the dot reads them (issue 46: int8 and int4
slower than bfloat16). This kernel reads each tile's weight once, in its stored form:

- **Tiles.** The caller cuts the sorted rows into tiles of ``block_rows`` rows of one group
  (``tile_group``, ``tile_start``, ``tile_rows``: the valid rows, 0 for a tile past the real ones).
  One program per (tile, block of ``BLOCK_N`` output columns) walks the contracted axis. A decode
  step's tiles are its routed experts: each reads its expert's weights once, the active bytes.
- **Narrow weights** (``ops/dequant.py``'s layout: codes ``[G, K / g, g / pack, N]``, scales and
  offsets ``[G, K / g, N]``): a program loads ``CODE_ROWS`` rows of codes (int8, or uint8 holding
  two 4-bit codes: the low nibbles are the group's first half, the high ones its second), widens
  them with their group's scale and offset in registers and contracts them with the matching
  columns of the rows. Nothing wide is written.
- **Output.** Rows no valid tile covers stay zeros (the output aliases a zero array), so rows of
  other devices' experts and padding contribute nothing.

It runs on CPU in Pallas's interpreter (the default there); the tests check it against the loop
and that it lowers to Triton calls for CUDA. Its speed needs a GPU: ``BLOCK_N`` and ``CODE_ROWS``
are first choices, to be tuned there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from myserve.errors import ConfigError
from myserve.ops.dequant import StackedNarrow

BLOCK_N = 64
"""Output columns per program, at most (a power of two dividing N, at least 16)."""
CODE_ROWS = 64
"""Rows of codes (or of a float weight) a program loads per step of the contracted axis, at most (the
largest power of two dividing a quantization group's code rows: 16 of the 48 of a group of 96)."""
MIN_ROWS = 16
"""A Triton dot's smallest dimension: tiles have at least this many rows (and output blocks columns)."""
DENSE_ROWS = 64
"""Rows per tile of a dense (one-group) matmul, at most."""
PROGRAMS = 256
"""Output blocks narrow (down to ``MIN_ROWS`` columns) until a call has about this many programs:
a decode step's few tiles would otherwise leave most of a GPU's SMs idle (an H100 has 132)."""


def grouped_matmul(
    x: jax.Array,
    w: jax.Array | StackedNarrow,
    tile_group: jax.Array,
    tile_start: jax.Array,
    tile_rows: jax.Array,
    *,
    block_rows: int,
    interpret: bool | None = None,
) -> jax.Array:
    """``out[r] = x[r] @ w[group of r]`` for the rows the tiles cover: ``x`` [M + block_rows, K]
    (sorted by group, ``block_rows`` spare rows last so that every tile's rows are in bounds);
    ``w`` [G, K, N] float, or narrow (``StackedNarrow`` with one output axis); tile ``t`` is rows
    ``tile_start[t]`` .. ``+ tile_rows[t]`` of group ``tile_group[t]``. Returns float32 [M +
    block_rows, N], zeros where no tile wrote. ``interpret``: Pallas's interpreter (None: on a CPU)."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    m, k = x.shape
    narrow = isinstance(w, StackedNarrow)
    if isinstance(w, StackedNarrow):
        assert w.n_out == 1, "a grouped matmul's weight has one output axis"
        groups, per_group, pack_rows, n = w.codes.shape
        pack = 2 if w.bits == 4 else 1
        code_rows = min(CODE_ROWS, pack_rows & -pack_rows)  # a power of two dividing a group's rows
        assert per_group * pack_rows * pack == k and pack_rows % code_rows == 0
        # [G, K / g * g / pack, N]: a bitcast; step s reads code rows s * code_rows onwards.
        weights: list[jax.Array] = [w.codes.reshape(groups, per_group * pack_rows, n), w.scale]
        if w.offset is not None:
            weights.append(w.offset)
    else:
        groups, _, n = w.shape
        pack, pack_rows, code_rows = 1, k, min(CODE_ROWS, k & -k)
        assert k % code_rows == 0
        weights = [w]
    num_tiles = tile_group.shape[0]
    block_n = min(BLOCK_N, n & -n)  # the largest power of two dividing N, up to BLOCK_N
    while block_n > MIN_ROWS and num_tiles * (n // block_n) < PROGRAMS:
        block_n //= 2
    steps = k // pack // code_rows
    kernel = functools.partial(
        _kernel, block_rows=block_rows, block_n=block_n, code_rows=code_rows, pack_rows=pack_rows,
        pack=pack, steps=steps, narrow=narrow, offset=narrow and len(weights) == 3,
    )  # fmt: skip
    zeros = jnp.zeros((m, n), jnp.float32)
    return pl.pallas_call(  # type: ignore[no-any-return]
        kernel,
        grid=(num_tiles, n // block_n),
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        input_output_aliases={4 + len(weights): 0},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        name=f"grouped_matmul_m{block_rows}_n{block_n}_k{code_rows}{'_narrow' if narrow else ''}",
    )(tile_group, tile_start, tile_rows, x, *weights, zeros)


def _kernel(*refs: jax.Array, block_rows: int, block_n: int, code_rows: int, pack_rows: int, pack: int,
            steps: int, narrow: bool, offset: bool) -> None:  # fmt: skip
    """One program: ``block_rows`` rows of one tile times a ``block_n``-column block of its group's
    weight, the contracted axis walked ``code_rows`` code rows at a time."""
    group_ref, start_ref, rows_ref, x_ref, w_ref, *rest = refs
    scale_ref = rest[0] if narrow else None
    offset_ref = rest[1] if offset else None
    o_ref = rest[-1]
    t, nb = pl.program_id(0), pl.program_id(1)
    group, start, valid = group_ref[t], start_ref[t], rows_ref[t]
    cols = pl.ds(nb * block_n, block_n)
    rows = pl.ds(start, block_rows)

    def step(s: jax.Array, acc: jax.Array) -> jax.Array:
        first = s * code_rows  # the first code row of this step
        codes = w_ref[group, pl.ds(first, code_rows), cols]  # [code_rows, block_n]
        if not narrow:
            return acc + jnp.dot(x_ref[rows, pl.ds(first, code_rows)], codes, preferred_element_type=jnp.float32)
        assert scale_ref is not None
        # The quantization group and the row in it (lax's division: jnp's floor division of signed
        # integers does not lower to Triton, and these are never negative).
        rows_per = jnp.int32(pack_rows)
        q, within = lax.div(first, rows_per), lax.rem(first, rows_per)
        scale = scale_ref[group, q, cols].astype(jnp.float32)[None, :]
        shift = 0.0 if offset_ref is None else offset_ref[group, q, cols].astype(jnp.float32)[None, :]
        base = q * pack_rows * pack + within  # the element of code row ``first`` (low nibble)
        halves = [codes] if pack == 1 else [jnp.bitwise_and(codes, 0xF), jnp.right_shift(codes, 4)]
        for half, code in enumerate(halves):
            wide = (code.astype(jnp.float32) * scale + shift).astype(x_ref.dtype)
            xs = x_ref[rows, pl.ds(base + half * pack_rows, code_rows)]
            acc = acc + jnp.dot(xs, wide, preferred_element_type=jnp.float32)
        return acc

    acc = lax.fori_loop(0, steps, step, jnp.zeros((block_rows, block_n), jnp.float32))
    keep = lax.broadcasted_iota(jnp.int32, (block_rows, block_n), 0) < valid
    plgpu.store(o_ref.at[rows, cols], acc, mask=keep)  # type: ignore[arg-type]


def tiles_of(sizes: jax.Array, num_tiles: int, block_rows: int, rows: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The tiles of groups of ``sizes`` [G] rows laid out one after another (a group's rows start
    where the previous group's end): each group's rows cut into tiles of ``block_rows``, ``num_tiles``
    in all (the static bound; tiles past the real ones have no valid rows and start at ``rows``, the
    spare rows). Returns (group, first row, valid rows), each [num_tiles] int32."""
    g = sizes.shape[0]
    per_group = (sizes + block_rows - 1) // block_rows
    ends = jnp.cumsum(per_group)
    j = jnp.arange(num_tiles, dtype=jnp.int32)
    group = jnp.searchsorted(ends, j, side="right").astype(jnp.int32)
    real = group < g
    group = jnp.minimum(group, g - 1)
    local = j - (ends[group] - per_group[group])
    starts = jnp.cumsum(sizes) - sizes
    first = jnp.where(real, starts[group] + local * block_rows, rows).astype(jnp.int32)
    valid = jnp.where(real, jnp.clip(sizes[group] - local * block_rows, 0, block_rows), 0).astype(jnp.int32)
    return group, first, valid


def dense_fits(w: StackedNarrow) -> bool:
    """Whether a one-group narrow weight suits the kernel on a GPU: Triton blocks of at least 16
    code rows (a quantization group's) and 16 output columns."""
    _, _, pack_rows, n = w.codes.shape
    return (pack_rows & -pack_rows) >= MIN_ROWS and (n & -n) >= MIN_ROWS


def dense_matmul(x: jax.Array, w: StackedNarrow, interpret: bool | None = None) -> jax.Array:
    """``x`` [R, K] times the one narrow weight of ``w`` ([1, K / g, g / pack, N]): float32 [R, N],
    the rows in tiles of up to ``DENSE_ROWS``."""
    r = x.shape[0]
    b = max(MIN_ROWS, min(DENSE_ROWS, 1 << max(r - 1, 0).bit_length()))
    num_tiles = -(-r // b)
    xs = jnp.pad(x, ((0, num_tiles * b - r + b), (0, 0)))  # whole tiles, then the spare rows
    start = jnp.arange(num_tiles, dtype=jnp.int32) * b
    tiles = (jnp.zeros(num_tiles, jnp.int32), start, jnp.clip(r - start, 0, b).astype(jnp.int32))
    return grouped_matmul(xs, w, *tiles, block_rows=b, interpret=interpret)[:r]


def resolve_quantized_matmul(choice: str, devices: int) -> bool:
    """``engine.quantized_matmul``: whether dense narrow weights run this kernel. ``auto`` and
    ``xla``: no (XLA dequantizes; ``auto`` until a GPU has measured the kernel); ``pallas``: yes, on a
    GPU and a replica of one device (``devices``: the replica's; the custom call is not partitioned)."""
    if choice != "pallas":
        return False
    if jax.default_backend() not in ("gpu", "cuda", "rocm"):
        raise ConfigError("engine.quantized_matmul 'pallas' needs a GPU; use 'auto' or 'xla'")
    if devices != 1:
        raise ConfigError(f"engine.quantized_matmul 'pallas' runs on one device per replica, not {devices}")
    return True
