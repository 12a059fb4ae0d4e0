"""The device side of the engine: the ops a step is made of, and the executor that applies them.

Everything the device does is described by plain data — which pages to copy, which penalty slots to
fill, and each model call's packed host arrays — built by the host (``runtime/runner.py``). That
keeps the jitted functions few and explicit, and lets a multi-host deployment replay a step on
every process: the leader broadcasts the step's ops and every process applies the same ones
(``runtime/multihost.py``).

Penalty state: sequences that use presence/frequency/repetition penalties get a device *slot*
holding counts of their generated tokens and a mask of their prompt tokens, ``[slots, vocab]``.
Rows without penalties point at a scratch slot. The sampler adds each sampled token to its row's
counts, so the state never crosses back to the host.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from myserve.engine.params import MAX_TOP_LOGPROBS
from myserve.models.llama import LlamaModel
from myserve.ops.paged_attention import KVCache
from myserve.runtime.batch_layout import upload
from myserve.runtime.kv_cache import init_kv_cache
from myserve.runtime.mesh import kv_cache_sharding, replicated
from myserve.runtime.sampler import SampleOutput, sample
from myserve.runtime.sampling_rows import unpack
from myserve.runtime.steps import (
    LAYERS_PER_CALL,
    LayerGroups,
    constrain_cache,
    forward_last_logits,
    forward_scored,
    outer_part,
)

SLOT_CHUNK = 256
"""Token ids written into a penalty slot per ``WriteSlot``."""

MAX_STOP_IDS = 32
"""Ids that end a row of a multi-step decode on the device: EOS ids and up to 16 stop_token_ids."""


@dataclasses.dataclass(frozen=True)
class CopyPage:
    """Copy one page's K/V in every layer and head (copy-on-write of a shared prompt's last page)."""

    src: int
    dst: int


@dataclasses.dataclass(frozen=True)
class ClearSlot:
    """Reset a penalty slot."""

    slot: int


@dataclasses.dataclass(frozen=True)
class WriteSlot:
    """Record ``ids[:n]`` (int32 [SLOT_CHUNK]) in a penalty slot: prompt tokens, or generated ones."""

    slot: int
    ids: np.ndarray
    n: int
    to_prompt: bool


@dataclasses.dataclass(frozen=True)
class ModelCall:
    """One call of the model over padded rows, then the sampler on each row's last logits."""

    batch: np.ndarray
    """int32, the rows' tokens and attention metadata packed by ``HostBatch.pack``."""
    shapes: tuple[tuple[int, ...], ...]
    """Shapes of the packed arrays (tokens first)."""
    ints: np.ndarray
    """``SamplingRows.ints`` [S, ...]; S >= rows (the logits are padded to S rows)."""
    floats: np.ndarray
    """``SamplingRows.floats`` [S, ...]."""
    all_greedy: bool
    """No row samples: the greedy sampler executable."""
    logprobs: bool = True
    """Some sampled row asked for logprobs: the sampler computes the chosen tokens' logprobs and the
    top MAX_TOP_LOGPROBS of every row (without, it skips a logsumexp and a top-k that cost ~12 ms at
    [64, 49152] on the 2-core CPU)."""
    following: np.ndarray | None = None
    """int32 [rows, tokens]: each prompt position's next token, for rows scored for prompt logprobs."""
    chained: np.ndarray | None = None
    """A later step of a multi-step decode: int32 [rows, MAX_STOP_IDS] ids that end each row (-1:
    none). The call's tokens are the previous call's sampled tokens, and a row that sampled one of
    its stop ids in the previous call (or did not run in it) does not run: its K/V write is dropped."""


Op = CopyPage | ClearSlot | WriteSlot | ModelCall
CallOutput = tuple[SampleOutput, tuple[jax.Array, jax.Array, jax.Array] | None]
"""A model call's device results: the sampled rows, and (logprob, top ids, top logprobs) of scored rows."""


@functools.partial(jax.jit, donate_argnums=1, static_argnums=(5, 6))
def _sample(
    logits: jax.Array,
    counts: jax.Array,
    prompt_mask: jax.Array,
    ints: jax.Array,
    floats: jax.Array,
    all_greedy: bool,
    logprobs: bool,
) -> tuple[SampleOutput, jax.Array]:
    """Sample one token per row of ``logits`` [B, V] and count it in the row's penalty slot.

    A separate executable from the model step so it is compiled per batch size only, not per
    (batch, tokens, pages) shape: the sampler costs more to compile than the model.
    ``counts`` [slots, V] int32 and ``prompt_mask`` [slots, V] bool hold penalty state; ``ints`` and
    ``floats`` are the rows' packed ``SamplingRows`` (parameters, penalty slot, whether the sampled
    token is really appended). ``all_greedy``: the host knows no row samples; ``logprobs``: some
    row wants logprobs (four executables per row count, all compiled at warmup).
    """
    sampling, slots, sampled_weight = unpack(ints, floats)
    out = sample(
        logits,
        sampling,
        counts,
        prompt_mask,
        num_top_logprobs=MAX_TOP_LOGPROBS,
        all_greedy=all_greedy,
        logprobs=logprobs,
        slots=slots,
    )
    return out, counts.at[slots, out.tokens].add(sampled_weight)


