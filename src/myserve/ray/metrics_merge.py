"""Several replicas' Prometheus metrics as one exposition: each series gains a ``replica`` label,
and each metric family is written once (a scraper rejects a family split in two).

The ingress's ``/metrics`` serves this, so one scrape of the Ray Serve address sees every replica
(``vllm:num_requests_waiting{replica=...}`` for an autoscaler, the per-replica prefix-cache hits
for whoever checks the routing). Parsing and writing are prometheus_client's.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

REPLICA_LABEL = "replica"


class _Families:
    """A collector yielding already-built families (what ``generate_latest`` writes)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def merge_metrics(texts: Mapping[str, str]) -> str:
    """The expositions ``texts`` (replica id -> its ``/metrics`` text) as one, labelled by replica."""
    families: dict[str, Metric] = {}
    for replica, text in texts.items():
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                labels = {**s.labels, REPLICA_LABEL: replica}
                merged.samples.append(Sample(s.name, labels, s.value, s.timestamp, s.exemplar))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))  # type: ignore[arg-type]
    return generate_latest(registry).decode("utf-8")
