"""ScheduledBatch -> flat token tensors + AttentionMetadata -> logits -> sampled tokens."""

from __future__ import annotations

import logging
import threading
import time
from copy import copy
from dataclasses import dataclass, field
from operator import attrgetter, is_

import torch

from nanokv.attention import get_backend
from nanokv.config import EngineConfig
from nanokv.cpu_threads import configure as configure_threads
from nanokv.distributed import TP
from nanokv.engine.types import ScheduledBatch, ScheduledSeq, StepOutput, TokenLogprobs
from nanokv.grammar import GrammarConstraint, fill_masks
from nanokv.layers.attention import Attention
from nanokv.layers.custom_op import choose_kernels
from nanokv.layers.sampler import Sampler, SamplerOutput, SamplingTensors, TokenCounts, list_tensor, seed_keys
from nanokv.loader import build_model
from nanokv.models import get_model_class
from nanokv.models.llama import kv_heads_of_rank
from nanokv.runner.cuda_graph import DecodeGraphs
from nanokv.runner.inputs import PackedStep, StepInputs, StepPacker, unpack_step
from nanokv.runner.kv_cache import (allocate_kv_cache, bytes_per_block, bytes_per_token, commits_lazily,
                                    num_kv_blocks)
from nanokv.sampling_params import SAMPLING_EPS, SamplingParams

logger = logging.getLogger("nanokv")

_TEMPERATURE, _MIN_TOKENS, _LOGPROBS = (attrgetter(f) for f in ("temperature", "min_tokens", "logprobs"))
_PARAMS = attrgetter("params")
_REPETITION, _PRESENCE, _FREQUENCY = (attrgetter(f + "_penalty") for f in ("repetition", "presence", "frequency"))