@jax.jit
def _chain(
    prev_tokens: jax.Array, prev_q_lens: jax.Array, stop_ids: jax.Array, q_lens: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """A chained decode call's tokens [B, 1] and q_lens from the previous call's results.

    ``prev_q_lens`` [B] are the previous call's (after its own masking), so a row stays stopped.
    A stopped row still samples (its row is in the batch) and counts the sample in its penalty
    slot, which is harmless: the host ends that sequence, and a slot is cleared when reassigned.
    """
    rows = q_lens.shape[0]
    tokens = prev_tokens[:rows]
    runs = (prev_q_lens > 0) & ~(tokens[:, None] == stop_ids).any(axis=1)
    return jnp.where(runs, tokens, 0)[:, None], jnp.where(runs, q_lens, 0)


@functools.partial(jax.jit, static_argnums=1)
def _pad_rows(logits: jax.Array, rows: int) -> jax.Array:
    return jnp.pad(logits, ((0, rows - logits.shape[0]), (0, 0)))


@functools.partial(jax.jit, donate_argnums=0, static_argnums=3)
def _copy_page(kv_cache: KVCache, src: jax.Array, dst: jax.Array, sharding: NamedSharding) -> KVCache:
    copied = KVCache(
        kv_cache.k.at[:, :, dst].set(kv_cache.k[:, :, src]), kv_cache.v.at[:, :, dst].set(kv_cache.v[:, :, src])
    )
    return constrain_cache(copied, sharding)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _write_slot(
    counts: jax.Array, prompt_mask: jax.Array, slot: jax.Array, ids: jax.Array, n: jax.Array, to_prompt: jax.Array
) -> tuple[jax.Array, jax.Array]:
    valid = jnp.arange(ids.shape[0]) < n
    prompt_mask = prompt_mask.at[slot, ids].max(valid & to_prompt)
    counts = counts.at[slot, ids].add((valid & ~to_prompt).astype(counts.dtype))
    return counts, prompt_mask


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _clear_slot(counts: jax.Array, prompt_mask: jax.Array, slot: jax.Array) -> tuple[jax.Array, jax.Array]:
    return counts.at[slot].set(0), prompt_mask.at[slot].set(False)


class Executor:
    """Owns the params, the paged KV cache and the penalty state on a mesh; applies ops to them."""

    def __init__(
        self,
        model: LlamaModel,
        mesh: Mesh,
        mapping: Mapping[str, str],
        *,
        num_pages: int,
        page_size: int,
        num_slots: int,
        layers_per_call: int = LAYERS_PER_CALL,
    ):
        self.model = model
        self.mesh = mesh
        self.outer = outer_part(model)
        self.cache_sharding = kv_cache_sharding(mapping, mesh)
        self.groups = LayerGroups.of(model, layers_per_call, self.cache_sharding)
        self.kv_cache = init_kv_cache(model.spec, num_pages, page_size, model.embed.array.dtype, mesh, mapping)
        # Penalty state is small next to the cache: replicated, so every row's slot is local.
        self.replicated = replicated(mesh)
        zeros = functools.partial(jax.device_put, device=self.replicated)
        self.counts = zeros(np.zeros((num_slots, model.spec.vocab_size), np.int32))
        self.prompt_mask = zeros(np.zeros((num_slots, model.spec.vocab_size), np.bool_))

    def run(self, ops: Sequence[Op]) -> list[CallOutput]:
        """Apply ``ops`` in order (dispatched, not awaited); the outputs of its model calls, in order."""
        outputs: list[CallOutput] = []
        previous: tuple[jax.Array, jax.Array] | None = None  # the last call's (sampled tokens, q_lens)
        for op in ops:
            if isinstance(op, ModelCall):
                out, previous = self._call(op, previous)
                outputs.append(out)
            elif isinstance(op, CopyPage):
                self.kv_cache = _copy_page(self.kv_cache, np.int32(op.src), np.int32(op.dst), self.cache_sharding)
            elif isinstance(op, ClearSlot):
                self.counts, self.prompt_mask = _clear_slot(self.counts, self.prompt_mask, np.int32(op.slot))
            else:
                self.counts, self.prompt_mask = _write_slot(
                    self.counts, self.prompt_mask, np.int32(op.slot), op.ids, np.int32(op.n), np.bool_(op.to_prompt)
                )
        return outputs

    def _call(
        self, op: ModelCall, previous: tuple[jax.Array, jax.Array] | None
    ) -> tuple[CallOutput, tuple[jax.Array, jax.Array]]:
        """Dispatch one model call; its outputs, and (sampled tokens, q_lens) for a chained next call."""
        tokens, batch = upload(op.batch, op.shapes, self.replicated)
        if op.chained is not None:
            assert previous is not None, "a chained call follows the call it continues"
            tokens, q_lens = _chain(*previous, op.chained, batch.q_lens)
            batch = dataclasses.replace(batch, q_lens=q_lens)
        scores = None
        if op.following is not None:
            logits, scores, self.kv_cache = forward_scored(
                self.model, tokens, batch, self.kv_cache, op.following, MAX_TOP_LOGPROBS, self.outer, self.groups
            )
        else:
            logits, self.kv_cache = forward_last_logits(
                self.model, tokens, batch, self.kv_cache, self.outer, self.groups
            )
        # Prefill rows are sampled in a batch bucket, so the sampler compiles per bucket only.
        if op.ints.shape[0] != logits.shape[0]:
            logits = _pad_rows(logits, op.ints.shape[0])
        out, self.counts = _sample(
            logits, self.counts, self.prompt_mask, op.ints, op.floats, op.all_greedy, op.logprobs
        )
        return (out, scores), (out.tokens, batch.q_lens)


def fetch(arrays: Sequence[jax.Array]) -> list[np.ndarray]:
    """Device arrays to numpy, all transfers started before any is awaited.

    On a multi-host mesh an output spans devices of other processes; every result here is
    replicated, so the local copy is the whole value.
    """
    if all(a.is_fully_addressable for a in arrays):
        return list(jax.device_get(list(arrays)))
    return [np.asarray(a.addressable_data(0)) for a in arrays]
