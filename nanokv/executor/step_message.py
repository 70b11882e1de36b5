"""One step as two broadcasts from rank 0 to the tensor-parallel workers.

  1. header: int64[8] = [op, num_tokens T, num_seqs B, num_decodes, table width W,
     num_logits_rows R, 0, 0]; op 1 = run a step, op 0 = shut down.
  2. payload: int64[3T + (B + 1) + B + B*W + R] = input_ids[T] | positions[T] |
     slot_mapping[T] | query_start_loc[B+1] | seq_lens[B] | block_tables[B, W] (row-major) |
     logits_rows[R].

Workers never see the scheduler's Python objects, only these tensors.
"""

from __future__ import annotations

import torch

from nanokv import distributed as tpd
from nanokv.attention import AttentionMetadata
from nanokv.runner.model_runner import StepInputs

OP_SHUTDOWN, OP_STEP = 0, 1
HEADER_LEN = 8


def send_step(inputs: StepInputs, device: torch.device) -> None:
    input_ids, positions, meta, logits_rows = inputs
    T, B, W = input_ids.shape[0], meta.seq_lens.shape[0], meta.block_tables.shape[1]
    R = 0 if logits_rows is None else logits_rows.shape[0]
    header = torch.tensor([OP_STEP, T, B, meta.num_decodes, W, R, 0, 0], dtype=torch.long, device=device)
    parts = [input_ids, positions, meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
             meta.block_tables.reshape(-1)]
    if R:
        parts.append(logits_rows)
    tpd.broadcast(header)
    tpd.broadcast(torch.cat([p.to(device=device, dtype=torch.long) for p in parts]))


def send_shutdown(device: torch.device) -> None:
    header = torch.zeros(HEADER_LEN, dtype=torch.long, device=device)
    header[0] = OP_SHUTDOWN
    tpd.broadcast(header)


def receive_step(device: torch.device) -> StepInputs | None:
    """A worker's side: the next step, or None when rank 0 says shut down."""
    header = torch.empty(HEADER_LEN, dtype=torch.long, device=device)
    tpd.broadcast(header)
    op, T, B, num_decodes, W, R = header.tolist()[:6]
    if op == OP_SHUTDOWN:
        return None
    payload = torch.empty(3 * T + (B + 1) + B + B * W + R, dtype=torch.long, device=device)
    tpd.broadcast(payload)
    ids, positions, slots, qsl, seq_lens, tables, rows = torch.split(payload, [T, T, T, B + 1, B, B * W, R])
    qsl, seq_lens = qsl.to(torch.int32), seq_lens.to(torch.int32)
    q_lens = (qsl[1:] - qsl[:-1]).tolist()
    seq_lens_cpu = seq_lens.tolist()
    meta = AttentionMetadata(slots, qsl, seq_lens, tables.view(B, W).to(torch.int32), num_decodes,
                             max(q_lens), max(seq_lens_cpu), q_lens, seq_lens_cpu)
    return StepInputs(ids, positions, meta, rows if R else None)