class ModelRunner:
    """One rank's model: its shard of the weights and of the KV pool, step inputs, the
    forward pass and sampling. It knows nothing of processes: an executor (executor/)
    decides which ranks exist, who drives, and how steps reach them.

    Built in two parts, because the ranks of a tensor-parallel group must agree on one
    pool size: __init__ loads the model and works out max_num_blocks (what this rank's
    memory allows), init_kv_cache(num_blocks) then allocates the pool."""

    def __init__(self, config: EngineConfig, tp: TP = TP()):
        self.config = config
        self.tp = tp
        # NANOKV_NUM_THREADS (a bad value is refused here, before loading); a TP worker takes its share of the cores
        configure_threads(share=tp.size if tp.rank > 0 else 1)
        self.device = config.device
        if tp.rank > 0 and config.device.type == "cuda":
            self.device = torch.device("cuda", tp.rank)
            torch.cuda.set_device(self.device)
        hf = config.hf_config
        allocated = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        # a max_model_len (by default the model's context length) that no pool could hold is refused before the
        # model, its rope table and the block table are sized by it: the pool only shrinks once the weights load
        kv_heads = kv_heads_of_rank(hf.num_key_value_heads, tp)[1]
        num_kv_blocks(config, bytes_per_block(config, hf.num_hidden_layers, kv_heads, config.head_dim))
        # the C kernels or torch, for every layer at once (compiles them on first use); the model is
        # switched over as it loads (from the weight cache when it holds this model: nanokv/weight_cache.py)
        self.kernels = choose_kernels(config.dtype, self.device, config.attention_backend, hf, tp.size,
                                      config.weight_format, config.lm_head_format)
        self.model = build_model(get_model_class(config.architecture), hf, config.model,
                                 config.dtype, self.device, config.max_model_len, tp, kernels=self.kernels)
        self.block_size = config.block_size
        self.backend = get_backend(self.kernels.attention_backend)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        assert len(self.attn_layers) == hf.num_hidden_layers
        for layer in self.attn_layers:
            layer.backend = self.backend
        self.kv_shape = (hf.num_hidden_layers, self.attn_layers[0].num_kv_heads, config.head_dim)
        # the persistent block table: a row per running sequence (runner/inputs.py)
        self.block_table = torch.zeros(config.max_num_seqs, -(-config.max_model_len // self.block_size),
                                       dtype=torch.int32, device=self.device)
        self._packer: StepPacker | None = None  # rank 0's, made at its first step
        self.use_graphs = (config.device.type == "cuda" and not config.enforce_eager
                           and self.backend.supports_cuda_graphs and tp.size == 1)
        # this LLM's own weights: another LLM in the process may hold memory too
        weight_bytes = torch.cuda.memory_allocated(self.device) - allocated if self.device.type == "cuda" else 0
        activation_bytes = self._profile_activation_bytes(self.use_graphs) if config.device.type == "cuda" else 0
        self.max_num_blocks = num_kv_blocks(config, bytes_per_block(config, *self.kv_shape), activation_bytes,
                                            weight_bytes)
        self.kv_bytes_per_token = bytes_per_token(config, *self.kv_shape)  # this rank's shard, scales included
        self.num_blocks = 0
        self.kv_reserved_bytes = 0  # the pool's allocation, the scratch block included
        self.kv_commits_lazily = commits_lazily(self.device)  # its pages come as blocks are first written
        self.kv_cache: torch.Tensor | None = None  # [layers, 2, blocks, block_size, Hkv, D] pages
        self.kv_scales: torch.Tensor | None = None  # [layers, 2, blocks, block_size, Hkv, 2] (scale, zero)
        self.graphs = None
        self.sampler = Sampler()
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.token_counts: dict[int, TokenCounts] = {}  # seq_id -> penalty state, while it runs
        self._fixed_settings: _FixedSettings | None = None  # the last step's, reused while its params stay
        self.eos_token_ids = list(config.eos_token_ids)
        self._eos_ids = list_tensor(self.eos_token_ids, device=self.device)  # min_tokens' bans, most requests'
        # id(params) -> (params, the token ids min_tokens bans): built once per request while it
        # stays in the batch (a million ids rebuilt per row per step cost a GB a step)
        self._ban_ids: dict[int, tuple[SamplingParams, torch.Tensor]] = {}
        self._ahead: _MasksAhead | None = None  # this step's masks, begun before its forward
        self.num_steps = 0
        self.forward_seconds = 0.0  # model forward + LM head, measured only after reset_timers()
        self._timing = False

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate the pool (num_blocks <= max_num_blocks) and capture CUDA graphs."""
        assert 0 < num_blocks <= self.max_num_blocks
        self.num_blocks = num_blocks
        # one block more than the block manager hands out: the scratch block of padding rows
        self._set_kv_cache(*allocate_kv_cache(self.config, num_blocks + 1, *self.kv_shape))
        self.kv_reserved_bytes = (num_blocks + 1) * self.block_size * self.kv_bytes_per_token
        first = self.attn_layers[0]  # this rank's heads
        self.backend.warm_up(first.num_heads, first.num_kv_heads, first.head_dim, self.config.dtype, self.device,
                             self.block_size, self.config.max_model_len, self.kv_cache.dtype)
        if self.use_graphs:
            cfg = self.config
            self.graphs = DecodeGraphs(self.model, self.backend, self.block_size, cfg.max_num_seqs,
                                       cfg.max_model_len, num_blocks, cfg.device)

    def release_kv_cache(self) -> None:
        """Free the pool (and the CUDA graphs that read it) now, not when the garbage
        collector reaches the engine: LLM.close() calls it. The runner cannot step after."""
        self.graphs = None
        self.kv_cache = self.kv_scales = None
        self.kv_reserved_bytes = 0
        for layer in self.attn_layers:
            layer.k_cache = layer.v_cache = layer.k_scales = layer.v_scales = None

    def _set_kv_cache(self, cache: torch.Tensor, scales: torch.Tensor | None) -> None:
        self.kv_cache, self.kv_scales = cache, scales
        for i, layer in enumerate(self.attn_layers):
            layer.k_cache, layer.v_cache = cache[i, 0], cache[i, 1]
            layer.k_scales, layer.v_scales = (None, None) if scales is None else (scales[i, 0], scales[i, 1])

    @torch.inference_mode()
    def _profile_activation_bytes(self, with_graphs: bool) -> int:
        """Peak GPU memory of the largest step beyond the weights (a full token budget of
        prefill, logits for max_num_seqs rows), plus the decode activations CUDA graphs
        keep in their pool."""
        cfg, bs = self.config, self.block_size
        seq_len = min(cfg.max_model_len - 1, cfg.max_num_batched_tokens)
        num_seqs = max(1, min(cfg.max_num_seqs, cfg.max_num_batched_tokens // seq_len))
        per_seq = -(-seq_len // bs)
        self._set_kv_cache(*allocate_kv_cache(cfg, num_seqs * per_seq, *self.kv_shape, log=False))
        batch = ScheduledBatch()
        params = SamplingParams(temperature=0)
        for i in range(num_seqs):
            table = list(range(i * per_seq, (i + 1) * per_seq))
            batch.seqs.append(ScheduledSeq(i, [0] * seq_len, 0, table, True, params))
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        try:
            input_ids, positions, meta, rows = self.prepare(batch)
        finally:  # the profiling batch's made-up sequences hold no rows, and their block ids are gone
            self.packer.reset()
            self.block_table.zero_()
        self.backend.prepare(meta, bs)
        hidden = self.model(input_ids, positions, meta)
        logits = self.model.compute_logits(hidden[rows.repeat(-(-cfg.max_num_seqs // len(rows)))[:cfg.max_num_seqs]])
        del hidden, logits
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        self.kv_cache = self.kv_scales = None  # release the profiling pool before sizing the real one
        for layer in self.attn_layers:
            layer.k_cache = layer.v_cache = torch.empty(0)
            layer.k_scales = layer.v_scales = None
        torch.cuda.empty_cache()
        # graphs keep one decode-sized activation set: small next to a prefill peak
        graph_bytes = peak * cfg.max_num_seqs // max(cfg.max_num_batched_tokens, 1) if with_graphs else 0
        logger.info("profiled activations: %.2f GiB peak, %.2f GiB reserved for CUDA graphs",
                    peak / 2**30, graph_bytes / 2**30)
        return peak + graph_bytes

    def reset_timers(self) -> None:
        """Start measuring time spent in the model forward (synchronises CUDA each step)."""
        self.num_steps, self.forward_seconds, self._timing = 0, 0.0, True

    # ---- a step ---------------------------------------------------------------------------
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        """A whole step on a single rank: inputs, forward (with the grammar masks computed
        alongside), sampling."""
        inputs = self.prepare(batch)
        self._start_masks(batch)
        return self.sample(self.forward(inputs), batch)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """This rank's forward: logits of the sampling rows [N, vocab / tp], or None when no
        sequence samples this step."""
        input_ids, positions, meta, logits_rows = inputs
        graphed = (self.graphs is not None and meta.num_decodes == meta.num_seqs
                   and self.graphs.bucket_for(meta.num_seqs) is not None)
        if not graphed:
            self.backend.prepare(meta, self.block_size)
        self.num_steps += 1
        if self._timing:
            self._sync()
            start = time.perf_counter()
        if graphed:
            hidden = self.graphs.run(input_ids, positions, meta)  # [T, hidden]
            hidden = None if logits_rows is None else hidden[logits_rows]
        else:  # only the rows that sample: [N, hidden]
            hidden = self.model(input_ids, positions, meta, _keep_rows(logits_rows, self.device))
        logits = None if logits_rows is None else self.model.compute_logits(hidden)  # [N, vocab / tp]
        if self._timing:
            self._sync()
            self.forward_seconds += time.perf_counter() - start
        return logits

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor | None, batch: ScheduledBatch) -> StepOutput:
        """The next token of each sampling sequence from the whole-vocabulary logits [N, vocab]."""
        for seq_id in batch.freed_seq_ids:
            self.token_counts.pop(seq_id, None)
        if logits is None:
            return StepOutput()
        rows = batch.seqs if batch.continues else [s for s in batch.seqs if s.sample]
        prompt = None
        if logits.shape[0] > len(rows):  # rows that score prompt tokens follow the sampled ones
            prompt = prompt_logprobs(logits[len(rows):], batch.seqs)
            logits = logits[:len(rows)]
            if not rows:
                return StepOutput(prompt_logprobs=prompt)
        t = self._sampling_tensors(rows, logits.shape[-1], batch.index, batch.continues)
        out = self.sampler(logits, t, self.generator)
        tokens = out.tokens.cpu()
        if self._packer is not None:  # what the next batch computes, should it continue this one
            self._packer.sampled = (batch.index, tokens) if len(rows) == len(batch.seqs) else None
        return StepOutput(tokens.tolist(), _logprobs(rows, out), prompt)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _sampling_tensors(self, rows: list[ScheduledSeq], vocab: int, index: int = -1,
                          continues: bool = False) -> SamplingTensors:
        """Per-row settings as tensors; options no row uses stay None (no work). What the
        rows' params decide is built once for a run of steps with the same params objects
        (steady decoding; not even compared where the batch continues the last one, index
        and continues: its ScheduledBatch's); seeds, min_tokens bans and penalty counts,
        which move with the tokens, every step."""
        fixed = self._fixed_settings
        if not (continues and fixed is not None and fixed.index == index - 1 and fixed.vocab == vocab):
            params = list(map(_PARAMS, rows))
            if (fixed is None or fixed.vocab != vocab or len(fixed.params) != len(params)
                    or not all(map(is_, params, fixed.params))):
                fixed = self._fixed_settings = _FixedSettings.build(params, vocab, self.device)
                fixed.bans = self._bans(params)
                fixed.masked = [i for i, p in enumerate(params) if p.has_token_mask]
        fixed.index = index
        t = copy(fixed.tensors)
        if fixed.seeded_rows:
            t.seeded = seed_keys(rows, fixed.seeded_rows) or None
        if fixed.penalties:
            self._penalty_tensors(t, rows)
        if fixed.masked:
            self._mask_tensors(t, rows, fixed.masked, vocab)
        if fixed.bans:
            groups: dict[int, tuple[list[int], torch.Tensor]] = {}  # rows sharing one ban list
            for i, ids in fixed.bans:
                s = rows[i]
                if s.num_generated < s.params.min_tokens:
                    groups.setdefault(id(ids), ([], ids))[0].append(i)
            t.banned = [(list_tensor(r, device=self.device), ids) for r, ids in groups.values()] or None
        return t

    def _mask_tensors(self, t: SamplingTensors, rows: list[ScheduledSeq], masked: list[int], vocab: int) -> None:
        """The constrained rows' token masks for this step, packed into one [M, W] int32
        array (each row's words from its constraint: nanokv/constraints.py, nanokv/grammar.py),
        or the ones _start_masks began for these rows while the model ran."""
        ahead, self._ahead = self._ahead, None
        mask = ahead.result(rows, masked, vocab) if ahead is not None else None
        if mask is None:
            mask = build_masks(rows, masked, vocab)
        t.mask_rows = list_tensor(masked, device=self.device)
        t.mask = mask.to(self.device)

    def _start_masks(self, batch: ScheduledBatch) -> None:
        """Begin this step's grammar masks on a thread while the forward runs: the tokens they
        depend on are all known now (llguidance computes masks outside the GIL)."""
        if self._ahead is not None:  # a step that failed after starting its masks: they touch the same matchers
            self._ahead.thread.join()
            self._ahead = None
        rows = batch.seqs if batch.continues else [s for s in batch.seqs if s.sample]
        masked = [i for i, s in enumerate(rows) if s.constraint is not None and s.params.has_token_mask]
        if MASKS_AHEAD and any(isinstance(rows[i].constraint, GrammarConstraint) for i in masked):
            self._ahead = _MasksAhead(rows, masked, self.config.hf_config.vocab_size)

    def _bans(self, params: list[SamplingParams]) -> list[tuple[int, torch.Tensor]]:
        """(row, token ids to ban below min_tokens) for the rows whose request has
        min_tokens and something to ban; each request's ids built once while it stays in
        the batch (the cache keeps only the batch's requests)."""
        cache, bans = {}, []
        if max(map(_MIN_TOKENS, params), default=0) == 0:  # one C-level pass when no row has min_tokens
            self._ban_ids = cache
            return bans
        for i, p in enumerate(params):
            if not p.min_tokens or (not p.stop_token_ids and (p.ignore_eos or not self.eos_token_ids)):
                continue
            entry = cache.get(id(p)) or self._ban_ids.get(id(p))  # the entry holds p: its id is not reused
            if entry is None:
                entry = (p, self._ban_tensor(p))
            cache[id(p)] = entry
            bans.append((i, entry[1]))
        self._ban_ids = cache
        return bans

    def _ban_tensor(self, p: SamplingParams) -> torch.Tensor:
        """[K] int64: the stop_token_ids and (unless ignore_eos) EOS ids that min_tokens bans."""
        if not p.stop_token_ids:
            return self._eos_ids
        ids = p.stop_token_ids + ([] if p.ignore_eos else self.eos_token_ids)
        return list_tensor(list(dict.fromkeys(ids)), device=self.device)

    def _penalty_tensors(self, t: SamplingTensors, rows: list[ScheduledSeq]) -> None:
        """The penalised rows' distinct tokens, from counts kept per sequence across steps (a
        step counts only its new tokens); the per-row values are _FixedSettings'."""
        dev = self.device
        penalised, counts = [], []
        for i, s in enumerate(rows):
            if s.params.has_penalties:
                state = self.token_counts.get(s.seq_id)
                if state is None or state.tokens is not s.all_token_ids:  # first step, or a stale entry
                    state = self.token_counts[s.seq_id] = TokenCounts(s.all_token_ids, s.num_prompt_tokens)
                state.update()
                penalised.append(i)
                counts.append(state)
        sizes = list_tensor([len(c.ids) for c in counts])
        t.penalty_rows = torch.repeat_interleave(list_tensor(penalised), sizes).to(dev)
        t.penalty_ids = torch.cat([torch.frombuffer(c.ids, dtype=torch.int64) for c in counts]).to(dev)
        t.penalty_counts = torch.cat([torch.frombuffer(c.counts, dtype=torch.float32) for c in counts]).to(dev)

    # ---- inputs (runner/inputs.py) ---------------------------------------------------------
    @property
    def packer(self) -> StepPacker:
        if self._packer is None:
            host = self.block_table if self.device.type == "cpu" else torch.zeros_like(self.block_table, device="cpu")
            self._packer = StepPacker(self.block_size, host, pin_memory=self.device.type == "cuda")
        return self._packer

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """The step's inputs on this rank's device (pack, then unpack)."""
        return self.unpack(self.pack(batch))

    def pack(self, batch: ScheduledBatch) -> PackedStep:
        """Rank 0: the step in one host buffer, which the tensor-parallel executor also sends."""
        return self.packer.pack(batch)

    def unpack(self, packed: PackedStep) -> StepInputs:
        """Every rank: the packed step on the device, this rank's block table updated."""
        same = self._packer is not None and self._packer.rows.table is self.block_table
        try:
            return unpack_step(packed, self.block_table, apply_writes=not same)
        except BaseException:
            if self._packer is not None:  # the writes may not have reached the table: start rows afresh
                self._packer.reset()
            raise


@dataclass
class _FixedSettings:
    """The part of a step's SamplingTensors that its rows' params alone decide, and which
    per-step parts the rows need."""

    params: list[SamplingParams]  # the rows' own objects, compared by identity
    vocab: int
    tensors: SamplingTensors  # seeded, banned and the penalised (row, token) counts unset
    seeded_rows: list[int]  # rows that draw with their request's seed
    penalties: bool
    bans: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (row, ids) ModelRunner._bans
    masked: list[int] = field(default_factory=list)  # rows with a token mask (allowed_token_ids, bad_words)
    index: int = -1  # the batch (ScheduledBatch.index) they were last used for

    @staticmethod
    def build(params: list[SamplingParams], vocab: int, dev: torch.device) -> _FixedSettings:
        def column(values, dtype=torch.float32):
            return list_tensor(values, dtype, dev)

        # Each option is looked for with one C-level pass over the rows (map, count, max):
        # at hundreds of rows a Python loop per option costs more than the greedy draw.
        n = len(params)
        temps = list(map(_TEMPERATURE, params))
        all_greedy = max(temps, default=0) < SAMPLING_EPS
        t = SamplingTensors(torch.zeros(n, device=dev) if all_greedy else
                            column([0.0 if x < SAMPLING_EPS else x for x in temps]), all_greedy=all_greedy)
        seeded_rows = []
        if not all_greedy:
            if any(p.top_k > 0 for p in params):
                t.top_k = column([p.top_k if p.top_k > 0 else vocab for p in params], torch.long)
            if any(p.top_p < 1 for p in params):
                t.top_p = column([p.top_p for p in params])
            if any(p.min_p > 0 for p in params):
                t.min_p = column([p.min_p for p in params])
            seeded_rows = [i for i, p in enumerate(params) if p.seed is not None and not p.greedy]
        repetition, presence, frequency = (list(map(f, params)) for f in (_REPETITION, _PRESENCE, _FREQUENCY))
        penalties = repetition.count(1) != n or presence.count(0) != n or frequency.count(0) != n
        if penalties:  # some row has_penalties
            t.repetition, t.presence, t.frequency = (column(v) for v in (repetition, presence, frequency))
        biased = [(i, p.logit_bias) for i, p in enumerate(params) if p.logit_bias]
        if biased:  # (row, id, bias) triples: a short list per row, not a [N, V] tensor
            t.bias_rows = column([i for i, b in biased for _ in b], torch.long)
            t.bias_ids = column([k for _, b in biased for k in b], torch.long)
            t.bias_values = column([v for _, b in biased for v in b.values()])
        logprobs = list(map(_LOGPROBS, params))
        asked = [] if logprobs.count(None) == n else [i for i, k in enumerate(logprobs) if k is not None]
        if asked:
            t.max_logprobs = max(params[i].logprobs for i in asked)
            t.logprob_rows = None if len(asked) == n else column(asked, torch.long)
        return _FixedSettings(params, vocab, t, seeded_rows, penalties)


MASKS_AHEAD = True  # grammar masks computed on a thread during the forward (see _start_masks)


def build_masks(rows: list[ScheduledSeq], masked: list[int], vocab: int) -> torch.Tensor:
    """[M, W] int32: the words of the rows masked of rows, from their constraints."""
    mask = torch.empty(len(masked), (vocab + 31) // 32, dtype=torch.int32)
    fill_masks([(rows[i].constraint, rows[i].all_token_ids, rows[i].num_prompt_tokens) for i in masked],
               mask.numpy())
    return mask


class _MasksAhead:
    """build_masks on a thread of its own, for rows known before the forward."""

    def __init__(self, rows: list[ScheduledSeq], masked: list[int], vocab: int):
        self.key = ([rows[i].seq_id for i in masked], vocab)
        self.mask: torch.Tensor | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(rows, masked, vocab), daemon=True)
        self.thread.start()

    def _run(self, rows, masked, vocab) -> None:
        try:
            with torch.inference_mode():
                self.mask = build_masks(rows, masked, vocab)
        except BaseException as e:  # raised where the step joins it
            self.error = e

    def result(self, rows: list[ScheduledSeq], masked: list[int], vocab: int) -> torch.Tensor | None:
        """The mask, once built, if it is for these rows (None: build it now)."""
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.mask if self.key == ([rows[i].seq_id for i in masked], vocab) else None


def _keep_rows(rows: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The rows a step computes logits for, as the model's keep argument (none: empty)."""
    return torch.empty(0, dtype=torch.long, device=device) if rows is None else rows


def _logprobs(rows: list[ScheduledSeq], out: SamplerOutput) -> list[TokenLogprobs | None] | None:
    """Each row's TokenLogprobs (None where it did not ask); out holds the asking rows only."""
    if out.logprobs is None:
        return None
    lp, ranks = iter(out.logprobs.tolist()), iter(out.ranks.tolist())
    top_ids = iter(out.top_ids.tolist()) if out.top_ids is not None else None
    top_lp = iter(out.top_logprobs.tolist()) if out.top_logprobs is not None else None
    result: list[TokenLogprobs | None] = []
    for s in rows:
        n = s.params.logprobs
        if n is None:
            result.append(None)
            continue
        ids, lps = (next(top_ids), next(top_lp)) if top_ids is not None else ([], [])
        result.append(TokenLogprobs(next(lp), next(ranks), ids[:n], lps[:n]))
    return result


_SCORE_ROWS = 256  # prompt-scoring rows per log_softmax: bounds its float32 copy to this many x vocab


def prompt_logprobs(logits: torch.Tensor, seqs: list[ScheduledSeq]) -> dict[int, list[TokenLogprobs]]:
    """Each scoring sequence's prompt TokenLogprobs from the raw logits of its
    prompt_positions ([R, vocab], the rows in batch and position order, as the step packed
    them): log_softmax before any penalty or temperature, as vLLM's prompt logprobs."""
    scoring = [(s, s.prompt_positions()) for s in seqs if s.prompt_logprobs is not None]
    targets = [t for s, r in scoring for t in s.all_token_ids[r.start + 1:r.stop + 1]]
    assert len(targets) == logits.shape[0], "the step's scoring rows and its sequences disagree"
    k = min(max(s.prompt_logprobs for s, _ in scoring), logits.shape[1])
    target = torch.tensor(targets, dtype=torch.long, device=logits.device)
    picked, ranks, top_lp, top_ids = [], [], [], []
    for a in range(0, len(targets), _SCORE_ROWS):
        lp = logits[a:a + _SCORE_ROWS].float().log_softmax(dim=-1)  # [r, vocab]
        mine = lp.gather(1, target[a:a + _SCORE_ROWS, None])  # [r, 1]
        picked.append(mine.squeeze(1))
        ranks.append((lp > mine).sum(dim=1) + 1)
        if k > 0:
            vals, ids = lp.topk(k, dim=1)
            top_lp.append(vals)
            top_ids.append(ids)
    lps, rks = torch.cat(picked).tolist(), torch.cat(ranks).tolist()
    tids = torch.cat(top_ids).tolist() if k > 0 else None
    tlps = torch.cat(top_lp).tolist() if k > 0 else None
    result, at = {}, 0
    for s, r in scoring:
        n, entries = s.prompt_logprobs, []
        for j in range(at, at + len(r)):
            entries.append(TokenLogprobs(lps[j], rks[j], tids[j][:n] if n else [], tlps[j][:n] if n else []))
        result[s.seq_id] = entries
        at += len(r)
    return result
