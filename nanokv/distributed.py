"""Tensor-parallel state and torch.distributed helpers (NCCL on GPUs, gloo on the CPU).

A leaf: it imports nothing of nanokv, so layers, models and the loader can take the TP
dataclass without knowing the runner or the executor that drives the ranks
(nanokv/executor/).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

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


def group_exists() -> bool:
    return dist.is_available() and dist.is_initialized()


# Host tensors (step metadata) travel over gloo; on CUDA the default group is NCCL, so a
# second, gloo group is made beside it (None: the default group is gloo already).
_host_group = None


def init_group(rank: int, size: int, init_method: str, device: torch.device) -> None:
    global _host_group
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=TIMEOUT)
    _host_group = dist.new_group(backend="gloo", timeout=TIMEOUT) if backend != "gloo" else None


def destroy_group() -> None:
    global _host_group
    _host_group = None
    if group_exists():
        dist.destroy_process_group()


def broadcast_host(x: torch.Tensor) -> None:
    """A host tensor from rank 0 to every rank, in place, over gloo (no device involved)."""
    dist.broadcast(x, src=0, group=_host_group)


def all_reduce_min(value: int, device: torch.device) -> int:
    t = torch.tensor([value], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def gather_cat(local: torch.Tensor, size: int) -> torch.Tensor:
    """Rank 0: every rank's [N, k] concatenated along the last dim, [N, size * k]."""
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.gather(local.contiguous(), parts, dst=0)
    return torch.cat(parts, dim=-1)


def send_to_rank0(local: torch.Tensor) -> None:
    """The other ranks' half of gather_cat."""
    dist.gather(local.contiguous(), dst=0)
