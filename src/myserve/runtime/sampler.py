"""On-device sampling: logit processing, top-k/top-p/min-p filtering, seeded sampling, logprobs.

``sample`` runs inside the jitted model step: pure jax, static shapes, no host syncs. Every
parameter is per row, so requests with different settings share one batch. Order of processing
(vLLM's):

1. ``logit_bias`` added (OpenAI ``logit_bias``);
2. ``banned_ids`` set to -inf (EOS/stop ids while ``min_tokens`` is not reached);
3. penalties: repetition (prompt and generated tokens: ``l > 0 -> l / rp`` else ``l * rp``),
   then frequency and presence over generated tokens (``l -= freq * count + pres * (count > 0)``);
4. greedy rows (``temperature == 0``) take the argmax of the processed logits;
5. other rows: divide by temperature, then top-k, top-p (over the top-k renormalised
   distribution), min-p (relative to the top probability), then sample.

Each filter keeps the tokens whose logit is at least a per-row threshold (ties at the boundary are
kept, as in vLLM), so the three combine into one threshold: the highest of the three.

Exact top-k/top-p without a sort. The thresholds are computed from the ``CANDIDATES`` largest
logits (``lax.top_k``); for a row whose top-k boundary or nucleus does not provably lie inside them
the threshold is the one found by bisection over the row's values (as int32 keys ordered like the
floats: 32 halvings of a count or a probability mass, a loop of static length), computed for every
row beside the candidate answer and selected per row. No conditional and no data-dependent loop:
on a GPU either would make the host wait for the device (``docs/design/runtime.md``). A row that
fits always uses the candidate result and a row that does not always uses the bisection, so a
row's threshold never depends on the other rows of the batch.

Which parts run is decided by the host, per step, as static arguments (``sample``'s ``processed``,
``all_greedy``, ``filtered``, ``logprobs``): each combination the engine uses is its own small
executable (``runtime/model_step.py``).

Sampling is Gumbel-max, split in two levels so that it needs ~2*sqrt(V) random numbers per row
instead of V (full-vocabulary threefry noise alone takes ~40 ms at [64, 49152]): pick a block
of ``BLOCK`` tokens with Gumbel-max over the blocks' log masses, then a token inside it. This is the
exact categorical distribution. Row b's key is ``fold_in(fold_in(key(seed), choice), position)``
and its token depends only on that key and the row's own logits and parameters: batch-invariant.

Measured on this 2-core CPU (shared with other jobs, load ~3: expect +-25%), B=64, V=49152,
jitted, median ms per call over 7 runs of three invocations of ``tests/bench_sampler_topp.py``:

    greedy batch (argmax + chosen logprob)                    10-15
    greedy + 5 top logprobs                                   15-22
    temperature only (no top-k/top-p: no candidates)          18-24
    top_k=50, candidates path                                 34-44
    top_p=0.9, candidates path (every nucleus fits in 256)    39-45
    naive: jnp.sort of the whole batch, then top-k/top-p    1056-1158
(figures of the candidate path with a per-row sorted fallback; the bisection fallback, computed
for every row of a filtered batch, is measured in ``docs/performance.md``)
"""

from __future__ import annotations

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax

CANDIDATES = 256
"""Largest logits per row from which top-k/top-p thresholds are taken before falling back to bisection.
``lax.top_k`` costs ~15 ms at 256 and ~35 ms at 1024 for [64, 49152]."""

BLOCK = 256
"""Tokens per block of the two-level Gumbel-max."""


class SamplingArrays(eqx.Module):
    """Per-row sampling parameters; every field has leading batch dim B (one row per sequence)."""

    temperature: jax.Array  # f32 [B]; 0 => greedy
    top_k: jax.Array  # i32 [B]; <= 0 => disabled
    top_p: jax.Array  # f32 [B]; 1.0 => disabled
    min_p: jax.Array  # f32 [B]; 0 => disabled
    presence_penalty: jax.Array  # f32 [B]
    frequency_penalty: jax.Array  # f32 [B]
    repetition_penalty: jax.Array  # f32 [B]; 1.0 => disabled
    seed: jax.Array  # u32 [B]
    choice: jax.Array  # i32 [B]; index of the choice when n > 1
    position: jax.Array  # i32 [B]; tokens this choice generated before this one
    bias_ids: jax.Array  # i32 [B, NB]; logit_bias token ids, padding = -1
    bias_values: jax.Array  # f32 [B, NB]
    banned_ids: jax.Array  # i32 [B, NS]; tokens forced to -inf this step, padding = -1
    constrained: jax.Array | None = None  # bool [B]; the row's grammar bitmask applies
    ban_steps: jax.Array | None = None  # i32 [B]; banned_ids apply while the call's token index < this (None: always)


