"""LLMEngine: requests in, RequestOutputs out.

It validates and tokenizes requests, keeps their bookkeeping, and wires the torch-free
scheduler to an executor (the model's ranks) and to the output processor (text, stop
strings, streaming deltas, logprobs).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import operator
import os
import signal
import threading
import time
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass

from nanokv.config import EngineConfig
from nanokv.constraints import TokenConstraint, bad_words_token_ids
from nanokv.grammar import GrammarCompiler
from nanokv.engine.block_manager import BlockManager
from nanokv.engine.scheduler import Scheduler, SchedulerConfig
from nanokv.engine.sequence import Sequence
from nanokv.engine.stats import KVStats
from nanokv.engine.types import EngineDeadError, ScheduledBatch, StepOutput
from nanokv.inputs import PromptType
from nanokv.metrics import EngineMetrics, EngineSnapshot
from nanokv.output_processor import OutputProcessor, RequestState, accumulate
from nanokv.outputs import RequestMetrics, RequestOutput
from nanokv.sampling_params import RequestOutputKind, SamplingParams
from nanokv.unsupported import LORA, MULTIMODAL
from nanokv.vllm_config import ModelConfig, VllmConfig, vllm_config_of

logger = logging.getLogger("nanokv")


@dataclass
class StepStats:
    """What the last step computed, for progress reporting."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    seconds: float = 0.0


