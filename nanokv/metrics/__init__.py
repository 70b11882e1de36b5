"""vLLM's metrics: names, types, labels and buckets in one table, recorded by the engine.

The engine records into an EngineMetrics (its own prometheus_client registry, never the
global one) as requests are scheduled, produce tokens and finish; the server's /metrics
renders that registry, and LLM.get_metrics() reads it as vLLM's reader records. Gauges
and the engine's own counters (KV use, prefix-cache lookups, preemptions) are read from an
EngineSnapshot taken between two steps when the registry is collected.

Names, types, label sets and buckets are vLLM's (vllm/v1/metrics/loggers.py,
PrometheusStatLogger): labels model_name and engine ("0": nanokv runs one engine), a
counter `vllm:x` is exposed as `vllm:x_total`. Two names vLLM has deprecated are kept
because the dashboards and routers built for it still read them: vllm:gpu_cache_usage_perc
(= vllm:kv_cache_usage_perc) and vllm:time_per_output_token_seconds (= the inter-token
latency). Where nanokv's meaning is its own:
- vllm:num_requests_running / _waiting count sequences (a request's n samples count n, as
  vLLM's scheduler counts the child requests of n > 1).
- vllm:request_success counts samples by finish reason; aborted samples count as "abort".
- vllm:prompt_tokens counts a request's prompt once, when its first token comes.
- vllm:iteration_tokens_total observes the tokens each step computed (prefill chunks and
  decodes).
- vllm:inter_token_latency_seconds (and its alias) observes streamed requests only: a
  non-streamed request is not looked at between its first and last token;
  vllm:request_time_per_output_token_seconds covers every request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from nanokv.engine.stats import KVStats

LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"  # nanokv runs one engine per process (vLLM labels data-parallel engines 0, 1, ...)
FINISH_REASONS = ("stop", "length", "abort", "error")  # vLLM's FinishReason values

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
TOKENS = "tokens"  # buckets: build_1_2_5_buckets(max_model_len)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return buckets
            buckets.append(m * scale)
        scale *= 10


@dataclass(frozen=True)
class MetricSpec:
    name: str  # a counter's without "_total"
    kind: str  # "counter" | "gauge" | "histogram"
    doc: str
    buckets: tuple | str | None = None  # TOKENS: 1-2-5 up to max_model_len


# Recorded by the engine as requests move (histograms and token counters).
RECORDED = (
    MetricSpec("vllm:prompt_tokens", "counter", "Number of prefill tokens processed."),
    MetricSpec("vllm:generation_tokens", "counter", "Number of generation tokens processed."),
    MetricSpec("vllm:request_prompt_tokens", "histogram", "Number of prefill tokens processed.", TOKENS),
    MetricSpec("vllm:request_generation_tokens", "histogram", "Number of generation tokens processed.", TOKENS),
    MetricSpec("vllm:iteration_tokens_total", "histogram", "Histogram of number of tokens per engine_step.",
               ITERATION_TOKENS_BUCKETS),
    MetricSpec("vllm:request_max_num_generation_tokens", "histogram",
               "Histogram of maximum number of requested generation tokens.", TOKENS),
    MetricSpec("vllm:request_params_n", "histogram", "Histogram of the n request parameter.", N_BUCKETS),
    MetricSpec("vllm:request_params_max_tokens", "histogram", "Histogram of the max_tokens request parameter.",
               TOKENS),
    MetricSpec("vllm:time_to_first_token_seconds", "histogram", "Histogram of time to first token in seconds.",
               TTFT_BUCKETS),
    MetricSpec("vllm:inter_token_latency_seconds", "histogram", "Histogram of inter-token latency in seconds "
               "(streamed requests).", ITL_BUCKETS),
    MetricSpec("vllm:time_per_output_token_seconds", "histogram", "Histogram of time per output token in seconds."
               "DEPRECATED: Use vllm:inter_token_latency_seconds instead.", ITL_BUCKETS),
    MetricSpec("vllm:request_time_per_output_token_seconds", "histogram",
               "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS),
    MetricSpec("vllm:e2e_request_latency_seconds", "histogram", "Histogram of e2e request latency in seconds.",
               REQUEST_LATENCY_BUCKETS),
    MetricSpec("vllm:request_queue_time_seconds", "histogram",
               "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS),
    MetricSpec("vllm:request_inference_time_seconds", "histogram",
               "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS),
    MetricSpec("vllm:request_prefill_time_seconds", "histogram",
               "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS),
    MetricSpec("vllm:request_decode_time_seconds", "histogram",
               "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS),
)
REQUEST_SUCCESS = MetricSpec("vllm:request_success", "counter", "Count of successfully processed requests.")
# Read from the engine's state when collected.
STATE = (
    MetricSpec("vllm:num_requests_running", "gauge", "Number of requests in model execution batches."),
    MetricSpec("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed."),
    MetricSpec("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage."),
    MetricSpec("vllm:gpu_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage. "
               "DEPRECATED: Use vllm:kv_cache_usage_perc instead."),
    MetricSpec("vllm:prefix_cache_queries", "counter", "Prefix cache queries, in terms of number of queried tokens."),
    MetricSpec("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens."),
    MetricSpec("vllm:num_preemptions", "counter", "Cumulative number of preemption from the engine."),
)
CACHE_CONFIG_INFO = MetricSpec("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig")
LORA_REQUESTS_INFO = MetricSpec("vllm:lora_requests_info", "gauge", "Running stats on lora requests.")


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's gauges, read between two steps."""

    num_running: int  # sequences (a request's n samples count n)
    num_waiting: int  # sequences queued for admission (the server's handed-over ones included)
    kv: KVStats