class SampleOutput(eqx.Module):
    """Sampled tokens and logprobs of the raw (unprocessed) model distribution."""

    tokens: jax.Array  # i32 [B]
    logprobs: jax.Array  # f32 [B]; raw log_softmax at the chosen token
    top_ids: jax.Array  # i32 [B, K]
    top_logprobs: jax.Array  # f32 [B, K]; descending


def greedy_params(batch: int, nb: int = 1, ns: int = 1) -> SamplingArrays:
    """Arrays for ``batch`` greedy rows with every option disabled (tests, warmup)."""
    f32 = lambda x: jnp.full((batch,), x, jnp.float32)  # noqa: E731
    zeros_i = jnp.zeros((batch,), jnp.int32)
    return SamplingArrays(
        temperature=f32(0.0),
        top_k=zeros_i,
        top_p=f32(1.0),
        min_p=f32(0.0),
        presence_penalty=f32(0.0),
        frequency_penalty=f32(0.0),
        repetition_penalty=f32(1.0),
        seed=jnp.zeros((batch,), jnp.uint32),
        choice=zeros_i,
        position=zeros_i,
        bias_ids=jnp.full((batch, nb), -1, jnp.int32),
        bias_values=jnp.zeros((batch, nb), jnp.float32),
        banned_ids=jnp.full((batch, ns), -1, jnp.int32),
    )


def process_logits(
    logits: jax.Array,
    params: SamplingArrays,
    output_counts: jax.Array,
    prompt_mask: jax.Array,
    slots: jax.Array | None = None,
    bitmask: jax.Array | None = None,
    *,
    penalties: bool = True,
    iteration: int | jax.Array = 0,
) -> jax.Array:
    """Steps 1-3 of the module docstring: bias, bans, penalties, then the grammar mask.

    logits f32 [B, V], output_counts i32 [B, V], prompt_mask bool [B, V] -> f32 [B, V]. With
    ``slots`` i32 [B], ``output_counts`` and ``prompt_mask`` are tables [S, V] and row b reads
    row ``slots[b]`` of them. ``penalties`` (static) False skips them, and their gathers (4 ms at
    [64, 49152] on the 2-core CPU): the host passes it when no row of the step has a penalty.
    Disabled penalties are an exact identity, so rows without one are unchanged either way.
    ``bitmask`` int32 [B, ceil(V / 32)] masks the rows marked ``params.constrained`` (others are
    all ones). ``iteration``: the token's index in a several-token call; a row's banned ids apply
    while it is below ``params.ban_steps``.
    """
    b, v = logits.shape
    rows = jnp.arange(b)[:, None]
    # Padding ids (-1) are sent out of range and dropped; a raw -1 would wrap to the last token.
    bias_ids = jnp.where(params.bias_ids >= 0, params.bias_ids, v)
    logits = logits.at[rows, bias_ids].add(params.bias_values, mode="drop")
    banning = params.banned_ids >= 0
    if params.ban_steps is not None:
        banning &= (iteration < params.ban_steps)[:, None]
    banned_ids = jnp.where(banning, params.banned_ids, v)
    logits = logits.at[rows, banned_ids].set(-jnp.inf, mode="drop")
    if penalties:
        rows_counts = output_counts if slots is None else output_counts[slots]
        rows_prompt = prompt_mask if slots is None else prompt_mask[slots]
        rp = params.repetition_penalty[:, None]
        seen = rows_prompt | (rows_counts > 0)
        logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
        counts = rows_counts.astype(jnp.float32)
        logits = logits - params.frequency_penalty[:, None] * counts
        logits = logits - params.presence_penalty[:, None] * (counts > 0)
    if bitmask is not None:
        return apply_token_bitmask(logits, bitmask)
    return logits


