"""Prometheus metrics (prometheus-client), one registry per app so tests can run several apps.
Every series carries a ``model_name`` label (as vLLM's do): ``Metrics`` holds the app's metric
families, ``ModelMetrics`` one served model's series of them, which its requests update.

With several front-end processes (``--api-server-count``) ``serve`` turns on prometheus_client's
multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``): each process writes its figures to files there,
and a scrape of any front end merges them: counters and histograms add up over the front ends, and
the engine gauges (the core's counters, which every front end receives) take the latest value set.
"""

from __future__ import annotations

import os
from functools import partial
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import Gauge as _Gauge
from prometheus_client.multiprocess import MultiProcessCollector

if TYPE_CHECKING:
    from myserve.frontend.engine import Engine


Gauge = partial(_Gauge, multiprocess_mode="mostrecent")
"""The engine's gauges: one value (the core's), whichever front end set it last."""

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    """The app's metric families (request counters, latency histograms, engine gauges), each
    labelled with ``model_name`` first; ``for_model`` gives one model's series."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.models: list[ModelMetrics] = []
        self.requests = Counter(
            "myserve_requests", "Finished requests by endpoint and status", [*m, "endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("myserve_prompt_tokens", "Prompt tokens of finished requests", m, registry=r)
        self.generation_tokens = Counter("myserve_generation_tokens", "Generated tokens", m, registry=r)
        self.ttft = Histogram(
            "myserve_time_to_first_token_seconds", "Time to first token", m, buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "myserve_inter_token_latency_seconds",
            "Time between streamed tokens",
            m,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "myserve_e2e_request_latency_seconds", "Request latency", m, buckets=_LATENCY_BUCKETS, registry=r
        )
        self.waiting = Gauge("myserve_num_requests_waiting", "Sequences waiting for admission", m, registry=r)
        self.running = Gauge("myserve_num_requests_running", "Sequences running", m, registry=r)
        self.pages_used = Gauge("myserve_kv_pages_used", "KV cache pages referenced", m, registry=r)
        self.pages_total = Gauge("myserve_kv_pages_total", "KV cache pages", m, registry=r)
        self.grammar_matchers = Gauge(
            "myserve_grammar_matchers_active",
            "Grammar matchers alive in the engine (unfinished constrained sequences)",
            m,
            registry=r,
        )
        self.penalty_slots = Gauge(
            "myserve_penalty_slots_used", "Penalty slots owned by running sequences", m, registry=r
        )
        self.hit_rate = Gauge(
            "myserve_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache", m, registry=r
        )
        self.compiles = Gauge(
            "myserve_compile_count", "XLA executables built in this process (compiled or loaded)", m, registry=r
        )
        self.cache_loads = Gauge(
            "myserve_compile_cache_loads", "Of those, loaded from the persistent compilation cache", m, registry=r
        )
        self.preemptions = Gauge("myserve_num_preemptions", "Sequences preempted so far", m, registry=r)
        self.host_seconds = Gauge(
            "myserve_engine_host_seconds",
            "Engine-thread seconds so far by phase (plan, dispatch, read, postprocess)",
            [*m, "phase"],
            registry=r,
        )
        self.steps = Gauge("myserve_engine_steps", "Engine steps run (each replica's counted)", m, registry=r)
        self.step_gap = Gauge(
            "myserve_engine_step_gap_seconds",
            "Mean host-measured gap from reading a step's results to dispatching the next (last 100 steps)",
            m,
            registry=r,
        )
        self.frontend_seconds = Counter(
            "myserve_frontend_seconds",
            "Front-end seconds turning engine outputs into response chunks and bodies (event loop)",
            m,
            registry=r,
        )

    def for_model(self, name: str, engine: Engine) -> ModelMetrics:
        """The series of the model served as ``name`` by ``engine`` (whose gauges a scrape reads)."""
        model = ModelMetrics(self, name, engine)
        self.models.append(model)
        return model

    def render(self) -> bytes:
        """The exposition text, with every model's engine gauges read now."""
        for model in self.models:
            model.refresh()
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # every front end's files, merged
            merged = CollectorRegistry()
            MultiProcessCollector(merged)
            return generate_latest(merged)
        return generate_latest(self.registry)


class _Labelled:
    """A family with the model's label bound: ``labels`` takes the remaining label values."""

    def __init__(self, family: Counter | _Gauge, name: str):
        self.family, self.name = family, name

    def labels(self, *values: str) -> Any:
        return self.family.labels(self.name, *values)


class ModelMetrics:
    """One served model's series: what its requests count and observe (children bound to its
    ``model_name`` once, so a request pays no label lookup), and its engine's gauges."""

    def __init__(self, families: Metrics, name: str, engine: Engine):
        self.families, self.name, self.engine = families, name, engine
        f = families
        self.requests = _Labelled(f.requests, name)
        self.prompt_tokens = f.prompt_tokens.labels(name)
        self.generation_tokens = f.generation_tokens.labels(name)
        self.ttft = f.ttft.labels(name)
        self.itl = f.itl.labels(name)
        self.e2e = f.e2e.labels(name)
        self.frontend_seconds = f.frontend_seconds.labels(name)

    def refresh(self) -> None:
        """Set this model's engine gauges from its engine's counters."""
        f, name, s = self.families, self.name, self.engine.stats()
        f.waiting.labels(name).set(s.waiting)
        f.running.labels(name).set(s.running)
        f.pages_used.labels(name).set(s.pages_used)
        f.pages_total.labels(name).set(s.pages_total)
        f.grammar_matchers.labels(name).set(s.grammar_matchers)
        f.penalty_slots.labels(name).set(s.penalty_slots_used)
        f.hit_rate.labels(name).set(s.prefix_cache_hit_rate)
        f.compiles.labels(name).set(s.compile_count)
        f.cache_loads.labels(name).set(s.cache_load_count)
        f.preemptions.labels(name).set(s.num_preemptions)
        for phase, seconds in s.host_seconds.items():
            f.host_seconds.labels(name, phase).set(seconds)
        f.step_gap.labels(name).set(s.step_gap_seconds)
        f.steps.labels(name).set(s.steps)

    def render(self) -> bytes:
        """The app's exposition text (every model's series)."""
        return self.families.render()
