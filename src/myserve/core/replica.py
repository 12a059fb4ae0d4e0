"""Data-parallel replicas: each row of the mesh serves its own share of the requests.

A replica is the model on one (1, model) slice of the mesh with its own KV pages, page allocator,
scheduler and runner. The service's one engine thread assigns each request to the least loaded
replica and, every iteration, dispatches each replica's step before reading any result, so the
replicas compute at the same time on their own devices.

Why replicas rather than one jitted step with the batch sharded over ``data``: a decode row gathers
its pages from the cache by host-computed page ids; with the rows sharded over ``data`` and the
pages too, XLA's SPMD partitioner cannot know that a row's pages are on its own shard and gathers
the whole cache across the data axis every layer (measured in ``docs/design/core.md``, "Data parallelism: replicas").
Replicas keep every step's gathers local, need no collectives between data shards, and reuse the
single-replica engine unchanged.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np

from myserve.config import EngineConfig
from myserve.core.adapters import AdapterRegistry, AdapterSlots
from myserve.core.draft import DraftProposer
from myserve.core.host_tier import HostTier
from myserve.core.ngram import PromptLookup
from myserve.core.pages import PageAllocator
from myserve.core.runner import ModelRunner
from myserve.core.scheduler import Proposer, Scheduler
from myserve.core.sequence import Sequence as Seq
from myserve.runtime.buckets import Buckets
from myserve.runtime.device import Device
from myserve.wire.images import ImageInput
from myserve.wire.params import SamplingParams

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Replica:
    """One data-parallel copy of the engine's device side and of its page bookkeeping."""

    allocator: PageAllocator
    scheduler: Scheduler
    runner: ModelRunner
    draft: DraftProposer | None = None
    """The draft model's proposer (``engine.speculative_method=draft_model``), warmed up with the runner."""

    @property
    def builders(self) -> list[ModelRunner | DraftProposer]:
        """What builds step executables at warmup: the runner, and the draft model's proposer."""
        return [self.runner] if self.draft is None else [self.runner, self.draft]

    @property
    def load(self) -> int:
        """Sequences it holds (running or waiting): new requests go to the least loaded replica."""
        return len(self.scheduler.running) + len(self.scheduler.waiting)


def make_replica(
    cfg: EngineConfig,
    device: Device,
    buckets: Buckets,
    eos_ids: Sequence[int],
    adapters: AdapterRegistry | None = None,
    adapter_zeros: tuple[np.ndarray, ...] = (),
    draft_device: Device | None = None,
    host_pages: int = 0,
    images: bool = False,
) -> Replica:
    """A replica whose runner sends its ops to ``device``, sized by the engine config; with
    ``adapters`` (LoRA served) its own device slots for them, ``adapter_zeros`` being an empty
    adapter's arrays (``LoraAdapter.flat()``); ``draft_device``: the draft model's executor of
    ``engine.speculative_method=draft_model``; ``host_pages``: the slots of its device's host tier
    of the prefix cache (0: none); ``images``: the model takes images (a vision-language model)."""
    pages, budget = cfg.num_pages, cfg.max_num_batched_tokens
    assert pages is not None and budget is not None, "Deployment.load resolves the pool and the step budget"
    host = HostTier(host_pages) if host_pages else None
    allocator = PageAllocator(pages, cfg.page_size, enable_prefix_cache=cfg.enable_prefix_caching, host=host)
    proposer: Proposer | None = None
    draft: DraftProposer | None = None
    if cfg.speculative_method == "ngram":
        proposer = PromptLookup(cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min)
    elif cfg.speculative_method == "draft_model":
        assert draft_device is not None, "a draft model's replica runs it on its own executor"
        proposer = draft = DraftProposer(
            draft_device, buckets=buckets, num_tokens=cfg.num_speculative_tokens, max_num_seqs=cfg.max_num_seqs,
            eos_ids=eos_ids,
        )  # fmt: skip
    scheduler = Scheduler(
        allocator,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=budget,
        max_prefill_chunk=budget,
        max_prefill_chunks=buckets.max_prefill_chunks,
        decode_steps_pages=0,
        adapters=None if adapters is None else AdapterSlots(adapters, cfg.max_loras),
        speculate=proposer,
    )  # one token per decode until the decode calls are built (the engine raises both then)
    runner = ModelRunner(
        device,
        buckets=buckets,
        max_num_seqs=cfg.max_num_seqs,
        eos_ids=eos_ids,
        decode_steps=cfg.decode_steps,
        adapter_zeros=adapter_zeros,
        decode_call_budget_s=cfg.decode_call_budget_ms / 1000,
        images=images,
    )
    return Replica(allocator, scheduler, runner, draft)


class Request:
    """Engine-thread state of one request: its choices, and the replica that holds them."""

    def __init__(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, images: Sequence[ImageInput] = ()
    ):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.images = tuple(images)
        """The prompt's images (encoded at admission: ``core/images.py``)."""
        self.seqs: list[Seq] = []
        self.unfinished = params.n
        self.error: str | None = None
        """Set when the engine failed it: its closing delta carries the message."""
        self.replica: Replica  # set at admission
