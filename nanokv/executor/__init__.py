"""Executors: how the engine's steps reach the model's ranks.

LLMEngine talks to one executor: `execute(batch) -> StepOutput`, `num_blocks`, `close()`.
The single-process executor runs the ModelRunner in the engine's process; the
tensor-parallel one spawns and watches worker processes, broadcasts each step to them
and gathers the logits (multiproc.py, worker.py, step_message.py).
"""

from __future__ import annotations

from nanokv.config import EngineConfig
from nanokv.executor.base import Executor


def make_executor(config: EngineConfig) -> Executor:
    if config.tensor_parallel_size == 1:
        from nanokv.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config)
    from nanokv.executor.multiproc import TensorParallelExecutor

    return TensorParallelExecutor(config)


__all__ = ["Executor", "make_executor"]
