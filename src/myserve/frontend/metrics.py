"""Prometheus metrics (prometheus-client), one registry per app so tests can run several apps.
Every series carries a ``model_name`` label (as vLLM's do): ``Metrics`` holds the app's metric
families, ``ModelMetrics`` one served model's series of them, which its requests update.

With several front-end processes (``--api-server-count``) ``serve`` turns on prometheus_client's
multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``): each process writes its figures to files there,
and a scrape of any front end merges them: counters and histograms add up over the front ends, and
the engine gauges (the core's counters, which every front end receives) take the latest value set;
the core's cumulative counts (``EngineCounters``) are read from the scraped front end's engine.
"""

from __future__ import annotations

import os
from functools import partial
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import Gauge as _Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from myserve.frontend.engine import Engine


Gauge = partial(_Gauge, multiprocess_mode="mostrecent")
"""The engine's gauges: one value (the core's), whichever front end set it last."""

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    """The app's metric families (request counters, latency histograms, engine gauges), each
    labelled with ``model_name`` first; ``for_model`` gives one model's series.

    vLLM's names and types (``vllm:*``) for what vLLM also measures, so that its Grafana dashboard
    and autoscaling rules work unchanged; ``myserve_*`` only where vLLM has no equivalent."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.models: list[ModelMetrics] = []
        self.engine_counters = EngineCounters(self.models)
        r.register(self.engine_counters)
        self.requests = Counter(
            "myserve_requests", "Finished requests by endpoint and status", [*m, "endpoint", "status"], registry=r
        )
        self.request_success = Counter(
            "vllm:request_success",
            "Count of finished requests (one per choice) by finish reason: stop, length, abort or error",
            [*m, "finished_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", m, registry=r)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", m, registry=r
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            m,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            m,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            m,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", m, registry=r)
        self.running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", m, registry=r
        )
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", m, registry=r)
        # vLLM V0's names, which vLLM's production-stack router still reads for its routing.
        self.gpu_cache_usage = Gauge(
            "vllm:gpu_cache_usage_perc", "KV-cache usage (vLLM V0's name of kv_cache_usage_perc).", m, registry=r
        )
        self.prefix_hit_rate = Gauge(
            "vllm:gpu_prefix_cache_hit_rate", "Prefix cache hit tokens over queried tokens, since start.", m, registry=r
        )
        self.prefix_hit_tokens = Gauge(
            "myserve_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache since start, by tier (device pool, host memory)",
            [*m, "tier"],
            registry=r,
        )
        self.host_tier_pages = Gauge(
            "myserve_kv_host_pages_used", "Pages the host tier of the prefix cache holds", m, registry=r
        )
        self.host_tier_total = Gauge(
            "myserve_kv_host_pages_total", "Pages the host tier can hold (0: none)", m, registry=r
        )
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
        self.compiles = Gauge(
            "myserve_compile_count", "XLA executables built in this process (compiled or loaded)", m, registry=r
        )
        self.cache_loads = Gauge(
            "myserve_compile_cache_loads", "Of those, loaded from the persistent compilation cache", m, registry=r
        )
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
        """The exposition text, with every model's engine gauges and counters read now."""
        for model in self.models:
            model.refresh()
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # every front end's files, merged
            merged = CollectorRegistry()
            MultiProcessCollector(merged)
            # The core's counters are no front end's to add up: each front end receives the one
            # core's totals, so the scraped one reports them as they are.
            merged.register(self.engine_counters)
            return generate_latest(merged)
        return generate_latest(self.registry)


