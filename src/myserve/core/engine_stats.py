"""The engine core's counters as one ``EngineStats`` (for ``/metrics`` and the core's reports),
kept beside ``engine_core.py`` as a mixin of ``EngineCore``."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from myserve.core.images import ImageEncoding
from myserve.core.replica import Replica
from myserve.core.step_timer import StepTimer
from myserve.grammar import matchers_alive
from myserve.wire.outputs import EngineStats


class EngineCounters:
    """``EngineCore.stats``: what the engine counts, summed over its replicas."""

    replicas: list[Replica]
    num_pages: int
    timer: StepTimer
    _pending: int
    _prompt_computed: int
    _steps: int
    _max_decode_batch: int
    _generated: int
    _compile_counts: Callable[[], tuple[int, int]]
    weight_swaps: int
    weights_info: dict[str, object]
    image_encoder: ImageEncoding | None

    def _num_waiting(self) -> int:
        return sum(len(r.scheduler.waiting) for r in self.replicas)

    def stats(self) -> EngineStats:
        """Counters for metrics, summed over replicas (read without locking: each is a single int read)."""
        allocators = [r.allocator for r in self.replicas]
        queries, hits = sum(a.prefix_queries for a in allocators), sum(a.prefix_hits for a in allocators)
        compiled, loaded = self._compile_counts()
        hosts = [a.host for a in allocators if a.host is not None]
        return EngineStats(
            waiting=self._num_waiting() + self._pending,
            running=sum(len(r.scheduler.running) for r in self.replicas),
            pages_used=sum(a.num_used for a in allocators),
            pages_free=sum(a.num_free for a in allocators),
            pages_total=self.num_pages * len(self.replicas),
            prefix_cache_hit_rate=hits / queries if queries else 0.0,
            prefix_cache_hit_tokens=hits,
            prompt_tokens_computed=self._prompt_computed,
            compile_count=compiled + loaded,
            cache_load_count=loaded,
            num_preemptions=sum(r.scheduler.num_preemptions for r in self.replicas),
            steps=self._steps,
            max_decode_batch=self._max_decode_batch,
            generated_tokens=self._generated,
            host_seconds=dict(self.timer.seconds),
            step_gap_seconds=self.timer.mean_gap,
            grammar_matchers=matchers_alive(),
            penalty_slots_used=sum(r.scheduler.slots.num_used for r in self.replicas),
            prefix_cache_queries=queries,
            spec_drafts=sum(r.runner.spec_drafts for r in self.replicas),
            spec_draft_tokens=sum(r.runner.spec_draft_tokens for r in self.replicas),
            spec_accepted_tokens=sum(r.runner.spec_accepted for r in self.replicas),
            spec_accepted_per_pos=_summed([r.runner.spec_accepted_per_pos for r in self.replicas]),
            weight_swaps=self.weight_swaps,
            weights_version=str(self.weights_info["version"]),
            weights_loaded_at=float(cast(float, self.weights_info["loaded_at"])),
            host_tier_hit_tokens=sum(h.hit_tokens for h in hosts),
            host_tier_pages_used=sum(h.num_used for h in hosts),
            host_tier_pages_total=sum(h.num_slots for h in hosts),
            host_tier_saved_pages=sum(h.saved_pages for h in hosts),
            images_encoded=self.image_encoder.encoded if self.image_encoder is not None else 0,
            image_cache_hits=self.image_encoder.cache_hits if self.image_encoder is not None else 0,
            primed=all(r.runner.warmed_up and r.runner.primed for r in self.replicas),
        )


def _summed(counts: list[list[int]]) -> tuple[int, ...]:
    """Per-position counts of several replicas added up (lists of any lengths)."""
    width = max((len(c) for c in counts), default=0)
    return tuple(sum(c[i] for c in counts if i < len(c)) for i in range(width))
