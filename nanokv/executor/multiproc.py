"""Tensor parallelism over processes: rank 0 is the engine's own process (it schedules,
prepares each step, runs its shard and samples); it spawns ranks 1..N-1, which hold their
shards and their slices of the KV pool (their KV heads) and run the same forward."""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import time
import weakref

import nanokv.distributed as tpd
from nanokv.config import EngineConfig
from nanokv.distributed import TP
from nanokv.engine.types import EngineDeadError, ScheduledBatch, StepOutput
from nanokv.executor.base import Executor
from nanokv.executor.step_message import send_shutdown, send_step
from nanokv.executor.worker import worker_main
from nanokv.runner.model_runner import ModelRunner

logger = logging.getLogger("nanokv")


class TensorParallelExecutor(Executor):
    def __init__(self, config: EngineConfig):
        if tpd.group_exists():
            raise ValueError("another tensor-parallel LLM (or torch.distributed group) already exists in this "
                             "process and owns the default process group; call close() on that LLM first, "
                             "or use tensor_parallel_size=1")
        self.size = size = config.tensor_parallel_size
        self.device = config.device
        init_method = f"tcp://127.0.0.1:{tpd.free_port()}"
        ctx = mp.get_context("spawn")
        self.workers, pipes = [], []
        for rank in range(1, size):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=worker_main, daemon=True, name=f"nanokv-tp{rank}",
                               args=(config, rank, size, init_method, send))
            proc.start()
            self.workers.append(proc)
            pipes.append(recv)
        self._finalizer = weakref.finalize(self, _shutdown, self.workers)
        try:
            tpd.init_group(0, size, init_method, self.device)
            self.runner = ModelRunner(config, TP(0, size))
            # every rank must hand out the same block ids: take the smallest pool
            self.runner.init_kv_cache(tpd.all_reduce_min(self.runner.max_num_blocks, self.device))
            self._wait_for_workers(pipes)
        except BaseException:
            self.close()
            raise

    def _wait_for_workers(self, pipes) -> None:
        for rank, pipe in enumerate(pipes, start=1):
            if not pipe.poll(tpd.TIMEOUT.total_seconds()):
                raise RuntimeError(f"tensor-parallel worker {rank} did not start in time")
            status = pipe.recv()
            if status != "ok":
                raise RuntimeError(f"tensor-parallel worker {rank} failed to start: {status}")

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        """Broadcast the step, run rank 0's shard, gather the logits, sample. A collective
        that breaks means a worker died: the engine cannot go on."""
        self.check_workers()
        runner = self.runner
        packed = runner.pack(batch)
        try:
            send_step(packed)  # the workers get the same host buffer ...
            logits = runner.forward(runner.unpack(packed))  # ... and unpack it as rank 0 does
            if logits is not None:
                logits = tpd.gather_cat(logits, self.size)  # [N, vocab]
        except RuntimeError as e:
            deadline = time.monotonic() + 2  # let the dead worker's exit be seen
            while time.monotonic() < deadline and all(p.is_alive() for p in self.workers):
                time.sleep(0.05)
            self.check_workers()
            self.close()
            # the reason reaches clients (the server's 503 bodies, /health): the exception's
            # text (paths, shapes, gloo's peers) stays in the log and in __cause__
            logger.error("a tensor-parallel step failed", exc_info=e)
            raise EngineDeadError(f"a tensor-parallel step failed on an internal error ({type(e).__name__}; the "
                                  "log has the details); the engine cannot continue, create a new LLM") from e
        return runner.sample(logits, batch)

    def check_workers(self) -> None:
        self.check_open()
        dead = [(i + 1, p.exitcode) for i, p in enumerate(self.workers) if not p.is_alive()]
        if dead:
            self.close()
            raise EngineDeadError(f"tensor-parallel worker(s) died: {', '.join(_describe_exit(r, c) for r, c in dead)}"
                                  "; the engine cannot continue, create a new LLM")

    def close(self) -> None:
        self.closed = True
        self._finalizer()
        runner = getattr(self, "runner", None)  # None when closing a failed start
        if runner is not None:
            runner.release_kv_cache()  # rank 0's, in this process


def _describe_exit(rank: int, code: int | None) -> str:
    if code is not None and code < 0:
        return f"rank {rank} (killed by {signal.Signals(-code).name})"
    return f"rank {rank} (exit code {code})"


def _shutdown(workers) -> None:
    """Tell the worker ranks to stop, wait briefly, then make sure they are gone."""
    try:
        if tpd.group_exists():
            if all(p.is_alive() for p in workers):
                send_shutdown()
            tpd.destroy_group()
    except Exception:  # a broken group: the workers are killed below anyway
        pass
    for p in workers:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
