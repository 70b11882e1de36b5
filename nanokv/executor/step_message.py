"""One step as two broadcasts of host memory from rank 0 to the tensor-parallel workers.

  1. header: int64[12] = [op, *StepSizes (8 ints), buffer words, 0, 0]; op 1 = run a
     step, op 0 = shut down.
  2. the step's packed buffer: the very int32 buffer rank 0 built (runner/inputs.py), which
     each worker copies to its device once, as rank 0 does.

Both travel over the host (gloo) group, also when the ranks compute on CUDA (NCCL): the
sizes and host-side lengths a worker needs are in host memory, so it never syncs its
device to read step metadata. Workers never see the scheduler's Python objects.
"""

from __future__ import annotations

import torch

import nanokv.distributed as tpd
from nanokv.runner.inputs import PackedStep, StepSizes

OP_SHUTDOWN, OP_STEP = 0, 1
HEADER_LEN = 12
_NUM_SIZES = len(StepSizes.__dataclass_fields__)


def send_step(packed: PackedStep) -> None:
    header = [OP_STEP, *packed.sizes.as_list(), packed.buffer.numel()]
    tpd.broadcast_host(torch.tensor(header + [0] * (HEADER_LEN - len(header)), dtype=torch.long))
    tpd.broadcast_host(packed.buffer)


def send_shutdown() -> None:
    tpd.broadcast_host(torch.zeros(HEADER_LEN, dtype=torch.long))  # op 0


def receive_step(pin_memory: bool) -> PackedStep | None:
    """A worker's side: the next step (its buffer pinned when the worker copies it to
    CUDA), or None when rank 0 says shut down."""
    header = torch.empty(HEADER_LEN, dtype=torch.long)
    tpd.broadcast_host(header)
    values = header.tolist()
    if values[0] == OP_SHUTDOWN:
        return None
    sizes = StepSizes(*values[1:1 + _NUM_SIZES])
    buffer = torch.empty(values[1 + _NUM_SIZES], dtype=torch.int32, pin_memory=pin_memory)
    tpd.broadcast_host(buffer)
    return PackedStep(sizes, buffer)