def _thresholds(
    vals: jax.Array, row_max: jax.Array, lse: jax.Array, params: SamplingArrays, vocab: int
) -> tuple[jax.Array, jax.Array]:
    """Keep-threshold per row from the C largest scaled logits ``vals`` [..., C] (descending).

    ``row_max``/``lse`` [...]: max and logsumexp of the whole scaled row. Returns (threshold, exact):
    ``exact`` is false where the answer may depend on logits outside ``vals``. Works on a batch
    ([B, C], candidates) and on one fully sorted row ([V]).
    """
    c = vals.shape[-1]
    take = lambda i: jnp.take_along_axis(vals, i[..., None], axis=-1)[..., 0]  # noqa: E731
    k_on = (params.top_k > 0) & (params.top_k < vocab)
    t_k = jnp.where(k_on, take(jnp.clip(params.top_k - 1, 0, c - 1)), -jnp.inf)
    # Ties with the k-th logit are kept, so they must not continue past the last candidate.
    k_inside = k_on & (params.top_k <= c) & ((vals[..., -1] < t_k) | (c == vocab))

    # top-p over the top-k renormalised distribution: keep a sorted token while the mass strictly
    # before it is < p, i.e. the smallest prefix whose mass reaches p.
    in_k = vals >= t_k[..., None]
    lse_k = jnp.where(k_on, jax.nn.logsumexp(jnp.where(in_k, vals, -jnp.inf), axis=-1), lse)
    probs = jnp.where(in_k, jnp.exp(vals - lse_k[..., None]), 0.0)
    cum = jnp.cumsum(probs, axis=-1)
    p_on = params.top_p < 1
    n_keep = jnp.sum((cum - probs < params.top_p[..., None]) & in_k, axis=-1)
    t_p = jnp.where(p_on, take(jnp.clip(n_keep - 1, 0, c - 1)), -jnp.inf)

    # min-p is relative to the top probability, which top-k/top-p renormalisation scales alike.
    t_min = jnp.where(params.min_p > 0, row_max + jnp.log(params.min_p), -jnp.inf)
    exact = (~k_on | k_inside) & (~p_on | k_inside | (cum[..., -1] >= params.top_p) | (c == vocab))
    return jnp.maximum(jnp.maximum(t_k, t_p), t_min), exact


