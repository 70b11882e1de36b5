"""/metrics: vLLM's metric names with a `nanokv:` prefix, in Prometheus' text format.

Request metrics (tokens, finished requests, latency histograms) are recorded from each
step's IterationStats on the event loop. Engine gauges and the engine's own counters
(KV use, fragmentation, prefix-cache tokens, preemptions) are read at scrape time from an
EngineSnapshot the engine thread takes between two steps, so the engine loop pays nothing
for them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nanokv.async_llm import EngineSnapshot, IterationStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets, with finer ones at the low end for fast CPU steps.
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_E2E_BUCKETS = [0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]

FINISH_REASONS = ("stop", "length", "error")


class ServerMetrics:
    """One registry per server (not prometheus_client's global one)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        labels, values = ["model_name"], [model_name]
        reg = self.registry
        self.prompt_tokens = Counter("nanokv:prompt_tokens", "Prompt tokens, once per prompt as usage counts "
                                     "them, at a request's first output", labels, registry=reg).labels(*values)
        self.generation_tokens = Counter("nanokv:generation_tokens", "Generated tokens, as outputs arrive", labels,
                                         registry=reg).labels(*values)
        success = Counter("nanokv:request_success", "Finished samples by finish reason (n samples of "
                          "a request count n; aborted ones are not counted)", labels + ["finished_reason"],
                          registry=reg)
        self.request_success = {r: success.labels(model_name, r) for r in FINISH_REASONS}
        self.ttft = Histogram("nanokv:time_to_first_token_seconds", "Time from arrival to the first token "
                              "(streamed requests)",
                              labels, buckets=_TTFT_BUCKETS, registry=reg).labels(*values)
        self.itl = Histogram("nanokv:inter_token_latency_seconds", "Time between two steps' tokens of a "
                             "streamed request",
                             labels, buckets=_ITL_BUCKETS, registry=reg).labels(*values)
        self.e2e = Histogram("nanokv:e2e_request_latency_seconds", "Time from arrival to the last token",
                             labels, buckets=_E2E_BUCKETS, registry=reg).labels(*values)
        self._engine = _EngineCollector(model_name)
        reg.register(self._engine)

    def record(self, stats: IterationStats) -> None:
        """A stat logger for AsyncLLM: called on the event loop after each step."""
        if stats.num_prompt_tokens:
            self.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.inc(stats.num_generation_tokens)
        for t in stats.time_to_first_tokens:
            self.ttft.observe(t)
        for t in stats.inter_token_latencies:
            self.itl.observe(t)
        for req in stats.finished:
            self.e2e.observe(req.e2e_latency)
            for reason in req.finish_reasons:
                counter = self.request_success.get(reason)
                if counter is not None:
                    counter.inc()

    def render(self, snapshot: EngineSnapshot) -> bytes:
        self._engine.snapshot = snapshot
        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges and counters whose values the engine keeps (read from the last snapshot)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.snapshot: EngineSnapshot | None = None

    def describe(self):
        return []

    def collect(self):
        snap = self.snapshot
        if snap is None:
            return
        kv, labels = snap.kv, [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        yield gauge("nanokv:num_requests_running", "Sequences running (a request's n samples count n)",
                    snap.num_running)
        yield gauge("nanokv:num_requests_waiting", "Sequences waiting for admission", snap.num_waiting)
        yield gauge("nanokv:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1)", kv.usage)
        yield gauge("nanokv:kv_cache_used_blocks", "KV cache blocks in use", kv.used_blocks)
        yield gauge("nanokv:kv_cache_total_blocks", "KV cache blocks in the pool", kv.num_blocks)
        yield gauge("nanokv:kv_cache_peak_used_blocks", "The most KV cache blocks in use at once since the "
                    "server started", kv.peak_used_blocks)
        yield gauge("nanokv:kv_cache_fragmentation_tokens", "Allocated but unfilled KV slots (the tails of "
                    "running sequences' last blocks)", kv.fragmentation_tokens)
        yield counter("nanokv:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                      kv.prefix_query_tokens)
        yield counter("nanokv:prefix_cache_hits", "Prompt tokens found in the prefix cache", kv.prefix_hit_tokens)
        yield counter("nanokv:num_preemptions", "Preemptions (a sequence's blocks freed to be recomputed)",
                      kv.num_preemptions)
