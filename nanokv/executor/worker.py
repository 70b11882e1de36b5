"""Tensor-parallel worker processes (ranks 1..N-1): load the shard, then run the steps
rank 0 broadcasts until it says stop (or dies)."""

from __future__ import annotations

import logging
import signal

import torch

import nanokv.distributed as tpd
from nanokv.distributed import TP
from nanokv.executor.step_message import receive_step
from nanokv.runner.model_runner import ModelRunner

logger = logging.getLogger("nanokv")


def worker_main(config, rank: int, size: int, init_method: str, ready) -> None:
    """Entry point of a spawned worker; `ready` (a pipe) gets "ok" or the error at start-up."""
    # Ctrl-C is for rank 0: it decides when workers stop (they also stop when it dies)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        device = config.device if config.device.type != "cuda" else torch.device("cuda", rank)
        tpd.init_group(rank, size, init_method, device)
        runner = ModelRunner(config, TP(rank, size))
        runner.init_kv_cache(tpd.all_reduce_min(runner.max_num_blocks, runner.device))
    except BaseException as e:
        ready.send(f"{type(e).__name__}: {e}")
        raise
    ready.send("ok")
    try:
        serve(runner)
    except Exception as e:  # the group is broken (rank 0 gone): leave quietly
        logger.debug("worker %d stops: %s", rank, e)
    finally:
        tpd.destroy_group()


@torch.inference_mode()
def serve(runner: ModelRunner) -> None:
    pin = runner.device.type == "cuda"
    while (packed := receive_step(pin)) is not None:
        logits = runner.forward(runner.unpack(packed))
        if logits is not None:
            tpd.send_to_rank0(logits)
