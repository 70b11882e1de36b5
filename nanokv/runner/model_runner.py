"""ScheduledBatch -> flat token tensors + AttentionMetadata -> logits -> sampled tokens."""

from __future__ import annotations

import logging
from itertools import chain

import torch

from nanokv.attention import AttentionMetadata, get_backend
from nanokv.config import EngineConfig
from nanokv.engine.types import ScheduledBatch, StepOutput
from nanokv.layers.attention import Attention
from nanokv.layers.sampler import Sampler
from nanokv.loader import build_model
from nanokv.models import get_model_class
from nanokv.models.llama import head_dim
from nanokv.runner.kv_cache import allocate_kv_cache, bytes_per_block, num_kv_blocks

logger = logging.getLogger("nanokv")


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = config.device
        hf = config.hf_config
        self.model = build_model(get_model_class(config.architecture), hf, config.model,
                                 config.dtype, config.device, config.max_model_len)
        self.vocab_size = hf.vocab_size
        self.block_size = config.block_size
        self.backend = get_backend("torch")
        num_layers, num_kv_heads, dim = hf.num_hidden_layers, hf.num_key_value_heads, head_dim(hf)
        self.num_blocks = num_kv_blocks(config, bytes_per_block(config, num_layers, num_kv_heads, dim))
        self.kv_cache = allocate_kv_cache(config, self.num_blocks, num_layers, num_kv_heads, dim)
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        assert len(layers) == num_layers
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
            layer.backend = self.backend
        self.sampler = Sampler()
        self.generator = torch.Generator(device=config.device).manual_seed(config.seed)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        input_ids, positions, meta, logits_rows, temperatures = self._prepare(batch)
        self.backend.prepare(meta, self.block_size)
        hidden = self.model(input_ids, positions, meta)  # [T, hidden]
        if logits_rows is None:
            return StepOutput()
        logits = self.model.compute_logits(hidden[logits_rows])  # [N, vocab]
        all_greedy = all(t == 0 for t in temperatures)
        temps = torch.tensor(temperatures, dtype=torch.float32, device=self.device)
        tokens = self.sampler(logits, temps, all_greedy, self.generator)
        return StepOutput(tokens.tolist())

    def _prepare(self, batch: ScheduledBatch):
        seqs = batch.seqs
        # decodes (one query token) first: the backends treat them as one group
        order = [i for i, s in enumerate(seqs) if len(s.token_ids) == 1]
        num_decodes = len(order)
        order += [i for i, s in enumerate(seqs) if len(s.token_ids) != 1]
        ordered = [seqs[i] for i in order]
        q_lens = [len(s.token_ids) for s in ordered]
        starts = [s.start_pos for s in ordered]
        seq_lens = [a + b for a, b in zip(starts, q_lens)]
        width = max(len(s.block_table) for s in ordered)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in ordered]

        cu = [0]
        for n in q_lens:
            cu.append(cu[-1] + n)
        num_tokens = cu[-1]
        q_lens_t = torch.tensor(q_lens)
        owner = torch.repeat_interleave(torch.arange(len(ordered)), q_lens_t, output_size=num_tokens)
        cu_t = torch.tensor(cu, dtype=torch.int32)
        positions = torch.arange(num_tokens) - cu_t[:-1][owner] + torch.tensor(starts)[owner]
        tables_t = torch.tensor(tables, dtype=torch.int32)
        bs = self.block_size
        slots = tables_t[owner, positions // bs].long() * bs + positions % bs

        rank = {orig: k for k, orig in enumerate(order)}
        sampled = [i for i, s in enumerate(seqs) if s.sample]
        logits_rows = [cu[rank[i] + 1] - 1 for i in sampled]
        temperatures = [seqs[i].temperature for i in sampled]

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev),
            query_start_loc=cu_t.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev),
            block_tables=tables_t.to(dev),
            num_decodes=num_decodes,
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=q_lens,
            seq_lens_cpu=seq_lens,
        )
        input_ids = torch.tensor(list(chain.from_iterable(s.token_ids for s in ordered))).to(dev)
        rows = torch.tensor(logits_rows).to(dev) if logits_rows else None
        return input_ids, positions.to(dev), meta, rows, temperatures
