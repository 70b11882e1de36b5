"""The executor interface the engine sees."""

from __future__ import annotations

from nanokv.engine.types import EngineDeadError, ScheduledBatch, StepOutput
from nanokv.runner.model_runner import ModelRunner


class Executor:
    """runner: the ModelRunner in the engine's process (rank 0: it samples).
    num_blocks: the KV pool size every rank holds, which the block manager hands out."""

    runner: ModelRunner
    closed: bool = False

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        raise NotImplementedError

    def close(self) -> None:
        """Release the executor's processes; idempotent. Later steps raise EngineDeadError."""
        self.closed = True

    def check_open(self) -> None:
        if self.closed:
            raise EngineDeadError("this LLM is closed; create a new LLM")
