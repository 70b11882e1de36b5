"""ScheduledBatch -> flat token tensors + AttentionMetadata -> logits -> sampled tokens."""

from __future__ import annotations

import logging
import time
from itertools import chain

import torch

import torch.distributed as dist

from nanokv import distributed as tpd
from nanokv.attention import AttentionMetadata, get_backend
from nanokv.config import EngineConfig
from nanokv.distributed import TP
from nanokv.engine.types import EngineDeadError, ScheduledBatch, ScheduledSeq, StepOutput, TokenLogprobs
from nanokv.layers.attention import Attention
from nanokv.layers.sampler import Sampler, SamplerOutput, SamplingTensors, seed_for_token
from nanokv.loader import build_model
from nanokv.models import get_model_class
from nanokv.models.llama import head_dim
from nanokv.runner.cuda_graph import DecodeGraphs
from nanokv.runner.kv_cache import allocate_kv_cache, bytes_per_block, num_kv_blocks

logger = logging.getLogger("nanokv")


class ModelRunner:
    """Rank 0 (the engine's process) drives; with tensor_parallel_size > 1 it first spawns
    the worker ranks, which build the same runner on their shard and serve() steps."""

    def __init__(self, config: EngineConfig, tp: TP | None = None, init_method: str | None = None):
        self.config = config
        self.tp = tp or TP(0, config.tensor_parallel_size)
        self.device = config.device
        if self.tp.rank > 0 and config.device.type == "cuda":
            self.device = torch.device("cuda", self.tp.rank)
            torch.cuda.set_device(self.device)
        self.workers = []
        self.closed = False
        if self.tp.size > 1:
            self._start_group(init_method)
        hf = config.hf_config
        self.model = build_model(get_model_class(config.architecture), hf, config.model,
                                 config.dtype, self.device, config.max_model_len, self.tp)
        self.vocab_size = hf.vocab_size
        self.block_size = config.block_size
        self.backend = get_backend(config.attention_backend)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        assert len(self.attn_layers) == hf.num_hidden_layers
        for layer in self.attn_layers:
            layer.backend = self.backend
        self.kv_shape = (hf.num_hidden_layers, self.attn_layers[0].num_kv_heads, head_dim(hf))
        use_graphs = (config.device.type == "cuda" and not config.enforce_eager
                      and self.backend.supports_cuda_graphs and self.tp.size == 1)
        activation_bytes = self._profile_activation_bytes(use_graphs) if config.device.type == "cuda" else 0
        self.num_blocks = num_kv_blocks(config, bytes_per_block(config, *self.kv_shape), activation_bytes)
        if self.tp.size > 1:  # every rank must hand out the same block ids: take the smallest pool
            n = torch.tensor([self.num_blocks], device=self.device)
            dist.all_reduce(n, op=dist.ReduceOp.MIN)
            self.num_blocks = int(n.item())
        # one block more than the block manager hands out: the scratch block of padding rows
        self._set_kv_cache(allocate_kv_cache(config, self.num_blocks + 1, *self.kv_shape))
        self.graphs = None
        if use_graphs:
            self.graphs = DecodeGraphs(self.model, self.backend, self.block_size, config.max_num_seqs,
                                       config.max_model_len, self.num_blocks, config.device)
        self.sampler = Sampler()
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        if self.tp.rank == 0 and self.tp.size > 1:
            self._wait_for_workers()
        self.eos_token_ids = list(config.eos_token_ids)
        self.num_steps = 0
        self.forward_seconds = 0.0  # model forward + LM head, measured only after reset_timers()
        self._timing = False

    # ---- tensor parallelism ---------------------------------------------------------------
    def _start_group(self, init_method: str | None) -> None:
        if self.tp.rank == 0 and dist.is_initialized():
            raise ValueError("another tensor-parallel LLM (or torch.distributed group) already exists in this "
                             "process and owns the default process group; call close() on that LLM first, "
                             "or use tensor_parallel_size=1")
        if self.tp.rank == 0:
            import multiprocessing as mp
            import weakref

            init_method = f"tcp://127.0.0.1:{tpd.free_port()}"
            ctx = mp.get_context("spawn")
            pipes = []
            for rank in range(1, self.tp.size):
                recv, send = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=tpd.worker_main, daemon=True, name=f"nanokv-tp{rank}",
                                   args=(self.config, rank, self.tp.size, init_method, send))
                proc.start()
                self.workers.append(proc)
                pipes.append(recv)
            self._finalizer = weakref.finalize(self, _shutdown, self.workers, self.device)
        tpd.init_group(self.tp.rank, self.tp.size, init_method, self.device)
        if self.tp.rank == 0:
            self._ready_pipes = pipes

    def _wait_for_workers(self) -> None:
        for rank, pipe in enumerate(self._ready_pipes, start=1):
            if not pipe.poll(tpd.TIMEOUT.total_seconds()):
                self.close()
                raise RuntimeError(f"tensor-parallel worker {rank} did not start in time")
            status = pipe.recv()
            if status != "ok":
                self.close()
                raise RuntimeError(f"tensor-parallel worker {rank} failed to start: {status}")

    def check_workers(self) -> None:
        if self.closed:
            raise EngineDeadError("this LLM is closed; create a new LLM")
        dead = [(i + 1, p.exitcode) for i, p in enumerate(self.workers) if not p.is_alive()]
        if dead:
            self.close()
            raise EngineDeadError(f"tensor-parallel worker(s) died: {', '.join(_describe_exit(r, c) for r, c in dead)}"
                                  "; the engine cannot continue, create a new LLM")

    def close(self) -> None:
        """Stop the worker ranks (rank 0 only; idempotent)."""
        self.closed = True
        if self.workers and getattr(self, "_finalizer", None) is not None:
            self._finalizer()

    @torch.inference_mode()
    def serve(self) -> None:
        """Worker ranks: run the steps rank 0 broadcasts until it says stop."""
        header = torch.empty(tpd.HEADER_LEN, dtype=torch.long, device=self.device)
        while True:
            dist.broadcast(header, src=0)
            values = header.tolist()
            if values[0] == tpd.OP_SHUTDOWN:
                return
            size = 3 * values[1] + (values[2] + 1) + values[2] + values[2] * values[4] + values[5]
            payload = torch.empty(size, dtype=torch.long, device=self.device)
            dist.broadcast(payload, src=0)
            ids, positions, slots, qsl, seq_lens, tables, rows, num_decodes = tpd.unpack_step(values, payload)
            q_lens = (qsl[1:] - qsl[:-1]).tolist()
            seq_lens_cpu = seq_lens.tolist()
            meta = AttentionMetadata(slots, qsl, seq_lens, tables, num_decodes, max(q_lens), max(seq_lens_cpu),
                                     q_lens, seq_lens_cpu)
            self.backend.prepare(meta, self.block_size)
            hidden = self.model(ids, positions, meta, _keep_rows(rows, self.device))
            if rows is not None:
                dist.gather(self.model.compute_logits(hidden).contiguous(), dst=0)

    def _gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(local) for _ in range(self.tp.size)]
        dist.gather(local.contiguous(), parts, dst=0)
        return torch.cat(parts, dim=-1)

    def _set_kv_cache(self, cache: torch.Tensor) -> None:
        self.kv_cache = cache
        for i, layer in enumerate(self.attn_layers):
            layer.k_cache, layer.v_cache = cache[i, 0], cache[i, 1]

    @torch.inference_mode()
    def _profile_activation_bytes(self, with_graphs: bool) -> int:
        """Peak GPU memory of the largest step beyond the weights (a full token budget of
        prefill, logits for max_num_seqs rows), plus the decode activations CUDA graphs
        keep in their pool."""
        cfg, bs = self.config, self.block_size
        seq_len = min(cfg.max_model_len - 1, cfg.max_num_batched_tokens)
        num_seqs = max(1, min(cfg.max_num_seqs, cfg.max_num_batched_tokens // seq_len))
        per_seq = -(-seq_len // bs)
        self._set_kv_cache(allocate_kv_cache(cfg, num_seqs * per_seq, *self.kv_shape, log=False))
        from nanokv.engine.types import ScheduledBatch as _Batch

        batch = _Batch()
        params = _profile_params()
        for i in range(num_seqs):
            table = list(range(i * per_seq, (i + 1) * per_seq))
            batch.seqs.append(ScheduledSeq(i, [0] * seq_len, 0, table, True, params))
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        input_ids, positions, meta, rows = self._prepare(batch)
        self.backend.prepare(meta, bs)
        hidden = self.model(input_ids, positions, meta)
        logits = self.model.compute_logits(hidden[rows.repeat(-(-cfg.max_num_seqs // len(rows)))[:cfg.max_num_seqs]])
        del hidden, logits
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        self.kv_cache = None  # release the profiling pool before sizing the real one
        for layer in self.attn_layers:
            layer.k_cache = layer.v_cache = torch.empty(0)
        torch.cuda.empty_cache()
        # graphs keep one decode-sized activation set: small next to a prefill peak
        graph_bytes = peak * cfg.max_num_seqs // max(cfg.max_num_batched_tokens, 1) if with_graphs else 0
        logger.info("profiled activations: %.2f GiB peak, %.2f GiB reserved for CUDA graphs",
                    peak / 2**30, graph_bytes / 2**30)
        return peak + graph_bytes

    def reset_timers(self) -> None:
        """Start measuring time spent in the model forward (synchronises CUDA each step)."""
        self.num_steps, self.forward_seconds, self._timing = 0, 0.0, True

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        input_ids, positions, meta, logits_rows = self._prepare(batch)
        if self.tp.size == 1:
            logits = self._forward(input_ids, positions, meta, logits_rows)
        else:
            logits = self._forward_tp(input_ids, positions, meta, logits_rows)
        if logits is None:
            return StepOutput()
        rows = [s for s in batch.seqs if s.sample]
        out = self.sampler(logits, self._sampling_tensors(rows, logits.shape[-1]), self.generator)
        return StepOutput(out.tokens.tolist(), _logprobs(rows, out))

    def _forward_tp(self, input_ids, positions, meta, logits_rows) -> torch.Tensor | None:
        """The step on every rank: broadcast, forward with its all-reduces, logits gathered.
        A collective that breaks means a worker died: the engine cannot go on."""
        self.check_workers()
        try:
            tpd.broadcast_step(*tpd.pack_step(input_ids, positions, meta.slot_mapping, meta.query_start_loc,
                                              meta.seq_lens, meta.block_tables, logits_rows,
                                              meta.num_decodes, self.device))
            logits = self._forward(input_ids, positions, meta, logits_rows)
            return None if logits is None else self._gather_logits(logits)  # [N, vocab]
        except RuntimeError as e:
            deadline = time.monotonic() + 2  # let the dead worker's exit be seen
            while time.monotonic() < deadline and all(p.is_alive() for p in self.workers):
                time.sleep(0.05)
            self.check_workers()
            self.close()
            raise EngineDeadError(f"a tensor-parallel step failed ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''}); the engine cannot continue, "
                                  "create a new LLM") from e

    def _forward(self, input_ids, positions, meta, logits_rows) -> torch.Tensor | None:
        """This rank's forward: logits of the sampling rows [N, vocab / tp], or None."""
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

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _sampling_tensors(self, rows: list[ScheduledSeq], vocab: int) -> SamplingTensors:
        """Per-row settings as tensors; options no row uses stay None (no work)."""
        dev, params = self.device, [s.params for s in rows]

        def column(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=dev)

        t = SamplingTensors(column([0.0 if p.greedy else p.temperature for p in params]),
                            all_greedy=all(p.greedy for p in params))
        if not t.all_greedy:
            if any(p.top_k > 0 for p in params):
                t.top_k = column([p.top_k if p.top_k > 0 else vocab for p in params], torch.long)
            if any(p.top_p < 1 for p in params):
                t.top_p = column([p.top_p for p in params])
            if any(p.min_p > 0 for p in params):
                t.min_p = column([p.min_p for p in params])
            seeded = [(i, seed_for_token(s.seed, s.num_generated)) for i, s in enumerate(rows)
                      if s.seed is not None and not s.params.greedy]
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
        # Decodes (one query token) first, shortest context first, then prefill chunks,
        # shortest first: backends that pad groups of similar sequences waste little.
        order = sorted((i for i, s in enumerate(seqs) if len(s.token_ids) == 1), key=lambda i: seqs[i].start_pos)
        num_decodes = len(order)
        order += sorted((i for i, s in enumerate(seqs) if len(s.token_ids) != 1),
                        key=lambda i: len(seqs[i].token_ids))
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


def _keep_rows(rows: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The rows a step computes logits for, as the model's keep argument (none: empty)."""
    return torch.empty(0, dtype=torch.long, device=device) if rows is None else rows


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


def _profile_params():
    from nanokv.sampling_params import SamplingParams

    return SamplingParams(temperature=0)


def _describe_exit(rank: int, code: int | None) -> str:
    if code is not None and code < 0:
        import signal

        return f"rank {rank} (killed by {signal.Signals(-code).name})"
    return f"rank {rank} (exit code {code})"


def _shutdown(workers, device: torch.device) -> None:
    """Tell the worker ranks to stop, wait briefly, then make sure they are gone."""
    try:
        if dist.is_initialized():
            if all(p.is_alive() for p in workers):
                stop = torch.zeros(tpd.HEADER_LEN, dtype=torch.long, device=device)
                stop[0] = tpd.OP_SHUTDOWN
                dist.broadcast(stop, src=0)
            dist.destroy_process_group()
    except Exception:  # a broken group: the workers are killed below anyway
        pass
    for p in workers:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
