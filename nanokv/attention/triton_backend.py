"""Paged attention with Triton kernels: CUDA, or CPU tensors under TRITON_INTERPRET=1 (tests)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanokv.attention.base import AttentionBackend, AttentionMetadata
from nanokv.attention.triton_kernels import paged_attention, store_kv, warm_up

# The split-KV heuristic's stand-in for the SM count when the "GPU" is the interpreter.
_INTERPRETER_SMS = 8


@dataclass
class TritonState:
    num_sms: int  # streaming multiprocessors of the step's device, for the split-KV heuristic


class TritonBackend(AttentionBackend):
    name = "triton"
    # The grid and the split count come from host-side sizes only; a graph captured with
    # max_model_len as the length bound reads the real lengths from seq_lens on replay.
    supports_cuda_graphs = True

    def __init__(self, num_splits: int | None = None):
        """num_splits None: the kernels choose single pass or split-KV per step; an int
        forces it (1 = single pass), for tests and benchmarks."""
        self.num_splits = num_splits
        self._num_sms: dict[torch.device, int] = {}

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        meta.backend_state = TritonState(self._sm_count(meta.seq_lens.device))

    def warm_up(self, num_q_heads, num_kv_heads, head_dim, dtype, device, block_size, max_model_len,
                kv_dtype=None) -> None:
        # only compiled kernels compile (not the interpreter); a forced split count does on first use
        if device.type == "cuda" and self.num_splits is None:
            warm_up(num_q_heads, num_kv_heads, head_dim, dtype, device, block_size, max_model_len,
                    self._sm_count(device), kv_dtype)

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, k_scales=None, v_scales=None):
        # q [T, Hq, D]; k, v [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D] (quantized: with
        # scales [num_blocks, block_size, Hkv])
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scales, v_scales)
        out = torch.empty_like(q)  # [T, Hq, D]
        state: TritonState = meta.backend_state
        return paged_attention(q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens,
                               meta.block_tables, scale=scale, max_query_len=meta.max_query_len,
                               max_seq_len=meta.max_seq_len, num_sms=state.num_sms,
                               num_splits=self.num_splits, k_scales=k_scales, v_scales=v_scales)

    def _sm_count(self, device: torch.device) -> int:
        if device not in self._num_sms:
            self._num_sms[device] = (torch.cuda.get_device_properties(device).multi_processor_count
                                     if device.type == "cuda" else _INTERPRETER_SMS)
        return self._num_sms[device]
