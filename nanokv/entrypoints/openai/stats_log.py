"""The server's periodic stats line, as vLLM's (LoggingStatLogger): prompt and generation
throughput, running and waiting requests, KV cache usage and the prefix cache hit rate
over the last interval. At INFO while there is traffic (and once after it stops), at
DEBUG when idle, so an idle server stays quiet; off with --disable-log-stats."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

logger = logging.getLogger("nanokv")

@dataclass(frozen=True)
class _Totals:
    time: float
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0


class StatsLog:
    """log() writes one line about the time since the previous one; run() calls it every
    interval seconds until cancelled."""

    def __init__(self, llm, interval: float):
        self.llm, self.interval = llm, interval
        self.last = _Totals(time.monotonic())
        self.was_active = False

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.log()
            except Exception:  # a stats line is never worth the server
                logger.exception("the periodic stats line failed")

    async def log(self) -> None:
        snapshot = await self.llm.snapshot()
        values = {m.name: m.value for m in self.llm.engine.metrics.get_metrics(snapshot) if hasattr(m, "value")}
        now = _Totals(time.monotonic(), values["vllm:prompt_tokens"], values["vllm:generation_tokens"],
                      values["vllm:prefix_cache_queries"], values["vllm:prefix_cache_hits"])
        last, self.last = self.last, now
        seconds = max(now.time - last.time, 1e-9)
        prompt = (now.prompt_tokens - last.prompt_tokens) / seconds
        generation = (now.generation_tokens - last.generation_tokens) / seconds
        queries = now.prefix_queries - last.prefix_queries
        hit_rate = (now.prefix_hits - last.prefix_hits) / queries if queries else 0.0
        active = prompt > 0 or generation > 0
        level = logging.INFO if active or self.was_active else logging.DEBUG
        self.was_active = active
        logger.log(level, "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                   "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                   prompt, generation, snapshot.num_running, snapshot.num_waiting, 100 * snapshot.kv.usage,
                   100 * hit_rate)