class EngineMetrics:
    """The vllm: metrics of one engine. Recording methods are called by the engine (its
    thread, under its lock); collect() may run on another thread (prometheus_client's
    metrics take their own locks)."""

    def __init__(self, model_name: str, max_model_len: int, cache_info: dict[str, str]):
        self.max_model_len = max_model_len
        self.cache_info = dict(cache_info)
        self.set_model_name(model_name)

    def set_model_name(self, model_name: str) -> None:
        """The model_name label (a server's first --served-model-name). Starts the metrics
        afresh: call it before any request."""
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.model_name = model_name
        self.registry = reg = CollectorRegistry(auto_describe=True)
        values = (model_name, ENGINE_INDEX)
        made = {}
        for spec in RECORDED:
            if spec.kind == "counter":
                made[spec.name] = Counter(spec.name, spec.doc, LABELS, registry=reg).labels(*values)
            else:
                buckets = build_1_2_5_buckets(self.max_model_len) if spec.buckets == TOKENS else spec.buckets
                made[spec.name] = Histogram(spec.name, spec.doc, LABELS, buckets=buckets, registry=reg).labels(*values)
        success = Counter(REQUEST_SUCCESS.name, REQUEST_SUCCESS.doc, LABELS + ("finished_reason",), registry=reg)
        self._success = {r: success.labels(*values, r) for r in FINISH_REASONS}
        self._prompt_tokens, self._generation_tokens = made["vllm:prompt_tokens"], made["vllm:generation_tokens"]
        self._iteration_tokens = made["vllm:iteration_tokens_total"]
        self._ttft = made["vllm:time_to_first_token_seconds"]
        self._itl = (made["vllm:inter_token_latency_seconds"], made["vllm:time_per_output_token_seconds"])
        self._finished = [(made[name], attr) for name, attr in _FINISHED]
        self._n = made["vllm:request_params_n"]
        self._max_tokens = made["vllm:request_params_max_tokens"]
        self._max_generated = made["vllm:request_max_num_generation_tokens"]
        self.state = _StateCollector(values, self.cache_info)
        reg.register(self.state)

    # ---- recording (the engine) ----------------------------------------------------------
    def on_step(self, num_tokens: int, num_generated: int) -> None:
        """A step computed num_tokens tokens and sampled num_generated."""
        self._iteration_tokens.observe(num_tokens)
        if num_generated:
            self._generation_tokens.inc(num_generated)

    def on_first_token(self, ttft: float, num_prompt_tokens: int) -> None:
        self._ttft.observe(ttft)
        self._prompt_tokens.inc(num_prompt_tokens)

    def on_inter_token(self, latency: float) -> None:
        for histogram in self._itl:
            histogram.observe(latency)

    def count_finished(self, reasons: list[str]) -> None:
        """Samples that ended (finished, failed or aborted), by finish reason."""
        for reason in reasons:
            counter = self._success.get(reason)
            if counter is not None:
                counter.inc()

    def on_finished(self, metrics, num_prompt_tokens: int, reasons: list[str], n: int,
                    max_tokens: int | None, num_generated: list[int]) -> None:
        """A request finished: its samples' finish reasons, its timings (metrics: its
        RequestMetrics) and sizes."""
        self.count_finished(reasons)
        for histogram, attr in self._finished:
            histogram.observe(num_prompt_tokens if attr is None else getattr(metrics, attr))
        self._n.observe(n)
        if max_tokens:
            self._max_tokens.observe(max_tokens)
        self._max_generated.observe(max(num_generated))

    # ---- reading ---------------------------------------------------------------------------
    def collect(self, snapshot: EngineSnapshot) -> list:
        """Every family, with the gauges of this snapshot."""
        self.state.snapshot = snapshot
        return list(self.registry.collect())

    def get_metrics(self, snapshot: EngineSnapshot) -> list:
        """vLLM's reader records (nanokv.metrics.reader) of every vllm: metric."""
        from nanokv.metrics.reader import metrics_of

        return metrics_of(self.collect(snapshot))