class LLMEngine:
    """Not thread-safe by itself: `lock` (re-entrant) serializes it. The step API
    (add_request, step, abort, kv_stats, close) takes it on each call; a caller of the
    building blocks (make_request, enqueue, advance) holds it around them, as LLM does, or
    keeps the engine to one thread, as AsyncLLM does.

    vLLM's step loop works as in vLLM:

    >>> engine = LLMEngine.from_engine_args(EngineArgs(model="smollm2"))
    >>> engine.add_request("0", "Hello", SamplingParams(max_tokens=8))
    >>> while engine.has_unfinished_requests():
    ...     for out in engine.step():
    ...         print(out.outputs[0].text)
    """

    def __init__(self, config: EngineConfig, tokenizer=None):
        from nanokv.executor import make_executor

        self.config = config
        if tokenizer is None:
            tokenizer = load_tokenizer(config.tokenizer or config.model, use_fast=config.tokenizer_mode != "slow")
            if config.tokenizer is not None:
                check_tokenizer_fits(tokenizer, config.tokenizer, config.hf_config.vocab_size)
        self.tokenizer = tokenizer
        self._grammars: GrammarCompiler | None = None  # built at the first structured_outputs request
        self.executor = make_executor(config)
        self.runner = self.executor.runner  # rank 0's ModelRunner (timers, model) for tools and tests
        self.block_manager = BlockManager(self.executor.num_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens),
            self.block_manager, config.eos_token_ids)
        self.vocab_size = config.hf_config.vocab_size
        self.output_processor = OutputProcessor(self.tokenizer)
        self._requests: dict[str, RequestState] = {}
        self._ids = itertools.count()
        self._unclaimed: list[RequestOutput] = []  # outputs for step(), produced while others stepped
        self._closed: str | None = None  # why the engine no longer runs (closed, or a dead worker)
        self.last_step = StepStats()
        self.lock = threading.RLock()
        self.metrics = EngineMetrics(_model_name(config), config.max_model_len, {
            "block_size": str(config.block_size), "num_gpu_blocks": str(self.executor.num_blocks),
            "cache_dtype": config.kv_cache_dtype, "enable_prefix_caching": str(config.enable_prefix_caching),
            "gpu_memory_utilization": str(config.gpu_memory_utilization),
            "kv_cache_memory_bytes": str(config.kv_cache_memory_bytes)})
        self._prefilling: dict[str, RequestState] = {}  # scheduled, no token yet (for their first-token time)
        # vLLM's config objects, read-only views of config (model_config.max_model_len, ...)
        self.vllm_config = vllm_config_of(config, self.executor.num_blocks)
        self._profiler = None  # torch.profiler between start_profile() and stop_profile()
        self.model_config, self.cache_config = self.vllm_config.model_config, self.vllm_config.cache_config

    def get_model_config(self) -> ModelConfig:
        """vLLM's ModelConfig view: model, max_model_len, dtype, hf_config, get_vocab_size(), ..."""
        return self.model_config

    def get_vllm_config(self) -> VllmConfig:
        return self.vllm_config

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        """method(runner, *args, **kwargs) (a callable) or runner.method(*args, **kwargs) (a
        name) on the model runner, between two steps: [its result] (vLLM's one per rank)."""
        if self.config.tensor_parallel_size != 1:
            raise NotImplementedError(f"collective_rpc / apply_model reach the model in this process only; with "
                                      f"tensor_parallel_size={self.config.tensor_parallel_size} the other ranks run "
                                      "in worker processes: use tensor_parallel_size=1")
        if isinstance(method, str):
            if method.startswith("_") or not callable(getattr(self.runner, method, None)):
                raise ValueError(f"the model runner has no method {method!r}; pass a callable taking it, e.g. "
                                 "collective_rpc(lambda runner: runner.model)")
            function = getattr(self.runner, method)
        elif callable(method):
            function = functools.partial(method, self.runner)
        else:
            raise ValueError(f"method must be a name or a callable, got {type(method).__name__}")
        with self.lock:
            self._check_open()
            return [function(*args, **(kwargs or {}))]

    def start_profile(self) -> None:
        """torch.profiler over this process from now (see LLM.start_profile)."""
        import torch

        directory = os.environ.get("NANOKV_TORCH_PROFILER_DIR") or os.environ.get("VLLM_TORCH_PROFILER_DIR")
        if not directory:
            raise RuntimeError("the profiler is not enabled: set VLLM_TORCH_PROFILER_DIR (or "
                               "NANOKV_TORCH_PROFILER_DIR) to the directory for its traces")
        with self.lock:
            if self._profiler is not None:
                raise RuntimeError("the profiler is already running; call stop_profile() first")
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.config.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            handler = torch.profiler.tensorboard_trace_handler(os.path.abspath(directory), use_gzip=True)
            self._profiler = torch.profiler.profile(activities=activities, on_trace_ready=handler)
            self._profiler.start()

    def stop_profile(self) -> None:
        """Stop the profiler and write its trace into the profiler directory."""
        with self.lock:
            if self._profiler is None:
                raise RuntimeError("the profiler is not running; call start_profile() first")
            profiler, self._profiler = self._profiler, None
            profiler.stop()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation config defaults (EngineArgs.
        generation_config) applied: what a request without sampling params runs with."""
        return SamplingParams(**self.config.default_sampling_params)

    @classmethod
    def from_engine_args(cls, engine_args, usage_context=None, stat_loggers=None,
                         enable_multiprocessing: bool = False) -> "LLMEngine":
        """vLLM's constructor: an engine from EngineArgs. usage_context and
        enable_multiprocessing are accepted without effect; stat_loggers is not supported
        (kv_stats() reports the engine's statistics)."""
        if stat_loggers is not None:
            raise ValueError("stat_loggers is not supported by nanokv's LLMEngine; read engine.kv_stats() "
                             "after a step instead")
        return cls(engine_args.create_engine_config())

    def get_tokenizer(self):
        return self.tokenizer

    def set_tokenizer(self, tokenizer) -> None:
        """Use another tokenizer for new requests and for the text of all outputs from now
        on (it must encode and decode with the same ids as the model's)."""
        if not callable(tokenizer) or not callable(getattr(tokenizer, "decode", None)):
            raise ValueError(f"set_tokenizer() takes a tokenizer (callable, with decode()), got "
                             f"{type(tokenizer).__name__}")
        with self.lock:
            self.tokenizer = self.output_processor.tokenizer = tokenizer
            self._grammars = None

    # ---- requests ---------------------------------------------------------------------
    def make_request(self, prompt: PromptType, params: SamplingParams | None = None,
                     request_id: str | None = None, *, stream: bool = False) -> RequestState:
        """Validate and tokenize one request without queueing it (ValueError on bad input)."""
        self._check_open()
        arrival = RequestMetrics.now()
        params = self.get_default_sampling_params() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}; "
                             "build one with SamplingParams(...)")
        # A validated copy: fields set after construction are checked too, and later
        # changes to the caller's object cannot reach a running request.
        params = dataclasses.replace(params)
        self._check_params(params)
        if params.logprobs == -1:
            params.logprobs = self.vocab_size
        if params.prompt_logprobs == -1:
            params.prompt_logprobs = self.vocab_size
        text, token_ids = self._tokenize(prompt)
        if not token_ids:
            raise ValueError("prompt is empty; give at least one token")
        if params.truncate_prompt_tokens is not None:
            token_ids = token_ids[-self._truncation(params.truncate_prompt_tokens):]
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        max_len = self.config.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens but max_model_len is {max_len} (prompt plus "
                "at least one generated token must fit); raise max_model_len or shorten the prompt")
        if request_id is None:
            request_id = str(next(self._ids))
            while request_id in self._requests:
                request_id = str(next(self._ids))
        elif str(request_id) in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use; pick a unique id")
        request_id = str(request_id)
        room = max_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        constraints = self._constraints(params)
        seqs = [Sequence(request_id, token_ids, params, max_tokens, index=i, constraint=constraints(i))
                for i in range(params.n)]
        req = self.output_processor.new_request(request_id, text, token_ids, params, stream, seqs)
        req.metrics = arrival
        return req

    def _truncation(self, k: int) -> int:
        """How many prompt tokens truncate_prompt_tokens=k keeps (-1: all that leave room
        for one generated token, as the prompt limit is)."""
        max_len = self.config.max_model_len
        if k == -1:
            return max_len - 1
        if k > max_len:
            raise ValueError(f"truncate_prompt_tokens={k} is more than max_model_len={max_len}; pick a smaller "
                             "value, or -1 for as many as fit")
        return k

    def _check_params(self, params: SamplingParams) -> None:
        """The bounds that depend on the model (SamplingParams checks the rest itself)."""
        vocab, most = self.vocab_size, self.config.max_logprobs
        allowed = vocab if most == -1 else min(most, vocab)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k == -1:  # vLLM: the whole vocabulary, if max_logprobs allows that many
                if most != -1 and most < vocab:
                    raise ValueError(f"{name}=-1 asks for the whole vocabulary ({vocab} tokens) but max_logprobs "
                                     f"is {most}; raise max_logprobs to {vocab} or ask for fewer")
            elif k is not None and k > allowed:
                raise ValueError(f"{name}={k} is more than the {allowed} allowed "
                                 f"(max_logprobs={most}, vocabulary {vocab}); ask for fewer or raise max_logprobs")
        if params.top_k > vocab:
            raise ValueError(f"top_k={params.top_k} exceeds the vocabulary size {vocab}; "
                             f"use -1 (off) or a value in [1, {vocab}]")
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("allowed_token_ids", params.allowed_token_ids),
                          ("logit_bias", params.logit_bias)):
            bad = [t for t in ids or () if t >= vocab]
            if bad:
                raise ValueError(f"{name} has token ids {bad[:5]} outside the vocabulary [0, {vocab})")

    def _constraints(self, params: SamplingParams):
        """sample index -> its token mask source: one TokenConstraint shared by the samples,
        or with structured_outputs a grammar matcher each (compiled here, in the caller's
        thread: a bad spec is a ValueError before the request is queued)."""
        base = self._constraint(params)
        spec = params.structured_outputs
        if spec is None:
            return lambda i: base
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.config.eos_token_ids)
        grammar = self._grammars.compile(spec)
        return lambda i: self._grammars.constraint(grammar, base)

    def _constraint(self, params: SamplingParams) -> TokenConstraint | None:
        """The request's token mask (allowed_token_ids, bad_words), or None."""
        if params.allowed_token_ids is None and params.bad_words is None:
            return None
        bad_ids = []
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words needs a tokenizer (the engine has none); use allowed_token_ids or "
                                 "logit_bias with token ids")
            bad_ids = bad_words_token_ids(params.bad_words, self.tokenizer)
            outside = [t for ids in bad_ids for t in ids if not 0 <= t < self.vocab_size]
            if outside:
                raise ValueError(f"bad_words tokenize to ids {outside[:5]} outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        return TokenConstraint(self.vocab_size, params.allowed_token_ids, bad_ids)

    def add_request(self, *args, **kwargs) -> str:
        """Queue a request; returns its id. ValueError on bad input (nothing is queued).

        Two argument orders, told apart by the second positional argument:

        nanokv's, add_request(prompt, params=None, request_id=None, *, stream=False):
        stream=False: step() returns the request once, when all its samples finish
        (params.output_kind=DELTA streams as stream=True does).
        stream=True: step() returns a delta each step a sample produces tokens
        (CompletionOutput token_ids and text hold only what is new), and finished=True
        on the request's last one.

        vLLM's, add_request(request_id, prompt, params, arrival_time=None,
        lora_request=None, tokenization_kwargs=None, trace_headers=None, priority=0):
        step() returns what params.output_kind asks for: CUMULATIVE (the default) the whole
        output so far each step that moves the request, DELTA only what is new, FINAL_ONLY
        one output at the end. arrival_time and trace_headers have no effect; lora_request,
        tokenization_kwargs and a priority other than 0 are refused.
        """
        if (len(args) >= 2 and not isinstance(args[1], (SamplingParams, type(None)))) or \
                (len(args) == 1 and "prompt" in kwargs):
            return self._add_vllm_request(*args, **kwargs)
        return self._add_request(*args, **kwargs)

    def _add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                     request_id: str | None = None, *, stream: bool = False) -> str:
        stream = stream or (params is not None and params.output_kind == RequestOutputKind.DELTA)
        with self.lock:
            req = self.make_request(prompt, params, request_id, stream=stream)
            self.enqueue(req)
        return req.request_id

    def _add_vllm_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                          arrival_time: float | None = None, lora_request=None, tokenization_kwargs=None,
                          trace_headers=None, priority: int = 0) -> str:
        if request_id is None:
            raise ValueError("request_id is required in vLLM's order, add_request(request_id, prompt, params); "
                             "or call add_request(prompt, params) and use the id it returns")
        check_vllm_extras(lora_request, tokenization_kwargs, [priority])
        kind = RequestOutputKind.CUMULATIVE if params is None else params.output_kind
        with self.lock:
            req = self.make_request(prompt, params, request_id, stream=kind != RequestOutputKind.FINAL_ONLY)
            req.cumulative = kind == RequestOutputKind.CUMULATIVE
            self.enqueue(req)
        return req.request_id

    def enqueue(self, req: RequestState, sink: list | None = None) -> None:
        """Queue a request made (and validated) by make_request. The n samples of a
        request share the prompt's blocks: the first computes them, the others hit.

        sink: a list that receives the request's outputs whoever steps the engine
        (LLM.generate and LLM.stream own their requests this way); without one, step()
        returns them."""
        self._check_open()
        if req.request_id in self._requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use; pick a unique id")
        req.sink = sink
        req.metrics.queued_ts = time.monotonic()
        self._requests[req.request_id] = req
        self.output_processor.add(req)
        for seq in req.seqs:
            self.scheduler.add(seq)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            _check_prompt_keys(prompt)
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")
                return (text if isinstance(text, str) else None), _token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs a 'prompt' or 'prompt_token_ids' key")
        if isinstance(prompt, str):
            check_text(prompt, "prompt")
            return prompt, list(self.tokenizer(prompt).input_ids)
        if hasattr(prompt, "tolist") and getattr(prompt, "ndim", None) == 1:  # numpy / torch ids
            prompt = prompt.tolist()
        if isinstance(prompt, (list, tuple)):
            return None, _token_ids(prompt)
        raise ValueError(f"a prompt is a str, a list of token ids or a dict with 'prompt' or "
                         f"'prompt_token_ids', got {type(prompt).__name__}")

    def abort(self, request_id: str) -> None:
        """Drop a request; its KV blocks are free at once. Unknown ids are ignored. Safe at
        any point, also when an interrupt cut a step short."""
        with self.lock:
            req = self._requests.pop(str(request_id), None)
            if req is None:
                return
            reasons = [seq.finish_reason if seq.is_finished else "abort" for seq in req.seqs]
            for seq in req.seqs:
                self.output_processor.forget(seq)
                self.scheduler.abort(seq)
            self._prefilling.pop(req.request_id, None)
            req.metrics.finished_ts = time.monotonic()
            self.metrics.count_finished(reasons)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """vLLM's name: abort one request or several (unknown ids are ignored)."""
        for rid in [request_id] if isinstance(request_id, (str, int)) else list(request_id):
            self.abort(rid)

    def has_unfinished_requests(self) -> bool:
        """Whether step() has more to do or to return (vLLM's name)."""
        return self.has_unfinished() or bool(self._unclaimed)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's reset_prefix_cache). Only possible
        while no request holds blocks: returns False and changes nothing otherwise."""
        with self.lock:
            return self.block_manager.reset_prefix_cache()

    def has_request(self, request_id: str) -> bool:
        """Whether the request is queued or running (not finished, failed or aborted)."""
        return str(request_id) in self._requests

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def kv_stats(self) -> KVStats:
        with self.lock:
            stats, runner = self.scheduler.kv_stats(), self.runner
            committed = runner.kv_reserved_bytes  # 0 once closed
            if runner.kv_commits_lazily:
                committed = min(committed, stats.touched_blocks * stats.block_size * runner.kv_bytes_per_token)
            return dataclasses.replace(stats, bytes_per_token=runner.kv_bytes_per_token,
                                       reserved_bytes=runner.kv_reserved_bytes, committed_bytes=committed)

    def snapshot(self, num_handed: int = 0) -> EngineSnapshot:
        """The gauges of the metrics; num_handed: sequences a front end holds for admission."""
        with self.lock:
            sched = self.scheduler
            return EngineSnapshot(len(sched.running), len(sched.waiting) + num_handed, self.kv_stats())

    def do_log_stats(self) -> None:
        """vLLM's: log the engine's statistics now (the KV cache summary, at INFO)."""
        logger.info(self.kv_stats().summary())

    def get_metrics(self) -> list:
        """Every vllm: metric as vLLM's reader records (nanokv.metrics.reader)."""
        with self.lock:
            return self.metrics.get_metrics(self.snapshot())

    def close(self) -> None:
        """Stop the executor (tensor-parallel workers); later calls raise RuntimeError. Waits
        for a step another thread is running."""
        with self.lock:
            if self._closed is None:
                self._closed = "this LLM is closed; create a new LLM"
            self.executor.close()

    def _check_open(self) -> None:
        if self._closed is not None:
            raise EngineDeadError(self._closed)

    # ---- stepping ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch. Returns the requests added through add_request that finished
        (also those that finished while LLM.generate or LLM.stream stepped the engine) and,
        for streaming ones, their new deltas."""
        with self.lock:
            self.advance()
            outputs, self._unclaimed = self._unclaimed, []
        return outputs

    def advance(self) -> None:
        """Run one batch. Each request's outputs go to its sink, or wait for step()."""
        self._check_open()
        start = time.perf_counter()
        sched = self.scheduler
        num_running = len(sched.running)
        with _sigint_deferred():  # the bookkeeping below must not stop halfway
            batch = sched.schedule()
            if len(sched.running) > num_running:  # admissions join the end (none in a step that preempts)
                self._admitted(sched.running[num_running:])
        if not batch.seqs:
            self.last_step = StepStats()
            return
        batch, output, failed = self._execute(batch)
        with _sigint_deferred():
            self._apply(batch, output, failed)
        decodes = _num_decodes(batch)
        self.last_step = StepStats(batch.num_tokens - decodes, decodes, time.perf_counter() - start)

    def _admitted(self, seqs: list[Sequence]) -> None:
        """Stamp the first scheduling of the requests these admitted sequences belong to."""
        now = time.monotonic()
        for seq in seqs:
            req = self._requests.get(seq.request_id)
            if req is None or req.metrics.scheduled_ts:  # readmitted after a preemption, or a later sample
                continue
            req.metrics.scheduled_ts = now
            req.num_cached_tokens = seq.num_cached_tokens
            self._prefilling[req.request_id] = req

    def _first_tokens(self, now: float) -> None:
        """Stamp the requests whose first token came in this step."""
        done = [req for req in self._prefilling.values() if any(seq.num_output_tokens for seq in req.seqs)]
        for req in done:
            del self._prefilling[req.request_id]
            m = req.metrics
            m.first_token_ts = m.last_token_ts = now
            self.metrics.on_first_token(m.first_token_latency, len(req.prompt_token_ids))

    def _finished(self, req: RequestState, now: float) -> None:
        m, seqs = req.metrics, req.seqs
        m.last_token_ts = m.finished_ts = now  # a request ends in the step of its last token
        m.num_generation_tokens = sum(seq.num_output_tokens for seq in seqs)
        self.metrics.on_finished(m, len(req.prompt_token_ids), [seq.finish_reason for seq in seqs], len(seqs),
                                 req.params.max_tokens, [seq.num_output_tokens for seq in seqs])

    def _stream_tokens(self, req: RequestState, out: RequestOutput, now: float) -> None:
        """A streamed delta's inter-token latency (its first token has none)."""
        m = req.metrics
        if m.last_token_ts and m.last_token_ts != now and any(c.token_ids for c in out.outputs):
            self.metrics.on_inter_token(now - m.last_token_ts)
            m.last_token_ts = now

    def _execute(self, batch: ScheduledBatch) -> tuple[ScheduledBatch, StepOutput, dict[str, str]]:
        """Run the batch; when it fails, run its sequences one by one so that a request
        that fails fails alone. Returns the batch that ran, its output, and the requests
        that failed (id -> reason). Rerunning is safe: a step writes K/V only for its own
        tokens, at the same slots, with the same values."""
        try:
            return batch, self._run(batch), {}
        except EngineDeadError:
            raise
        except Exception:  # noqa: BLE001 - whatever one request triggers must not stop the others
            logger.exception("a step of %d sequences failed; running them one by one", len(batch.seqs))
        results, failed = [], {}
        owner = {s.seq_id: s.request_id for s in self.scheduler.running}
        for item in batch.seqs:
            try:
                results.append((item, self._run(ScheduledBatch([item], len(item.token_ids)))))
            except EngineDeadError:
                raise
            except Exception as e:  # noqa: BLE001
                logger.exception("request %s failed in a step", owner[item.seq_id])
                failed.setdefault(owner[item.seq_id], f"the request failed in the engine: {type(e).__name__}: {e}")
        kept, output = ScheduledBatch(), StepOutput()
        logprobs: list = []
        for item, out in results:
            if owner[item.seq_id] in failed:  # a sibling sample failed: the request ends
                continue
            kept.seqs.append(item)
            kept.num_tokens += len(item.token_ids)
            output.sampled_token_ids += out.sampled_token_ids
            logprobs += out.logprobs or [None] * len(out.sampled_token_ids)
            if out.prompt_logprobs:
                output.prompt_logprobs = {**(output.prompt_logprobs or {}), **out.prompt_logprobs}
        output.logprobs = logprobs if any(lp is not None for lp in logprobs) else None
        return kept, output, failed

    def _run(self, batch: ScheduledBatch) -> StepOutput:
        try:
            return self.executor.execute(batch)
        except EngineDeadError as e:
            self._closed = str(e)
            raise

    def _apply(self, batch: ScheduledBatch, output: StepOutput, failed: dict[str, str]) -> None:
        finished = self.scheduler.update(batch, output) if batch.seqs else []
        now = time.monotonic()
        if batch.seqs:
            self.metrics.on_step(batch.num_tokens, len(output.sampled_token_ids))
        if self._prefilling:
            self._first_tokens(now)
        touched: dict[str, RequestState] = {}
        for seq, stop in self.output_processor.update_text(batch, touched):
            if not seq.is_finished:
                self.scheduler.stop(seq, stop)
                finished.append(seq)
            else:  # it ended on a token in the same step: the stop string is the reason
                seq.finish_reason, seq.stop_reason = "stop", stop
        for seq in finished:
            req = self._requests[seq.request_id]
            req.num_finished += 1
            self.output_processor.forget(seq)
            touched[req.request_id] = req
        for req in touched.values():
            if req.stream or req.finished:
                out = self.output_processor.output(req)
                if req.stream:
                    self._stream_tokens(req, out, now)
                if req.finished:
                    self._finished(req, now)
                self._emit(req, out)
            if req.finished:
                del self._requests[req.request_id]
        for request_id, reason in failed.items():
            self._fail(self._requests[request_id], reason)

    def _fail(self, req: RequestState, reason: str) -> None:
        """End a request that failed in a step: its samples finish with "error"."""
        for seq in req.seqs:
            self.output_processor.forget(seq)
            if not seq.is_finished:
                self.scheduler.abort(seq, reason="error")
                req.num_finished += 1
        self._prefilling.pop(req.request_id, None)
        req.metrics.finished_ts = time.monotonic()
        self.metrics.count_finished([seq.finish_reason for seq in req.seqs])
        out = self.output_processor.output(req)
        out.error = reason
        del self._requests[req.request_id]
        self._emit(req, out)

    def _emit(self, req: RequestState, out: RequestOutput) -> None:
        if req.cumulative:
            out = req.so_far = accumulate(req.so_far, out)
        (req.sink if req.sink is not None else self._unclaimed).append(out)


