"""The executor: the ``Device`` that applies a step's ops to the weights and caches on a mesh.

Everything the device does is described by plain data (``runtime/step_ops.py``) built by the host
(``core/runner.py``). That keeps the jitted functions few and explicit, and lets a multi-host
deployment replay a step on every process: the leader broadcasts the step's ops and every process
applies the same ones (``runtime/multihost.py``).

Penalty state: sequences that use presence/frequency/repetition penalties get a device *slot*
holding counts of their generated tokens and a mask of their prompt tokens, ``[slots, vocab]``.
Rows without penalties point at a scratch slot. The sampler adds each sampled token to its row's
counts, so the state never crosses back to the host.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from myserve.models.llama import LlamaModel
from myserve.models.sharding import MeshAxes, kv_cache_sharding
from myserve.ops.paged_cache import kv_dtype
from myserve.runtime.device import StepRead
from myserve.runtime.executable_args import executable_args, stand_ins
from myserve.runtime.executables import BuildKey, Executables, Step, out_trees
from myserve.runtime.fetch import fetch
from myserve.runtime.host_kv import HostKV
from myserve.runtime.kv_cache import cache_layout, init_kv_cache, make_cache
from myserve.runtime.mesh import replicated
from myserve.runtime.model_step import (
    ForwardOutput,
    StepOutput,
    lora_leaf_indices,
    split_model,
)
from myserve.runtime.priming import prime_built
from myserve.runtime.sampler import SampleOutput
from myserve.runtime.sampling_rows import HEAD_MODES, MAX_TOP_LOGPROBS
from myserve.runtime.small_ops import SmallOps, clear_slot, copy_page, write_adapter, write_slot
from myserve.runtime.step_arrays import pack_step
from myserve.runtime.step_cache import StepCache
from myserve.runtime.step_layout import StepShape
from myserve.runtime.step_ops import (
    ClearSlot,
    CompileSteps,
    CopyPage,
    LoadPages,
    Op,
    PrimeSteps,
    Progress,
    SavePages,
    StepCall,
    WriteAdapter,
)

logger = logging.getLogger(__name__)


def _full_mask(op: StepCall, words: int) -> np.ndarray:
    """The step's [N1, words] mask: its constrained rows' masks, all ones elsewhere."""
    assert op.bitmask is not None and op.mask_rows is not None
    full = np.full((op.shape.singles, words), -1, np.int32)
    full[op.mask_rows] = op.bitmask
    return full


class Executor:
    """Owns the params, the paged KV cache and the penalty state on a mesh; applies ops to them."""

    def __init__(
        self,
        model: LlamaModel,
        mesh: Mesh,
        mapping: Mapping[str, MeshAxes],
        *,
        num_pages: int,
        page_size: int,
        num_slots: int,
        prebuilt: Future[Prebuilt] | None = None,
        step_cache: StepCache | None = None,
        sampler: bool = True,
        pool: bool = False,
        kv_cache_dtype: str = "auto",
        host_pages: int = 0,
    ):
        """``model`` may be abstract (``load_model(abstract=True)``): the executor then holds no
        arrays, only their shapes and shardings, and serves to build step executables early.
        ``prebuilt``: such an executor's builds, taken by ``CompileSteps`` when they match.
        ``step_cache``: where step executables are loaded from without tracing, and stored.
        ``sampler`` False: an embedding-only deployment, whose steps have no LM head nor sampler.
        ``pool``: the deployment embeds, so its steps compute the pooled sums (always when not ``sampler``).
        ``kv_cache_dtype``: ``engine.kv_cache_dtype`` (``auto``: the model's dtype). ``host_pages``:
        the host tier's pages (``engine.kv_offloading_size``; 0: none)."""
        self.sampler = sampler
        self.pool = pool or not sampler
        self._prebuilt = prebuilt
        self._step_cache = step_cache
        self.mesh = mesh
        self.page_size = page_size
        self.scratch_slot = num_slots - 1
        """The penalty slot of rows without penalties (the last)."""

        self._small_ops = SmallOps(step_cache, tuple(mesh.devices.flat))
        outer, self.treedef, layers = split_model(model)
        self._weights: list[tuple[LlamaModel, LlamaModel, tuple[tuple[jax.Array, ...], ...]] | None] = [
            (model, outer, layers),
            None,
        ]
        """Two weight slots (model, outer, layers' leaves): a step runs on ``StepCall.weights``'s;
        the second holds a new version while the old one drains."""
        self._lora_leaves = lora_leaf_indices(model)
        """Positions of the LoRA stacks among a layer's leaves (``LoraLayer`` order; none without)."""
        backend = model.attention_backend  # picks the cache's layout (the kernel reads its own)
        self.cache_sharding = kv_cache_sharding(mapping, mesh, backend)
        # Penalty state is small next to the cache: replicated, so every row's slot is local.
        self.replicated = replicated(mesh)
        dtype, vocab = model.dtype, model.spec.vocab_size
        abstract = model.is_abstract  # shapes and shardings only

        def place(shape: tuple[int, ...], dtype: Any, sharding: NamedSharding) -> Any:
            if abstract:
                return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
            return jax.device_put(np.zeros(shape, dtype), sharding)

        cache_dtype = kv_dtype(kv_cache_dtype, dtype)
        if abstract:
            layout = cache_layout(model.spec, num_pages, page_size, cache_dtype, backend)
            self.kv_cache = make_cache([place(s, dt, self.cache_sharding) for s, dt in layout], backend, cache_dtype)
        self._cache_args = (model.spec, num_pages, page_size, cache_dtype, mesh, mapping, backend)
        self.host_kv: HostKV | None = None
        if not abstract:
            self.kv_cache = init_kv_cache(*self._cache_args, self._small_ops)
            if host_pages:
                self.host_kv = HostKV(self.kv_cache, host_pages, self.cache_sharding, self._small_ops)
                self.kv_cache = self.host_kv.warm(self.kv_cache)
        self.compiled = Executables(self.call_args, out_trees(self.kv_cache), tuple(mesh.devices.flat), step_cache)
        # The dtype of the hidden states the forward hands the head (that of the embeddings).
        self.hidden_dtype = jax.eval_shape(lambda o: o.embed_tokens(jnp.zeros((1, 1), jnp.int32)), self.outer).dtype
        self.counts = place((num_slots, vocab), np.int32, self.replicated)
        self.prompt_mask = place((num_slots, vocab), np.bool_, self.replicated)
        # The last step's sampled tokens, on the device: the next step takes a token still in
        # flight on the host from here (one row per sequence a step can hold: num_slots rows).
        self.fed = place((num_slots,), np.int32, self.replicated)
        self.mask_words = -(-vocab // 32)
        """Words per row of a grammar bitmask."""
        self._no_masks: dict[int, Any] = {}
        self._no_samples: dict[int, SampleOutput] = {}
        self.ran: set[BuildKey] = set()  # executables run at least once (a step, or ``priming.py``)
        self.calls: collections.Counter[BuildKey] = collections.Counter()
        """Calls of each step executable by the steps served (priming not counted): the benchmarks
        and tests read which executables a stretch of serving ran, and tokens per call."""

    def run(self, ops: Sequence[Op], progress: Progress | None = None) -> list[StepOutput]:
        """Apply ``ops`` in order (dispatched, not awaited); the outputs of its steps, in order."""
        outputs: list[StepOutput] = []
        for op in ops:
            if isinstance(op, StepCall):
                outputs.append(self._step(op))
            elif isinstance(op, CompileSteps):
                keys, built = self.keys(op), self.compiled.built
                if op.background:
                    self.compiled.build_in_background(keys, wanted={("forward", s) for s in op.urgent})
                    continue
                built.update(self._take_prebuilt())
                missing = [key for key in keys if key not in built]
                built.update(self.compiled.build(missing, progress))
                if progress is not None and not missing:
                    progress(len(keys), len(keys))
            elif isinstance(op, CopyPage):
                args: tuple[Any, ...] = (self.kv_cache, np.int32(op.src), np.int32(op.dst))
                self.kv_cache = self._small_ops(copy_page, args, (self.cache_sharding,))
            elif isinstance(op, SavePages | LoadPages):
                assert self.host_kv is not None, "host-tier transfers need engine.kv_offloading_size"
                self.kv_cache = self.host_kv.apply(op, self.kv_cache)
            elif isinstance(op, ClearSlot):
                args = (self.counts, self.prompt_mask, np.int32(op.slot))
                self.counts, self.prompt_mask = self._small_ops(clear_slot, args)
            elif isinstance(op, WriteAdapter):
                self._write_adapter(op)
            elif isinstance(op, PrimeSteps):
                prime_built(self, op)
            else:
                args = (
                    self.counts,
                    self.prompt_mask,
                    np.int32(op.slot),
                    op.ids,
                    np.int32(op.n),
                    np.bool_(op.to_prompt),
                )
                self.counts, self.prompt_mask = self._small_ops(write_slot, args)
        return outputs

    # -- weights ------------------------------------------------------------------------------
    @property
    def model(self) -> LlamaModel:
        """The model of the weights in use (the first loaded slot: every slot has its shapes)."""
        return next(w for w in self._weights if w is not None)[0]

    @property
    def outer(self) -> LlamaModel:
        """The first loaded slot's model without its layers (``split_model``)."""
        return next(w for w in self._weights if w is not None)[1]

    @property
    def layers(self) -> tuple[tuple[jax.Array, ...], ...]:
        """The first loaded slot's layers' leaves."""
        return next(w for w in self._weights if w is not None)[2]

    def install_weights(self, slot: int, model: LlamaModel) -> None:
        """Hold ``model`` (a version of the served weights, on this mesh with the same shapes, dtypes
        and shardings: nothing compiles) in weight slot ``slot``; its LoRA stacks are those in use."""
        outer, _, layers = split_model(model)
        if self._lora_leaves:  # the adapters written so far stay resident
            layers = tuple(
                tuple(old[j] if j in self._lora_leaves else leaf for j, leaf in enumerate(new))
                for new, old in zip(layers, self.layers, strict=True)
            )
        self._weights[slot] = (model, outer, layers)

    @property
    def weight_slots(self) -> list[tuple[LlamaModel, LlamaModel, tuple[tuple[jax.Array, ...], ...]] | None]:
        """The two weight slots (model, outer, layers' leaves), None where empty (``device_sleep``)."""
        return self._weights

    def put_weights(self, slot: int, model: LlamaModel) -> None:
        """Slot ``slot`` holds ``model`` as it is, LoRA stacks included (a woken copy of its own)."""
        outer, _, layers = split_model(model)
        self._weights[slot] = (model, outer, layers)

    def free_kv_cache(self) -> None:
        """Free the KV cache's device arrays (sleep mode; ``restore_kv_cache`` makes it again)."""
        for leaf in jax.tree.leaves(self.kv_cache):
            leaf.delete()

    def restore_kv_cache(self) -> None:
        """A zeroed KV cache in the same layout and shardings (nothing compiles: ``SmallOps``)."""
        self.kv_cache = init_kv_cache(*self._cache_args, self._small_ops)

    def drop_weights(self, slot: int) -> None:
        """Let weight slot ``slot`` go (its arrays are freed once no step in flight holds them)."""
        assert any(w is not None for i, w in enumerate(self._weights) if i != slot), "a slot stays loaded"
        self._weights[slot] = None

    def _write_adapter(self, op: WriteAdapter) -> None:
        """Put an adapter's arrays into slot ``op.slot`` of every layer's LoRA stacks (the layers'
        leaves at ``_lora_leaves``, donated and replaced), in every loaded weight slot (they share
        the stacks)."""
        at = self._lora_leaves
        assert at, "a WriteAdapter needs a model loaded with LoRA stacks"
        stacks = tuple(leaves[j] for leaves in self.layers for j in at)
        written = iter(self._small_ops(write_adapter, (stacks, np.int32(op.slot), op.arrays)))
        new = [list(leaves) for leaves in self.layers]
        for leaves in new:
            for j in at:
                leaves[j] = next(written)
        for i, w in enumerate(self._weights):
            if w is not None:
                layers = tuple(
                    tuple(fresh[j] if j in at else leaf for j, leaf in enumerate(mine))
                    for fresh, mine in zip(new, w[2], strict=True)
                )
                self._weights[i] = (w[0], w[1], layers)

    def _step(self, op: StepCall) -> StepOutput:
        """One step: a decode call (``op.steps`` >= 1), or the forward, the head in the host's mode
        and the prompt scorer when asked; each dispatched, none awaited."""
        n1 = op.shape.singles
        weights = self._weights[op.weights]
        assert weights is not None, f"a step on weight slot {op.weights}, which holds none"
        _, outer, layers = weights
        if op.steps:  # a decode call: forward, head and sampler, K tokens, one executable
            key: BuildKey = ("loop", op.shape, op.steps, op.mode)
            self.ran.add(key)
            self.calls[key] += 1
            loop = self.compiled.get(key)
            sampled, self.kv_cache, self.counts, self.fed = loop(
                outer, layers, self.kv_cache, self.counts, self.prompt_mask, self.fed,
                pack_step(op.batch, op.ints, op.floats), self._bitmask(op),
            )  # fmt: skip
            return StepOutput(sampled, None, np.zeros((n1, 0), np.float32))  # nothing pools here
        fwd: ForwardOutput
        kind = "forward" if op.images is None else "forward_images"
        forward = self.compiled.get((kind, op.shape))
        self.ran.add((kind, op.shape))
        self.calls[kind, op.shape] += 1
        packed = pack_step(op.batch, op.ints, op.floats)  # the step's one transfer
        # A step holding image tokens takes their embeddings ([T, embed], and where each token's image ends: [T]).
        images = () if op.images is None else ((op.images.astype(self.hidden_dtype), op.image_ends, op.image_rope),)
        fwd, self.kv_cache = forward(outer, layers, self.kv_cache, self.fed, packed, *images)
        if self.sampler:
            self.ran.add(("head", n1, op.mode))
            self.calls["head", n1, op.mode] += 1
            head = self.compiled.get(("head", n1, op.mode))
            sampled, self.counts, self.fed = head(
                outer, fwd.last, self.counts, self.prompt_mask, self.fed, fwd.ints, fwd.floats, self._bitmask(op)
            )
        else:
            sampled = self._zero_samples(n1)
        scores = None
        if op.score:
            self.ran.add(("score", op.shape.tokens))
            self.calls["score", op.shape.tokens] += 1
            scores = self.compiled.get(("score", op.shape.tokens))(outer, fwd.hidden, fwd.following)
        return StepOutput(sampled, scores, fwd.pooled)

    def _bitmask(self, op: StepCall) -> Any:
        """Every sampling row's grammar mask: the constrained rows', or the device's all-ones one."""
        if op.bitmask is None:
            return self.no_mask(op.shape.singles)
        # Placed as the all-ones one is: the executable takes one sharding.
        return jax.device_put(_full_mask(op, self.mask_words), self.replicated)

    def keys(self, op: CompileSteps) -> list[BuildKey]:
        """What a ``CompileSteps`` builds here (an embedding-only deployment has no head nor scorer)."""
        keys: list[BuildKey] = [("forward", s) for s in (*op.urgent, *op.shapes)]
        keys += [("forward_images", s) for s in op.images]
        if self.sampler:
            keys += [("head", rows, mode) for rows, mode in op.heads]
            keys += [("score", tokens) for tokens in op.scores]
            keys += [("loop", shape, steps, mode) for shape, steps, mode in op.loops]
        return keys

    def executables(self) -> dict[BuildKey, Step]:
        """Every executable built so far, by ``BuildKey`` (tests read their compiled HLO)."""
        return dict(self.compiled.built)

    def background_builds_done(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the background builds; whether they are all done."""
        return self.compiled.background_done(timeout)

    def stop_background_builds(self) -> None:
        """Cancel the background builds not yet started (the one under way ends on its own)."""
        self.compiled.stop_background()

    def memory_stats(self) -> list[dict[str, int]]:
        """Each device's allocator figures (``peak_bytes_in_use``...); empty where none (the CPU)."""
        here = jax.process_index()  # another process's devices of a multi-host mesh report nothing here
        return [dict(d.memory_stats() or {}) for d in self.mesh.devices.flat if d.process_index == here]

    def step_ready(self, shape: StepShape) -> bool:
        """Whether the forward of ``shape`` is built (without waiting)."""
        return self.compiled.ready(("forward", shape))

    def want_step(self, shape: StepShape) -> None:
        """The forward of ``shape`` built next, ungated (``Executables.want``)."""
        self.compiled.want(("forward", shape))

    def loop_ready(self, shape: StepShape, steps: int) -> bool:
        """Whether the several-token calls of ``shape`` are built for every sampler mode (without waiting)."""
        return bool(self.sampler) and all(self.compiled.ready(("loop", shape, steps, m)) for m in HEAD_MODES)

    def read(self, output: StepOutput, *, tops: bool, scored: bool, pooled: bool = False) -> StepRead:
        """A step's results on the host, fetched in one transfer (``Device.read``)."""
        sampled = output.sampled
        arrays = [sampled.tokens, sampled.logprobs]
        if tops:
            arrays += [sampled.top_ids, sampled.top_logprobs]
        if scored:
            assert output.scores is not None, "a step read for its scores ran the scorer"
            arrays += list(output.scores)
        if pooled:
            assert isinstance(output.pooled, jax.Array), "a step read for its pooled rows ran the forward"
            arrays.append(output.pooled)
        got = fetch(arrays)
        end = len(got) - pooled
        return StepRead(
            tokens=got[0],
            logprobs=got[1],
            top_ids=got[2] if tops else None,
            top_logprobs=got[3] if tops else None,
            scores=(got[end - 4], got[end - 3], got[end - 2], got[end - 1]) if scored else None,
            pooled=got[-1] if pooled else None,
        )

    def lower_step(self, shape: StepShape) -> jax.stages.Lowered:
        """The forward executable of ``shape`` traced and lowered for this executor's arrays (not compiled)."""
        return self.lower(("forward", shape))

    def lower(self, key: BuildKey) -> jax.stages.Lowered:
        """Any executable of this executor (``BuildKey``) traced and lowered, not compiled."""
        fn, static, args = self.call_args(key)
        return fn.lower(*static, *args)

    def call_args(self, key: BuildKey, live: bool = False) -> tuple[Any, tuple[object, ...], tuple[object, ...]]:
        """(jitted function, static arguments, dynamic arguments) of the executable of ``key``
        (``executable_args.py``): the state a step replaces is given as stand-ins in its own
        shardings unless ``live`` (priming runs on the arrays themselves)."""
        return executable_args(self, key, self._state_args(live))

    def _state_args(self, live: bool) -> tuple[Any, Any, Any, Any]:
        """(KV cache, counts, prompt mask, fed): the arrays when ``live``, else stand-ins of their
        shapes and dtypes in the shardings they were made with."""
        state = (self.kv_cache, self.counts, self.prompt_mask, self.fed)
        return state if live else stand_ins(state, self.cache_sharding, self.replicated)

    def no_mask(self, rows: int) -> Any:
        """The all-ones bitmask of a step with ``rows`` sampling rows, kept on the device."""
        mask = self._no_masks.get(rows)
        if mask is None:
            mask = self._no_masks[rows] = jax.device_put(
                np.full((rows, self.mask_words), -1, np.int32), self.replicated
            )
        return mask

    def build_all(self, op: CompileSteps) -> Prebuilt:
        """``_build`` for an abstract executor's early start: its builds of ``op``'s executables,
        and the signature they were built for (shapes, dtypes and shardings of every state array)."""
        return self.compiled.build(self.keys(op)), _signature(self._state())

    def _zero_samples(self, rows: int) -> SampleOutput:
        """What an embedding-only deployment's steps return for samples (nothing samples), kept on the device."""
        out = self._no_samples.get(rows)
        if out is None:
            k = MAX_TOP_LOGPROBS
            ints, floats = jnp.zeros((rows, k), jnp.int32), jnp.zeros((rows, k), jnp.float32)
            out = self._no_samples[rows] = SampleOutput(ints[:, 0], floats[:, 0], ints, floats)
        return out

    def _take_prebuilt(self) -> dict[BuildKey, Step]:
        """The early builds if they were made for exactly this executor's arrays (else none)."""
        if self._prebuilt is None:
            return {}
        built, signature = self._prebuilt.result()
        self._prebuilt = None
        if signature != _signature(self._state()):
            logger.warning("step executables built early do not match the loaded model: building them again")
            return {}
        return built

    def _state(self) -> tuple[object, ...]:
        """What every step takes after its static arguments: the weights, the cache (donated), the
        penalty tables and the last step's samples."""
        return self.outer, self.layers, *self._state_args(live=False)  # (in the shardings they were made with)


Prebuilt = tuple[dict[BuildKey, Step], list[tuple[object, ...]]]
"""Step executables built before the weights were read, and the state signature they were built for."""


def _signature(state: object) -> list[tuple[object, ...]]:
    """Shape, dtype and sharding of every array (or abstract array) in ``state``."""
    return [(a.shape, a.dtype, a.sharding) for a in jax.tree_util.tree_leaves(state)]
