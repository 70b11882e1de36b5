"""RequestOutput / CompletionOutput with vLLM's field names."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from nanokv.unsupported import missing


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token: top-N + sampled
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None
    lora_request: None = None  # vLLM's field; LoRA is not supported, always None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When one request arrived, was first scheduled, produced its first and last tokens and
    finished: vLLM's RequestMetrics names (wall-clock seconds since the epoch, None until it
    happens) over monotonic stamps (vLLM's RequestStateStats: queued_ts, scheduled_ts,
    first_token_ts, last_token_ts; 0.0 until it happens), from which the latencies come.
    A preempted request keeps its first scheduling and first token times."""

    arrival_time: float  # time.time() when the request was made
    arrival_ts: float  # time.monotonic() at the same moment
    queued_ts: float = 0.0  # handed to the scheduler
    scheduled_ts: float = 0.0  # first admitted
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    finished_ts: float = 0.0
    num_generation_tokens: int = 0  # every sample's tokens, once finished
    # vLLM's RequestMetrics fields nanokv does not measure
    scheduler_time: float | None = None
    model_forward_time: float | None = None
    model_execute_time: float | None = None

    @classmethod
    def now(cls) -> "RequestMetrics":
        return cls(time.time(), time.monotonic())

    def _wall(self, ts: float) -> float | None:
        return self.arrival_time + (ts - self.arrival_ts) if ts else None

    @property
    def first_scheduled_time(self) -> float | None:
        return self._wall(self.scheduled_ts)

    @property
    def first_token_time(self) -> float | None:
        return self._wall(self.first_token_ts)

    @property
    def last_token_time(self) -> float | None:
        return self._wall(self.last_token_ts)

    @property
    def finished_time(self) -> float | None:
        return self._wall(self.finished_ts)

    @property
    def time_in_queue(self) -> float | None:
        """Seconds from being queued to the first scheduling."""
        return self.scheduled_ts - self.queued_ts if self.scheduled_ts else None

    # the intervals of vLLM's metrics (seconds; meaningful once the request finished)
    @property
    def first_token_latency(self) -> float:
        return self.first_token_ts - self.arrival_ts if self.first_token_ts else 0.0

    @property
    def queued_time(self) -> float:
        return self.scheduled_ts - self.queued_ts

    @property
    def prefill_time(self) -> float:
        return self.first_token_ts - self.scheduled_ts

    @property
    def decode_time(self) -> float:
        return self.last_token_ts - self.first_token_ts

    @property
    def inference_time(self) -> float:
        return self.last_token_ts - self.scheduled_ts

    @property
    def e2e_latency(self) -> float:
        return self.finished_ts - self.arrival_ts

    @property
    def mean_time_per_output_token(self) -> float:
        """The decode time per token after the first (0 for one token)."""
        n = self.num_generation_tokens - 1
        return self.decode_time / n if n > 0 else 0.0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # SamplingParams.prompt_logprobs: None for the first prompt token, then {token id: Logprob}
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None  # why the request failed in a step (its samples end with "error")
    metrics: RequestMetrics | None = None  # the request's times so far (the same object in each delta)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at its first admission
    # vLLM's fields for what nanokv does not do (LoRA, encoder-decoder models, KV transfer): None
    lora_request: None = None
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
    kv_transfer_params: None = None


def __getattr__(name: str):
    raise missing(__name__, name)