class EngineCounters(Collector):
    """The engine's cumulative counts as Prometheus counters, read from each model's engine at a
    scrape: they are the core's totals (set, never incremented here), which a ``Counter`` cannot
    hold, and which must not be added up over front ends in multiprocess mode."""

    FAMILIES = (
        ("vllm:num_preemptions", "Cumulative number of preemption from the engine."),
        ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
        ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
        ("vllm:gpu_prefix_cache_queries", "Prefix cache queries (vLLM V0's name, read by production-stack)."),
        ("vllm:gpu_prefix_cache_hits", "Prefix cache hits (vLLM V0's name, read by production-stack)."),
        ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
        ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
        ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
        ("myserve:weight_updates", "Versions of the weights switched to by live updates."),
        ("myserve:images_encoded", "Images run through the vision tower."),
        ("myserve:image_cache_hits", "Images whose embeddings came from the encoder cache."),
    )
    PER_POSITION = ("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.")
    WEIGHTS = (
        "myserve:weights_loaded_at_seconds",
        "Unix time the version of the weights new requests run on began serving.",
    )

    def __init__(self, models: list[ModelMetrics]):
        self.models = models

    def describe(self) -> list[Metric]:
        """The families, without samples (for the registry's name check)."""
        return [
            *(CounterMetricFamily(name, doc, labels=["model_name"]) for name, doc in self.FAMILIES),
            CounterMetricFamily(*self.PER_POSITION, labels=["model_name", "position"]),
            GaugeMetricFamily(*self.WEIGHTS, labels=["model_name", "version"]),
        ]

    def collect(self) -> list[Metric]:
        """Every model's counts now."""
        families = self.describe()
        *totals, per_position, weights = families
        for model in self.models:
            s = model.engine.stats()
            values = (
                s.num_preemptions,
                s.prefix_cache_queries,
                s.prefix_cache_hit_tokens,
                s.prefix_cache_queries,
                s.prefix_cache_hit_tokens,
                s.spec_drafts,
                s.spec_draft_tokens,
                s.spec_accepted_tokens,
                s.weight_swaps,
                s.images_encoded,
                s.image_cache_hits,
            )
            for family, value in zip(totals, values, strict=True):
                assert isinstance(family, CounterMetricFamily)
                family.add_metric([model.name], value)
            assert isinstance(per_position, CounterMetricFamily)
            for position, count in enumerate(s.spec_accepted_per_pos):
                per_position.add_metric([model.name, str(position)], count)
            assert isinstance(weights, GaugeMetricFamily)
            weights.add_metric([model.name, s.weights_version], s.weights_loaded_at)
        return families


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
        self.success = _Labelled(f.request_success, name)
        self.frontend_seconds = f.frontend_seconds.labels(name)

    def refresh(self) -> None:
        """Set this model's engine gauges from its engine's counters."""
        f, name, s = self.families, self.name, self.engine.stats()
        f.waiting.labels(name).set(s.waiting)
        f.running.labels(name).set(s.running)
        usage = s.pages_used / s.pages_total if s.pages_total else 0.0
        f.kv_usage.labels(name).set(usage)
        f.gpu_cache_usage.labels(name).set(usage)
        queries = s.prefix_cache_queries
        f.prefix_hit_rate.labels(name).set(s.prefix_cache_hit_tokens / queries if queries else 0.0)
        f.prefix_hit_tokens.labels(name, "device").set(s.prefix_cache_hit_tokens)
        f.prefix_hit_tokens.labels(name, "host").set(s.host_tier_hit_tokens)
        f.host_tier_pages.labels(name).set(s.host_tier_pages_used)
        f.host_tier_total.labels(name).set(s.host_tier_pages_total)
        f.pages_used.labels(name).set(s.pages_used)
        f.pages_total.labels(name).set(s.pages_total)
        f.grammar_matchers.labels(name).set(s.grammar_matchers)
        f.penalty_slots.labels(name).set(s.penalty_slots_used)
        f.compiles.labels(name).set(s.compile_count)
        f.cache_loads.labels(name).set(s.cache_load_count)
        for phase, seconds in s.host_seconds.items():
            f.host_seconds.labels(name, phase).set(seconds)
        f.step_gap.labels(name).set(s.step_gap_seconds)
        f.steps.labels(name).set(s.steps)

    def render(self) -> bytes:
        """The app's exposition text (every model's series)."""
        return self.families.render()
