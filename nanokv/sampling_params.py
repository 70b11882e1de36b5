"""SamplingParams: how one request is decoded (vLLM's names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Per-request decoding settings.

    temperature 0 means greedy (argmax). `max_tokens` counts generated tokens; it is
    clamped so prompt + output never exceeds the engine's max_model_len, in which case
    the request ends with finish_reason "length".
    """

    temperature: float = 1.0
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an int, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must hold non-negative ints, got {t!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