# RequestMetrics attribute per finished-request histogram (None: the prompt's length)
_FINISHED = (
    ("vllm:e2e_request_latency_seconds", "e2e_latency"),
    ("vllm:request_queue_time_seconds", "queued_time"),
    ("vllm:request_prefill_time_seconds", "prefill_time"),
    ("vllm:request_decode_time_seconds", "decode_time"),
    ("vllm:request_inference_time_seconds", "inference_time"),
    ("vllm:request_time_per_output_token_seconds", "mean_time_per_output_token"),
    ("vllm:request_prompt_tokens", None),
    ("vllm:request_generation_tokens", "num_generation_tokens"),
)


class _StateCollector:
    """The gauges and engine-kept counters, from the snapshot set before collecting."""

    def __init__(self, label_values: tuple[str, str], cache_info: dict[str, str]):
        self.label_values = list(label_values)
        self.cache_info = cache_info
        self.snapshot: EngineSnapshot | None = None

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snap = self.snapshot
        if snap is None:
            return
        kv = snap.kv
        values = {"vllm:num_requests_running": snap.num_running, "vllm:num_requests_waiting": snap.num_waiting,
                  "vllm:kv_cache_usage_perc": kv.usage, "vllm:gpu_cache_usage_perc": kv.usage,
                  "vllm:prefix_cache_queries": kv.prefix_query_tokens,
                  "vllm:prefix_cache_hits": kv.prefix_hit_tokens, "vllm:num_preemptions": kv.num_preemptions}
        for spec in STATE:
            family = (GaugeMetricFamily if spec.kind == "gauge" else CounterMetricFamily)(
                spec.name, spec.doc, labels=LABELS)
            family.add_metric(self.label_values, values[spec.name])
            yield family
        info = {**self.cache_info, "engine": ENGINE_INDEX}
        family = GaugeMetricFamily(CACHE_CONFIG_INFO.name, CACHE_CONFIG_INFO.doc, labels=list(info))
        family.add_metric(list(info.values()), 1)
        yield family
        # nanokv serves no LoRA adapters: at most 0, none running or waiting; the value is
        # the time of this reading, as vLLM's (routers pick the latest series by it)
        family = GaugeMetricFamily(LORA_REQUESTS_INFO.name, LORA_REQUESTS_INFO.doc,
                                   labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        family.add_metric(["0", "", ""], time.time())
        yield family
