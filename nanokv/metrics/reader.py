"""vLLM's in-memory metric records (vllm.v1.metrics.reader): what LLM.get_metrics() returns.

The conversion reads a prometheus_client registry the way vLLM's reader reads its global
one: a counter's name without `_total` and its value as an int, a histogram's buckets keyed
by their `le` label ("0.5", "+Inf"), only the `vllm:` families.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Metric:
    """One metric of one label set."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A monotonically increasing integer counter."""

    value: int


@dataclass
class Vector(Metric):
    """An ordered array of integer counters (vLLM's speculative-decoding metric; nanokv has none)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    """A value that can go up or down."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations in buckets: buckets maps each upper bound (the `le` label, "+Inf"
    included) to the cumulative count; count is the "+Inf" bucket's, sum the observations'."""

    count: int
    sum: float
    buckets: dict[str, int]


def metrics_of(families, prefix: str = "vllm:") -> list[Metric]:
    """prometheus_client metric families (registry.collect()) as reader records."""
    collected: list[Metric] = []
    for family in families:
        if not family.name.startswith(prefix):
            continue
        if family.type == "gauge":
            collected += [Gauge(family.name, s.labels, s.value) for s in family.samples if s.name == family.name]
        elif family.type == "counter":
            total = family.name + "_total"
            collected += [Counter(family.name, s.labels, int(s.value)) for s in family.samples if s.name == total]
        elif family.type == "histogram":
            collected += _histograms(family)
    return collected


def _histograms(family) -> list[Histogram]:
    by_labels: dict[frozenset, Histogram] = {}

    def entry(labels: dict[str, str]) -> Histogram:
        key = frozenset(labels.items())
        if key not in by_labels:
            by_labels[key] = Histogram(family.name, dict(labels), 0, 0.0, {})
        return by_labels[key]

    for s in family.samples:
        if s.name == family.name + "_bucket":
            labels = {k: v for k, v in s.labels.items() if k != "le"}
            entry(labels).buckets[s.labels["le"]] = int(s.value)
        elif s.name == family.name + "_count":
            entry(s.labels).count = int(s.value)
        elif s.name == family.name + "_sum":
            entry(s.labels).sum = s.value
    return list(by_labels.values())
