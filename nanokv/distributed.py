"""Tensor parallelism over torch.distributed (NCCL on GPUs, gloo on the CPU).

Rank 0 is the engine's own process: it schedules, prepares each step's inputs, runs its
shard of the model and samples. Ranks 1..N-1 are worker processes the engine spawns;
each holds its shard and its slice of the KV cache (its KV heads) and runs the same
forward. Each step rank 0 broadcasts one small message (below); workers never see the
scheduler's Python objects.

Step message, two broadcasts from rank 0:
  1. header: int64[8] = [op, num_tokens T, num_seqs B, num_decodes, table width W,
     num_logits_rows R, 0, 0]; op 1 = run a step, op 0 = shut down.
  2. payload: int64[3T + (B + 1) + B + B*W + R] = input_ids[T] | positions[T] |
     slot_mapping[T] | query_start_loc[B+1] | seq_lens[B] | block_tables[B, W] (row-major) |
     logits_rows[R].
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger("nanokv")

OP_SHUTDOWN, OP_STEP = 0, 1
HEADER_LEN = 8
TIMEOUT = timedelta(seconds=float(os.environ.get("NANOKV_TP_TIMEOUT", "120")))


@dataclass(frozen=True)
class TP:
    """This process's place in the tensor-parallel group (size 1: no parallelism)."""

    rank: int = 0
    size: int = 1

    def split(self, n: int) -> tuple[int, int]:
        """(start, count) of this rank's share of n items (n divisible by size)."""
        per = n // self.size
        return self.rank * per, per

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, size: int, init_method: str, device: torch.device) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=TIMEOUT)


def pack_step(input_ids, positions, slots, query_start_loc, seq_lens, block_tables, logits_rows,
              num_decodes: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    T, B, W = input_ids.shape[0], seq_lens.shape[0], block_tables.shape[1]
    R = 0 if logits_rows is None else logits_rows.shape[0]
    header = torch.tensor([OP_STEP, T, B, num_decodes, W, R, 0, 0], dtype=torch.long, device=device)
    parts = [input_ids, positions, slots, query_start_loc, seq_lens, block_tables.reshape(-1)]
    if R:
        parts.append(logits_rows)
    payload = torch.cat([p.to(device=device, dtype=torch.long) for p in parts])
    return header, payload


def unpack_step(header: list[int], payload: torch.Tensor):
    _, T, B, num_decodes, W, R = header[:6]
    sizes = [T, T, T, B + 1, B, B * W, R]
    ids, positions, slots, qsl, seq_lens, tables, rows = torch.split(payload, sizes)
    return (ids, positions, slots, qsl.to(torch.int32), seq_lens.to(torch.int32),
            tables.view(B, W).to(torch.int32), rows if R else None, num_decodes)


def broadcast_step(header: torch.Tensor, payload: torch.Tensor | None) -> None:
    dist.broadcast(header, src=0)
    if payload is not None:
        dist.broadcast(payload, src=0)


def worker_main(config, rank: int, size: int, init_method: str, ready) -> None:
    """Entry point of worker ranks: load the shard, then serve steps until told to stop."""
    import signal

    from nanokv.runner.model_runner import ModelRunner

    # Ctrl-C is for rank 0: it decides when workers stop (they also stop when it dies)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(max(1, torch.get_num_threads() // size))
    try:
        runner = ModelRunner(config, TP(rank, size), init_method=init_method)
    except BaseException as e:
        ready.send(f"{type(e).__name__}: {e}")
        raise
    ready.send("ok")
    try:
        runner.serve()
    except Exception as e:  # the group is broken (rank 0 gone): leave quietly
        logger.debug("worker %d stops: %s", rank, e)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