def _top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``lax.top_k`` kept as XLA:CPU's TopK call (~15 ms at [64, 49152], k=256).

    XLA lowers top_k to sort + slice and only turns that back into TopK when the slice is
    materialised; fused into its consumers it stays a full sort (~700 ms). The barrier prevents it.
    One barrier per output: XLA's SPMD partitioner fails on a barrier over top_k's tuple when the
    logits are sharded over the vocabulary (tensor parallelism).
    """
    values, indices = lax.top_k(x, k)
    return lax.optimization_barrier(values), lax.optimization_barrier(indices)


_KEY_FLIP = 0x7FFFFFFF


def _keys(x: jax.Array) -> jax.Array:
    """float32 -> int32 keys in the same order (negative floats' bits reversed)."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ _KEY_FLIP, bits)


def _from_keys(keys: jax.Array) -> jax.Array:
    """The inverse of ``_keys``."""
    return lax.bitcast_convert_type(jnp.where(keys < 0, keys ^ _KEY_FLIP, keys), jnp.float32)


def _smallest_key_below(keys: jax.Array, measure: Callable[[jax.Array], jax.Array], target: jax.Array) -> jax.Array:
    """Per row, the smallest key ``k`` with ``measure(k) < target``, by bisection.

    ``keys`` i32 [B, V]; ``measure(k)`` [B] is what lies strictly above ``k`` [B] in each row (a
    count or a mass: non-increasing in ``k``, zero at the row's largest key); ``target`` [B]. The
    answer is a key of the row (``measure`` only steps at them). 32 halvings of the int32 range, a
    loop of static length: no host round trip on any device.
    """
    lo = keys.min(axis=-1) - 1  # measure(lo) is everything: >= any target that can be reached
    hi = keys.max(axis=-1)  # measure(hi) == 0 < target

    def halve(_: int, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without int32 overflow
        below = measure(mid) < target
        return jnp.where(below, lo, mid), jnp.where(below, mid, hi)

    return lax.fori_loop(0, 32, halve, (lo, hi))[1]


def _bisected_thresholds(scaled: jax.Array, lse: jax.Array, row_max: jax.Array, params: SamplingArrays) -> jax.Array:
    """The keep-threshold of every row of ``scaled`` [B, V] from all its values: what ``_thresholds``
    gives from a full sort (top-k ties kept; the nucleus is the smallest prefix of the sorted top-k
    distribution whose mass reaches top_p), found by bisection instead of sorting."""
    vocab = scaled.shape[-1]
    keys = _keys(scaled)
    k_on = (params.top_k > 0) & (params.top_k < vocab)
    # Counted in float32: exact (whole numbers below 2**24, any vocabulary) and a third cheaper on
    # XLA:CPU than an int32 sum of the comparisons (it vectorises the float reduction).
    count_above = lambda k: jnp.sum((keys > k[:, None]).astype(jnp.float32), axis=-1)  # noqa: E731
    top_k = params.top_k.astype(jnp.float32)
    t_k = jnp.where(k_on, _from_keys(_smallest_key_below(keys, count_above, top_k)), -jnp.inf)
    in_k = scaled >= t_k[:, None]
    lse_k = jnp.where(k_on, jax.nn.logsumexp(jnp.where(in_k, scaled, -jnp.inf), axis=-1), lse)
    probs = jnp.where(in_k, jnp.exp(scaled - lse_k[:, None]), 0.0)
    # A token is kept while the mass sorted before it is < p: the threshold is the smallest value
    # whose strictly-larger mass is below p.
    mass_above = lambda k: jnp.sum(jnp.where(keys > k[:, None], probs, 0.0), axis=-1)  # noqa: E731
    p_on = params.top_p < 1
    t_p = jnp.where(p_on, _from_keys(_smallest_key_below(keys, mass_above, params.top_p)), -jnp.inf)
    t_min = jnp.where(params.min_p > 0, row_max + jnp.log(params.min_p), -jnp.inf)
    return jnp.maximum(jnp.maximum(t_k, t_p), t_min)


def keep_threshold(
    scaled: jax.Array, params: SamplingArrays, *, candidates: int = CANDIDATES, filtered: bool = True
) -> jax.Array:
    """Smallest kept logit per row after top-k, top-p and min-p: f32 [B] from scaled logits [B, V].

    Greedy rows (``temperature <= 0``) are ignored: their threshold is meaningless. ``filtered``
    (static) False: no row has top-k or top-p (the host knows), so only min-p applies and neither
    the candidates nor the bisection are computed.
    """
    v = scaled.shape[-1]
    row_max = scaled.max(axis=-1)
    if not filtered:
        return jnp.where(params.min_p > 0, row_max + jnp.log(params.min_p), -jnp.inf)
    lse = jax.nn.logsumexp(scaled, axis=-1)
    vals, _ = _top_k(scaled, min(candidates, v))
    thr, exact = _thresholds(vals, row_max, lse, params, v)
    # Both answers for every row, one selected per row: the bisection costs a few passes over
    # [B, V], where a conditional would cost a host round trip per step on a GPU.
    return jnp.where(exact, thr, _bisected_thresholds(scaled, lse, row_max, params))


def argmax(x: jax.Array, block: int = BLOCK) -> jax.Array:
    """Index of the first largest value of each row of ``x`` [B, V]: i32 [B], as ``jnp.argmax``.

    In two levels: the first block of ``block`` values holding the row's max, then the first index
    of the max inside it. A max over the whole row vectorises where XLA:CPU's variadic argmax
    reduction does not: 0.9 against 7.2 ms at [64, 49152] on the 2-core CPU.
    """
    b, v = x.shape
    w = min(block, v)
    g = -(-v // w)
    blocks = jnp.pad(x, ((0, 0), (0, g * w - v)), constant_values=-jnp.inf).reshape(b, g, w)
    first = jnp.argmax(blocks.max(axis=-1), axis=-1)
    inside = jnp.take_along_axis(blocks, first[:, None, None], axis=1)[:, 0]
    return (first * w + jnp.argmax(inside, axis=-1)).astype(jnp.int32)


def _row_keys(params: SamplingArrays) -> jax.Array:
    def one(seed: jax.Array, choice: jax.Array, position: jax.Array) -> jax.Array:
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), choice), position)

    return jax.vmap(one)(params.seed, params.choice, params.position)


def _gumbel_max(masked: jax.Array, keys: jax.Array) -> jax.Array:
    """Categorical sample per row of softmax(masked [B, V]) (-inf = removed): i32 [B]."""
    b, v = masked.shape
    w = min(BLOCK, v)
    g = -(-v // w)
    blocks = jnp.pad(masked, ((0, 0), (0, g * w - v)), constant_values=-jnp.inf).reshape(b, g, w)
    top = masked.max(axis=-1)
    top = jnp.where(jnp.isfinite(top), top, 0.0)  # a fully banned row must not turn into NaN
    log_mass = jnp.log(jnp.exp(blocks - top[:, None, None]).sum(axis=-1))  # [B, G]
    # One draw of G + W independent values per row serves both levels (one threefry: faster compile).
    noise = jax.vmap(lambda k: jax.random.gumbel(k, (g + w,)))(keys)
    block = jnp.argmax(log_mass + noise[:, :g], axis=-1)
    inside = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]  # [B, W]
    return (block * w + jnp.argmax(inside + noise[:, g:], axis=-1)).astype(jnp.int32)