_NUM_GENERATED = operator.attrgetter("num_generated")


def _model_name(config: EngineConfig) -> str:
    """The metrics' model_name label: the served model name where one is set, else the model."""
    name = getattr(config, "served_model_name", None)
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    return name or config.model


def _num_decodes(batch: ScheduledBatch) -> int:
    """The batch's decodes: one token of a sequence past its prompt."""
    if batch.num_tokens == len(batch.seqs):  # one token each: one C-level pass
        return len(batch.seqs) - list(map(_NUM_GENERATED, batch.seqs)).count(0)
    return sum(1 for s in batch.seqs if len(s.token_ids) == 1 and s.num_generated > 0)


def check_vllm_extras(lora_request=None, tokenization_kwargs=None, priorities: Iterable = ()) -> None:
    """vLLM's request extras that nanokv cannot honour (add_request, LLM.generate,
    LLM.chat): ValueError unless they are off."""
    if lora_request is not None:
        raise ValueError(f"lora_request: {LORA}")
    if tokenization_kwargs:
        raise ValueError("tokenization_kwargs is not supported by nanokv; tokenize the prompt yourself and "
                         "pass token ids (SamplingParams.truncate_prompt_tokens truncates)")
    if any(p not in (0, None) for p in priorities):
        raise ValueError("priority: priority scheduling is not supported by nanokv (requests run first come, "
                         "first served); drop it")


