"""ScheduledBatch -> flat token tensors + AttentionMetadata -> logits -> sampled tokens."""

from __future__ import annotations

import logging
from itertools import chain

import torch

from nanokv.attention import AttentionMetadata, get_backend
from nanokv.config import EngineConfig
from nanokv.engine.types import ScheduledBatch, ScheduledSeq, StepOutput, TokenLogprobs
from nanokv.layers.attention import Attention
from nanokv.layers.sampler import Sampler, SamplerOutput, SamplingTensors, seed_for_token
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
        self.backend = get_backend(config.attention_backend)
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
        self.eos_token_ids = list(config.eos_token_ids)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        input_ids, positions, meta, logits_rows = self._prepare(batch)
        self.backend.prepare(meta, self.block_size)
        hidden = self.model(input_ids, positions, meta)  # [T, hidden]
        if logits_rows is None:
            return StepOutput()
        logits = self.model.compute_logits(hidden[logits_rows])  # [N, vocab]
        rows = [s for s in batch.seqs if s.sample]
        out = self.sampler(logits, self._sampling_tensors(rows, logits.shape[-1]), self.generator)
        return StepOutput(out.tokens.tolist(), _logprobs(rows, out))

    def _sampling_tensors(self, rows: list[ScheduledSeq], vocab: int) -> SamplingTensors:
        """Per-row settings as tensors; options no row uses stay None (no work)."""
        dev, params = self.device, [s.params for s in rows]

        def column(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=dev)

        t = SamplingTensors(column([p.temperature for p in params]),
                            all_greedy=all(p.temperature == 0 for p in params))
        if not t.all_greedy:
            if any(p.top_k > 0 for p in params):
                t.top_k = column([p.top_k if p.top_k > 0 else vocab for p in params], torch.long)
            if any(p.top_p < 1 for p in params):
                t.top_p = column([p.top_p for p in params])
            if any(p.min_p > 0 for p in params):
                t.min_p = column([p.min_p for p in params])
            seeded = [(i, seed_for_token(s.seed, s.num_generated)) for i, s in enumerate(rows)
                      if s.seed is not None and s.params.temperature > 0]
            t.seeded = seeded or None
        if any(p.has_penalties for p in params):
            self._penalty_tensors(t, rows, vocab)
        banned_rows, banned_ids = [], []
        for i, s in enumerate(rows):
            if s.num_generated < s.params.min_tokens:
                stop_ids = s.params.stop_token_ids + ([] if s.params.ignore_eos else self.eos_token_ids)
                banned_rows += [i] * len(stop_ids)
                banned_ids += stop_ids
        if banned_rows:
            t.banned = (column(banned_rows, torch.long), column(banned_ids, torch.long))
        asked = [p.logprobs for p in params if p.logprobs is not None]
        t.max_logprobs = max(asked) if asked else None
        return t

    def _penalty_tensors(self, t: SamplingTensors, rows: list[ScheduledSeq], vocab: int) -> None:
        dev = self.device
        t.repetition = torch.tensor([s.params.repetition_penalty for s in rows], device=dev)
        t.presence = torch.tensor([s.params.presence_penalty for s in rows], device=dev)
        t.frequency = torch.tensor([s.params.frequency_penalty for s in rows], device=dev)
        out_rows, out_ids, seen_rows, seen_ids = [], [], [], []
        for i, s in enumerate(rows):
            if s.params.has_penalties:
                output = s.all_token_ids[s.num_prompt_tokens:]
                out_rows += [i] * len(output)
                out_ids += output
                seen_rows += [i] * len(s.all_token_ids)
                seen_ids += s.all_token_ids
        counts = torch.zeros(len(rows), vocab, device=dev)
        counts.index_put_((torch.tensor(out_rows, dtype=torch.long, device=dev),
                           torch.tensor(out_ids, dtype=torch.long, device=dev)),
                          torch.ones(len(out_ids), device=dev), accumulate=True)
        seen = torch.zeros(len(rows), vocab, dtype=torch.bool, device=dev)
        seen[torch.tensor(seen_rows, dtype=torch.long, device=dev),
             torch.tensor(seen_ids, dtype=torch.long, device=dev)] = True
        t.output_counts, t.seen_mask = counts, seen

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
        logits_rows = [cu[rank[i] + 1] - 1 for i, s in enumerate(seqs) if s.sample]

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
        return input_ids, positions.to(dev), meta, rows


def _logprobs(rows: list[ScheduledSeq], out: SamplerOutput) -> list[TokenLogprobs | None] | None:
    if out.logprobs is None:
        return None
    lp, ranks = out.logprobs.tolist(), out.ranks.tolist()
    top_ids = out.top_ids.tolist() if out.top_ids is not None else None
    top_lp = out.top_logprobs.tolist() if out.top_logprobs is not None else None
    result: list[TokenLogprobs | None] = []
    for i, s in enumerate(rows):
        n = s.params.logprobs
        if n is None:
            result.append(None)
        else:
            result.append(TokenLogprobs(lp[i], ranks[i], top_ids[i][:n] if n else [],
                                        top_lp[i][:n] if n else []))
    return result
