"""/metrics: vLLM's metrics (the engine's, nanokv/metrics), nanokv's own KV cache extras
under `nanokv:`, and the process collector, in Prometheus' text format.

The engine records requests and steps into its registry as they happen; the gauges and the
engine's own counters (KV use, prefix-cache tokens, preemptions) come from an
EngineSnapshot the engine thread takes between two steps, so the engine loop pays nothing
for a scrape.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import GaugeMetricFamily

from nanokv.metrics import ENGINE_INDEX, LABELS, EngineMetrics, EngineSnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    """One registry per server (not prometheus_client's global one): the engine's metrics,
    nanokv's extras and the process' (process_cpu_seconds_total, process_resident_memory_bytes,
    ...)."""

    def __init__(self, engine_metrics: EngineMetrics, model_name: str):
        engine_metrics.set_model_name(model_name)
        self.engine = engine_metrics
        self.registry = CollectorRegistry(auto_describe=False)
        self._engine = _EngineCollector(engine_metrics)
        self.registry.register(self._engine)
        ProcessCollector(registry=self.registry)

    def render(self, snapshot: EngineSnapshot) -> bytes:
        self._engine.snapshot = snapshot
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, engine_metrics: EngineMetrics):
        self.metrics = engine_metrics
        self.snapshot: EngineSnapshot | None = None

    def describe(self):
        return []

    def collect(self):
        snap = self.snapshot
        if snap is None:
            return
        yield from self.metrics.collect(snap)
        kv, values = snap.kv, [self.metrics.model_name, ENGINE_INDEX]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            family.add_metric(values, value)
            return family

        yield gauge("nanokv:kv_cache_used_blocks", "KV cache blocks in use", kv.used_blocks)
        yield gauge("nanokv:kv_cache_total_blocks", "KV cache blocks in the pool", kv.num_blocks)
        yield gauge("nanokv:kv_cache_peak_used_blocks", "The most KV cache blocks in use at once since the "
                    "server started", kv.peak_used_blocks)
        yield gauge("nanokv:kv_cache_fragmentation_tokens", "Allocated but unfilled KV slots (the tails of "
                    "running sequences' last blocks)", kv.fragmentation_tokens)
        yield gauge("nanokv:kv_cache_reserved_bytes", "Bytes of the KV pool's allocation (this rank's, the "
                    "scratch block included)", kv.reserved_bytes)
        yield gauge("nanokv:kv_cache_committed_bytes", "Bytes of the KV pool in memory: on the CPU the blocks "
                    "used at least once (pages are committed on first write); on CUDA the whole pool",
                    kv.committed_bytes)