# vLLM's prompt-dict keys nanokv cannot honour, and why (other unknown keys are ignored)
_PROMPT_KEYS_REFUSED = {
    "multi_modal_data": MULTIMODAL, "mm_processor_kwargs": MULTIMODAL,
    "prompt_embeds": "prompt embeddings are not supported by nanokv; send text or token ids",
    "cache_salt": "cache_salt is not supported by nanokv (every request shares the prefix cache)",
}


def _check_prompt_keys(prompt: dict) -> None:
    for key, why in _PROMPT_KEYS_REFUSED.items():
        if prompt.get(key) is not None:
            raise ValueError(f"prompt key {key!r}: {why}")


def check_text(text: str, what: str) -> None:
    """ValueError unless text is valid Unicode (a lone surrogate from a JSON escape is not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid text: {text[e.start:e.end]!r} at character {e.start} is a "
                         "lone surrogate; send valid UTF-8 text or token ids") from None


def _token_ids(values) -> list[int]:
    """A prompt's token ids as ints (numpy and torch integer scalars are fine); the
    tokenizer's own output (a BatchEncoding, which apply_chat_template(tokenize=True)
    returns in transformers 5) gives its input_ids."""
    if hasattr(values, "keys") and "input_ids" in values:
        values = values["input_ids"]
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"prompt_token_ids must be a list of ints, got {type(values).__name__}")
    ids = []
    for i, t in enumerate(values):
        if isinstance(t, bool) or isinstance(t, float):
            raise ValueError(f"prompt token ids must be ints; item {i} is {t!r} ({type(t).__name__})")
        try:
            ids.append(operator.index(t))
        except TypeError:
            raise ValueError(f"prompt token ids must be ints; item {i} is {t!r} ({type(t).__name__})") from None
    return ids


@contextmanager
def _sigint_deferred():
    """Hold Ctrl-C back until the block ends, so the scheduler's bookkeeping is never left
    half done; then raise it. Only in the main thread, and only over Python's own handler."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    received = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if received:
        raise KeyboardInterrupt


