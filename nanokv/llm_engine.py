"""LLMEngine: requests in, RequestOutputs out; wires the scheduler to the model runner.

Text lives here (the scheduler sees token ids only): detokenization, stop strings,
logprob formatting, and grouping a request's n samples into one RequestOutput.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from nanokv.config import EngineConfig
from nanokv.detokenizer import IncrementalDetokenizer
from nanokv.engine.block_manager import BlockManager
from nanokv.engine.scheduler import Scheduler, SchedulerConfig
from nanokv.engine.sequence import Sequence
from nanokv.engine.stats import KVStats
from nanokv.outputs import CompletionOutput, Logprob, RequestOutput
from nanokv.sampling_params import SamplingParams

PromptType = str | list[int] | dict


@dataclass
class _TextState:
    """Incremental text of one sample: kept for streaming requests and stop strings."""

    detok: IncrementalDetokenizer
    num_fed: int = 0  # output tokens fed to detok
    text_end: int | None = None  # cut here after a stop string
    sent_chars: int = 0  # streaming: text already returned
    sent_tokens: int = 0  # streaming: token ids already returned
    sent_final: bool = False  # streaming: the finished sample was reported


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    seqs: list[Sequence] = field(default_factory=list)
    text: list[_TextState | None] = field(default_factory=list)
    num_finished: int = 0

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.seqs)


@dataclass
class StepStats:
    """What the last step computed, for progress reporting."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    seconds: float = 0.0


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer=None):
        from nanokv.runner.model_runner import ModelRunner

        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model)
        self.runner = ModelRunner(config)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len),
            self.block_manager, config.eos_token_ids)
        self.vocab_size = config.hf_config.vocab_size
        self._requests: dict[str, _Request] = {}
        self._watched: dict[int, tuple[_Request, int]] = {}  # seq id -> samples with _TextState
        self._ids = itertools.count()
        self.last_step = StepStats()

    # ---- requests ---------------------------------------------------------------------
    def make_request(self, prompt: PromptType, params: SamplingParams | None = None,
                     request_id: str | None = None, *, stream: bool = False) -> _Request:
        """Validate and tokenize one request without queueing it (ValueError on bad input)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        text, token_ids = self._tokenize(prompt)
        if not token_ids:
            raise ValueError("prompt is empty; give at least one token")
        bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size]
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
        req = _Request(request_id, text, token_ids, params, stream)
        for i in range(params.n):
            req.seqs.append(Sequence(request_id, token_ids, params, max_tokens, index=i))
            watched = stream or bool(params.stop)
            req.text.append(_TextState(IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens))
                            if watched else None)
        return req

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None, *, stream: bool = False) -> str:
        """Queue a request; returns its id. ValueError on bad input (nothing is queued).

        stream=False: step() returns the request once, when all its samples finish.
        stream=True: step() returns a delta each step a sample produces tokens
        (CompletionOutput token_ids and text hold only what is new), and finished=True
        on the request's last one.
        """
        req = self.make_request(prompt, params, request_id, stream=stream)
        self.enqueue(req)
        return req.request_id

    def enqueue(self, req: _Request) -> None:
        """Queue a request made (and validated) by make_request. The n samples of a
        request share the prompt's blocks: the first computes them, the others hit."""
        self._requests[req.request_id] = req
        for seq, state in zip(req.seqs, req.text):
            if state is not None:
                self._watched[seq.seq_id] = (req, seq.index)
            self.scheduler.add(seq)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs a 'prompt' or 'prompt_token_ids' key")
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"a prompt is a str or a list of token ids, got {type(prompt).__name__}")

    def abort(self, request_id: str) -> None:
        """Drop a request; its KV blocks are free at once. Unknown ids are ignored."""
        req = self._requests.pop(str(request_id), None)
        if req is None:
            return
        for seq in req.seqs:
            self._watched.pop(seq.seq_id, None)
            self.scheduler.abort(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def kv_stats(self) -> KVStats:
        return self.scheduler.kv_stats()

    # ---- stepping ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch. Returns the requests that finished in it and, for streaming
        requests, their new deltas."""
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            self.last_step = StepStats()
            return []
        output = self.runner.execute(batch)
        finished = self.scheduler.update(batch, output)
        touched: dict[str, _Request] = {}
        if self._watched:
            finished += self._update_text(batch, touched)
        for seq in finished:
            req = self._requests[seq.request_id]
            req.num_finished += 1
            self._watched.pop(seq.seq_id, None)
            touched[req.request_id] = req
        outputs = []
        for req in touched.values():
            if req.stream:
                outputs.append(self._delta_output(req))
            elif req.finished:
                outputs.append(self._final_output(req))
            if req.finished:
                del self._requests[req.request_id]
        decodes = sum(1 for s in batch.seqs if len(s.token_ids) == 1 and s.num_generated > 0)
        self.last_step = StepStats(batch.num_tokens - decodes, decodes, time.perf_counter() - start)
        return outputs

    def _update_text(self, batch, touched: dict[str, _Request]) -> list[Sequence]:
        """Detokenize new tokens of watched samples; stop those whose text hit a stop string."""
        stopped = []
        for item in batch.seqs:
            entry = self._watched.get(item.seq_id) if item.sample else None
            if entry is None:
                continue
            req, index = entry
            seq, state = req.seqs[index], req.text[index]
            touched[req.request_id] = req
            new_ids = seq.output_token_ids[state.num_fed:]
            state.num_fed += len(new_ids)
            delta = state.detok.add(new_ids)
            if not delta or not req.params.stop or seq.num_output_tokens <= req.params.min_tokens:
                continue
            hit = _find_stop(state.detok.text, len(delta), req.params.stop)
            if hit is not None:
                pos, stop = hit
                state.text_end = pos + (len(stop) if req.params.include_stop_str_in_output else 0)
                if not seq.is_finished:  # it may have ended on a token in the same step
                    self.scheduler.stop(seq, stop)
                    stopped.append(seq)
                else:
                    seq.finish_reason, seq.stop_reason = "stop", stop
        return stopped

    def _text(self, req: _Request, index: int) -> str:
        """A finished sample's whole text."""
        seq, state = req.seqs[index], req.text[index]
        if state is not None and state.text_end is not None:
            return state.detok.text[:state.text_end]
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=req.params.skip_special_tokens)

    def _completion(self, req: _Request, index: int, text: str, token_ids: list[int],
                    logprobs_from: int) -> CompletionOutput:
        seq = req.seqs[index]
        out = CompletionOutput(index=index, text=text, token_ids=token_ids,
                               finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)
        if req.params.logprobs is not None:
            out.logprobs = self._format_logprobs(seq, logprobs_from)
            out.cumulative_logprob = seq.cumulative_logprob
        return out

    def _final_output(self, req: _Request) -> RequestOutput:
        outputs = [self._completion(req, i, self._text(req, i), seq.output_token_ids, 0)
                   for i, seq in enumerate(req.seqs)]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outputs, finished=True)

    def _delta_output(self, req: _Request) -> RequestOutput:
        outputs = []
        for i, (seq, state) in enumerate(zip(req.seqs, req.text)):
            if seq.is_finished:
                text = self._text(req, i)
            else:  # hold back what could still turn out to be the start of a stop string
                hold = max((len(s) for s in req.params.stop), default=1) - 1
                text = state.detok.text[:max(state.sent_chars, len(state.detok.text) - hold)]
            ids = seq.output_token_ids[state.sent_tokens:]
            if not ids and len(text) == state.sent_chars and (state.sent_final or not seq.is_finished):
                continue
            outputs.append(self._completion(req, i, text[state.sent_chars:], ids, state.sent_tokens))
            state.sent_chars, state.sent_tokens = len(text), seq.num_output_tokens
            state.sent_final = seq.is_finished
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outputs,
                             finished=req.finished)

    def _format_logprobs(self, seq: Sequence, start: int) -> list[dict[int, Logprob]]:
        """vLLM's shape: per generated token, {token id: Logprob} with the top-N and the
        sampled token."""
        result = []
        for token, lp in zip(seq.output_token_ids[start:], seq.logprobs[start:]):
            entry = {tid: Logprob(val, rank) for rank, (tid, val) in enumerate(zip(lp.top_ids, lp.top_logprobs), 1)}
            entry.setdefault(token, Logprob(lp.logprob, lp.rank))
            ids = list(entry)
            for tid, piece in zip(ids, self.tokenizer.convert_ids_to_tokens(ids)):
                entry[tid].decoded_token = piece
            result.append(entry)
        return result


def _find_stop(text: str, num_new: int, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string that ends inside the newest num_new characters."""
    best = None
    for stop in stops:
        pos = text.find(stop, max(0, len(text) - num_new - len(stop) + 1))
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, stop)
    return best


def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    from nanokv import gguf

    if (gguf_file := gguf.find_gguf(model)) is not None:
        return gguf.load_tokenizer(gguf_file)
    try:
        return AutoTokenizer.from_pretrained(model)
    except Exception as e:
        raise ValueError(f"cannot load a tokenizer from {model}: {e}") from e
