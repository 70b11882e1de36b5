"""CUDA graphs for decode steps: one graph per batch-size bucket, static input buffers,
one shared memory pool.

A decode batch of n sequences replays the graph of the smallest bucket >= n. Rows past n
are padding: they write their K/V into a scratch block that no sequence owns and attend
to that one slot, so they cost a little compute and touch no real page. Block tables
are max_model_len wide, so even a max-length prompt's first decode fits.
"""

from __future__ import annotations

import bisect

import torch

from nanokv.attention.base import AttentionBackend, AttentionMetadata


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(320, 1025, 64))
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


class DecodeGraphs:
    def __init__(self, model, backend: AttentionBackend, block_size: int, max_batch: int,
                 max_model_len: int, scratch_block: int, device: torch.device, capture: bool = True):
        self.model, self.backend, self.block_size = model, backend, block_size
        self.max_model_len = max_model_len
        self.buckets = batch_buckets(max_batch)
        n, width = self.buckets[-1], -(-max_model_len // block_size)
        self.scratch_block = scratch_block
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), scratch_block * block_size, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.full((n, width), scratch_block, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self._capture_all()

    def bucket_for(self, n: int) -> int | None:
        i = bisect.bisect_left(self.buckets, n)
        return self.buckets[i] if i < len(self.buckets) else None

    def _meta(self, b: int) -> AttentionMetadata:
        """Metadata over the static buffers; host-side lengths are upper bounds (the
        kernels read the real ones from seq_lens on the device)."""
        return AttentionMetadata(
            slot_mapping=self.slots[:b], query_start_loc=self.query_start_loc[:b + 1],
            seq_lens=self.seq_lens[:b], block_tables=self.block_tables[:b], num_decodes=b,
            max_query_len=1, max_seq_len=self.max_model_len, query_lens_cpu=[1] * b,
            seq_lens_cpu=[self.max_model_len] * b)

    def _forward(self, b: int) -> torch.Tensor:
        meta = self._meta(b)
        self.backend.prepare(meta, self.block_size)
        return self.model(self.input_ids[:b], self.positions[:b], meta)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        for b in reversed(self.buckets):  # largest first: later graphs reuse its pool
            self._forward(b)  # warm-up: kernel compilation and autotuning happen outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(b)
            pool = graph.pool()
            self.graphs[b] = (graph, out)
        torch.cuda.synchronize()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Decode forward of n = len(input_ids) sequences -> hidden states [n, hidden]."""
        n = input_ids.shape[0]
        b = self.bucket_for(n)
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        if b > n:  # padding rows: scratch slot, context of one token
            self.input_ids[n:b].zero_()
            self.positions[n:b].zero_()
            self.slots[n:b].fill_(self.scratch_block * self.block_size)
            self.seq_lens[n:b].fill_(1)
            self.block_tables[n:b, 0].fill_(self.scratch_block)
        if b in self.graphs:
            graph, out = self.graphs[b]
            graph.replay()
            return out[:n]
        return self._forward(b)[:n]  # not captured (CPU tests of the padding logic)
