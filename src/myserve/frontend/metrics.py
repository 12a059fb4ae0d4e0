"""Prometheus metrics (prometheus-client), one registry per app so tests can run several apps.

With several front-end processes (``--api-server-count``) ``serve`` turns on prometheus_client's
multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``): each process writes its figures to files there,
and a scrape of any front end merges them: counters and histograms add up over the front ends, and
the engine gauges (the core's counters, which every front end receives) take the latest value set.
"""

from __future__ import annotations

import os
from functools import partial
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import Gauge as _Gauge
from prometheus_client.multiprocess import MultiProcessCollector

if TYPE_CHECKING:
    from myserve.frontend.engine import Engine


Gauge = partial(_Gauge, multiprocess_mode="mostrecent")
"""The engine's gauges: one value (the core's), whichever front end set it last."""

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    """Request counters and latency histograms, plus engine gauges refreshed on every scrape."""

    def __init__(self, service: Engine):
        self.service = service
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "myserve_requests", "Finished requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("myserve_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("myserve_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram(
            "myserve_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "myserve_inter_token_latency_seconds", "Time between streamed tokens", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "myserve_e2e_request_latency_seconds", "Request latency", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.waiting = Gauge("myserve_num_requests_waiting", "Sequences waiting for admission", registry=r)
        self.running = Gauge("myserve_num_requests_running", "Sequences running", registry=r)
        self.pages_used = Gauge("myserve_kv_pages_used", "KV cache pages referenced", registry=r)
        self.pages_total = Gauge("myserve_kv_pages_total", "KV cache pages", registry=r)
        self.grammar_matchers = Gauge(
            "myserve_grammar_matchers_active",
            "Grammar matchers alive in the engine (unfinished constrained sequences)",
            registry=r,
        )
        self.penalty_slots = Gauge("myserve_penalty_slots_used", "Penalty slots owned by running sequences", registry=r)
        self.hit_rate = Gauge("myserve_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache", registry=r)
        self.compiles = Gauge(
            "myserve_compile_count", "XLA executables built in this process (compiled or loaded)", registry=r
        )
        self.cache_loads = Gauge(
            "myserve_compile_cache_loads", "Of those, loaded from the persistent compilation cache", registry=r
        )
        self.preemptions = Gauge("myserve_num_preemptions", "Sequences preempted so far", registry=r)
        self.host_seconds = Gauge(
            "myserve_engine_host_seconds",
            "Engine-thread seconds so far by phase (plan, dispatch, read, postprocess)",
            ["phase"],
            registry=r,
        )
        self.steps = Gauge("myserve_engine_steps", "Engine steps run (each replica's counted)", registry=r)
        self.step_gap = Gauge(
            "myserve_engine_step_gap_seconds",
            "Mean host-measured gap from reading a step's results to dispatching the next (last 100 steps)",
            registry=r,
        )
        self.frontend_seconds = Counter(
            "myserve_frontend_seconds",
            "Front-end seconds turning engine outputs into response chunks and bodies (event loop)",
            registry=r,
        )

    def render(self) -> bytes:
        """The exposition text, with engine gauges read now."""
        s = self.service.stats()
        self.waiting.set(s.waiting)
        self.running.set(s.running)
        self.pages_used.set(s.pages_used)
        self.pages_total.set(s.pages_total)
        self.grammar_matchers.set(s.grammar_matchers)
        self.penalty_slots.set(s.penalty_slots_used)
        self.hit_rate.set(s.prefix_cache_hit_rate)
        self.compiles.set(s.compile_count)
        self.cache_loads.set(s.cache_load_count)
        self.preemptions.set(s.num_preemptions)
        for phase, seconds in s.host_seconds.items():
            self.host_seconds.labels(phase).set(seconds)
        self.step_gap.set(s.step_gap_seconds)
        self.steps.set(s.steps)
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # every front end's files, merged
            merged = CollectorRegistry()
            MultiProcessCollector(merged)
            return generate_latest(merged)
        return generate_latest(self.registry)
