"""Data-parallel replicas: each row of the mesh serves its own share of the requests.

A replica is the model on one (1, model) slice of the mesh with its own KV pages, page allocator,
scheduler and runner. The service's one engine thread assigns each request to the least loaded
replica and, every iteration, dispatches each replica's step before reading any result, so the
replicas compute at the same time on their own devices.

Why replicas rather than one jitted step with the batch sharded over ``data``: a decode row gathers
its pages from the cache by host-computed page ids; with the rows sharded over ``data`` and the
pages too, XLA's SPMD partitioner cannot know that a row's pages are on its own shard and gathers
the whole cache across the data axis every layer (measured in ``docs/design/inference.md``).
Replicas keep every step's gathers local, need no collectives between data shards, and reuse the
single-replica engine unchanged.
"""

from __future__ import annotations

import dataclasses
import logging

from myserve.core.pages import PageAllocator
from myserve.core.runner import Device, ModelRunner
from myserve.core.scheduler import Scheduler
from myserve.runtime.buckets import Buckets
from myserve.runtime.deployment import Deployment, executor_for
from myserve.runtime.executor import Executor

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Replica:
    """One data-parallel copy of the engine's device side and of its page bookkeeping."""

    allocator: PageAllocator
    scheduler: Scheduler
    runner: ModelRunner

    @property
    def load(self) -> int:
        """Sequences it holds (running or waiting): new requests go to the least loaded replica."""
        return len(self.scheduler.running) + len(self.scheduler.waiting)


def engine_buckets(dep: Deployment) -> Buckets:
    """The deployment's step shapes (token buckets); int8 steps are at least MIN_ROWS tokens."""
    return Buckets.for_deployment(dep.config, dep.max_model_len)


def make_executors(dep: Deployment) -> list[Executor]:
    """One executor per replica: its weights, KV cache and penalty state on its slice of the mesh
    (with the step executables the deployment started building early, if it did)."""
    return [
        executor_for(dep.config, model, mesh, dep.mapping, prebuilt=dep.prebuilt[i] if dep.prebuilt else None)
        for i, (model, mesh) in enumerate(zip(dep.models, dep.meshes, strict=True))
    ]


def make_replica(dep: Deployment, device: Device, buckets: Buckets) -> Replica:
    """A replica whose runner sends its ops to ``device``."""
    cfg = dep.config.engine
    allocator = PageAllocator(cfg.num_pages, cfg.page_size, enable_prefix_cache=cfg.enable_prefix_caching)
    scheduler = Scheduler(
        allocator,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_prefill_chunk=cfg.max_num_batched_tokens,
        max_prefill_chunks=buckets.max_prefill_chunks,
    )
    runner = ModelRunner(
        device,
        buckets=buckets,
        max_num_seqs=cfg.max_num_seqs,
        eos_ids=dep.tokenizer.eos_token_ids,
    )
    return Replica(allocator, scheduler, runner)
