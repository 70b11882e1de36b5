"""One process, one rank: the runner runs in the engine's process."""

from __future__ import annotations

from nanokv.config import EngineConfig
from nanokv.engine.types import ScheduledBatch, StepOutput
from nanokv.executor.base import Executor
from nanokv.runner.model_runner import ModelRunner


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig):
        self.runner = ModelRunner(config)
        self.runner.init_kv_cache(self.runner.max_num_blocks)

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        self.check_open()
        return self.runner.execute(batch)

    def close(self) -> None:
        super().close()
        self.runner.release_kv_cache()