def sample(
    logits: jax.Array,
    params: SamplingArrays,
    output_counts: jax.Array,
    prompt_mask: jax.Array,
    *,
    num_top_logprobs: int,
    candidates: int = CANDIDATES,
    all_greedy: bool = False,
    logprobs: bool = True,
    processed: bool = True,
    penalties: bool = True,
    filtered: bool = True,
    slots: jax.Array | None = None,
    bitmask: jax.Array | None = None,
    iteration: int | jax.Array = 0,
) -> SampleOutput:
    """Sample one token per row (``iteration``: its index in a several-token call; see ``process_logits``).

    logits f32 [B, V] (raw model output); output_counts i32 [B, V]: tokens generated so far;
    prompt_mask bool [B, V]: tokens in the prompt (or both tables [S, V] read at ``slots`` [B], see
    ``process_logits``); ``bitmask`` int32 [B, ceil(V / 32)]: the grammar masks of the rows marked
    ``params.constrained``. ``num_top_logprobs`` (static) sets K of ``top_ids``/``top_logprobs``;
    ``candidates`` (static) is the top-k/top-p prefilter size.

    The rest are static, decided by the host from the step's rows, each combination its own
    executable, so that nothing is decided on the device (no conditional): ``all_greedy``, every
    row has ``temperature <= 0`` (argmax only, no thresholds nor noise); ``logprobs``, some row
    wants logprobs (otherwise ``logprobs`` and the top entries are zeros, with no top columns);
    ``processed`` False, nothing edits the logits (no bias, ban, penalty nor grammar mask: the
    argmax of the raw logits, without copying [B, V] through the scatters); ``penalties``, some row
    has a penalty; ``filtered``, some row has top-k or top-p. A greedy row of a batch that samples
    takes the argmax of its processed logits, so the flags never change a row's token.
    """
    logits = logits.astype(jnp.float32)
    b, k = logits.shape[0], num_top_logprobs
    if processed:
        edited = process_logits(
            logits, params, output_counts, prompt_mask, slots, bitmask, penalties=penalties, iteration=iteration
        )
    else:
        assert all_greedy, "rows that draw need their logits processed"
        edited = logits
    if all_greedy:
        tokens = argmax(edited)
    else:
        greedy_rows = params.temperature <= 0
        temperature = jnp.where(greedy_rows, 1.0, params.temperature)
        scaled = edited / temperature[:, None]
        thr = keep_threshold(scaled, params, candidates=candidates, filtered=filtered)
        drawn = _gumbel_max(jnp.where(scaled >= thr[:, None], scaled, -jnp.inf), _row_keys(params))
        tokens = jnp.where(greedy_rows, argmax(edited), drawn).astype(jnp.int32)
    if logprobs:
        chosen, top_ids, top_logprobs = token_logprobs(logits, tokens, k)
    else:
        chosen, top_ids, top_logprobs = jnp.zeros(b), jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0), jnp.float32)
    return SampleOutput(tokens=tokens, logprobs=chosen, top_ids=top_ids, top_logprobs=top_logprobs)


def token_logprobs(logits: jax.Array, targets: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Raw log-softmax at ``targets`` and the top ``k`` (static) per row.

    logits f32 [N, V]; targets i32 [N]. Returns logprobs f32 [N], top ids i32 [N, k], top logprobs
    f32 [N, k] (descending). Used for sampled tokens and for prompt tokens (echo with logprobs).
    """
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    chosen = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0] - lse
    if k > 0:
        top_vals, top_ids = _top_k(logits, k)
        return chosen, top_ids, top_vals - lse[:, None]
    return chosen, jnp.zeros((logits.shape[0], 0), jnp.int32), jnp.zeros((logits.shape[0], 0), jnp.float32)


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Disallowed tokens to -inf: logits f32 [B, V], bitmask int32 [B, ceil(V / 32)] with bit
    ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed (llguidance's format,
    ``grammar.py``); an unconstrained row is all ones (-1)."""
    b, v = logits.shape
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32], little-endian
    allowed = bits.reshape(b, -1)[:, :v].astype(bool)
    return jnp.where(allowed, logits, -jnp.inf)