# Files that hold a tokenizer's vocabulary (tokenizer_config.json alone holds none).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                    "sentencepiece.bpe.model", "tekken.json")


def load_tokenizer(model: str, use_fast: bool = True):
    """The tokenizer of a model directory or .gguf file (or of a tokenizer directory);
    use_fast=False: transformers' slow (Python) tokenizer, for a directory only."""
    import nanokv.gguf as gguf

    if (gguf_file := gguf.find_gguf(model)) is not None:
        return gguf.load_tokenizer(gguf_file)
    from transformers import AutoTokenizer

    if os.path.isdir(model) and not any(os.path.isfile(os.path.join(model, f)) for f in _TOKENIZER_FILES):
        raise ValueError(f"{model} has no tokenizer files ({', '.join(_TOKENIZER_FILES[:3])} or similar); "
                         "copy them from the original model repository into the directory")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model, use_fast=use_fast)
    except Exception as e:
        raise ValueError(f"cannot load a tokenizer from {model}: {e}") from e
    if len(tokenizer) < 2:
        raise ValueError(f"the tokenizer in {model} has {len(tokenizer)} tokens; its files are incomplete: "
                         "copy them from the original model repository")
    return tokenizer


def check_tokenizer_fits(tokenizer, path: str, vocab_size: int) -> None:
    """A tokenizer given apart from the model (EngineArgs.tokenizer) must not make token ids
    the model has no embedding for."""
    if len(tokenizer) > vocab_size:
        raise ValueError(f"the tokenizer {path} has {len(tokenizer)} tokens but the model's vocabulary is "
                         f"{vocab_size}: its ids would run past the embedding; give the model's own tokenizer")
