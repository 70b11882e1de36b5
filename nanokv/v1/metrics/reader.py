"""vLLM's vllm.v1.metrics.reader path (its metrics example imports Counter, Gauge,
Histogram and Vector from here): the records LLM.get_metrics() returns."""

from nanokv.metrics.reader import Counter, Gauge, Histogram, Metric, Vector

__all__ = ["Metric", "Counter", "Gauge", "Histogram", "Vector"]
