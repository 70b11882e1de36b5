"""LLMEngine: requests in, RequestOutputs out; wires the scheduler to the model runner."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from nanokv.config import EngineConfig
from nanokv.detokenizer import IncrementalDetokenizer
from nanokv.engine.block_manager import BlockManager
from nanokv.engine.scheduler import Scheduler, SchedulerConfig
from nanokv.engine.sequence import Sequence
from nanokv.engine.stats import KVStats
from nanokv.outputs import CompletionOutput, RequestOutput
from nanokv.sampling_params import SamplingParams

PromptType = str | list[int] | dict


@dataclass
class _Request:
    seq: Sequence
    prompt: str | None
    detokenizer: IncrementalDetokenizer | None = None  # streaming requests only
    num_sent: int = 0  # output tokens already returned as deltas


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
        self._streaming: dict[int, _Request] = {}  # by seq id
        self._ids = itertools.count()
        self.last_step = StepStats()

    # ---- requests ---------------------------------------------------------------------
    def make_request(self, prompt: PromptType, params: SamplingParams | None = None,
                     request_id: str | None = None) -> tuple[Sequence, str | None]:
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
        elif request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use; pick a unique id")
        max_tokens = min(params.max_tokens, max_len - len(token_ids))
        return Sequence(str(request_id), token_ids, params, max_tokens), text

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None, *, stream: bool = False) -> str:
        """Queue a request; returns its id. ValueError on bad input (nothing is queued).

        stream=False: step() returns the request once, when it finishes.
        stream=True: step() returns a delta each step that adds text (token_ids and text
        hold only what is new), the last one with finished=True.
        """
        seq, text = self.make_request(prompt, params, request_id)
        self.enqueue(seq, text, stream=stream)
        return seq.request_id

    def enqueue(self, seq: Sequence, text: str | None, *, stream: bool = False) -> None:
        """Queue a request made (and validated) by make_request."""
        req = _Request(seq, text, IncrementalDetokenizer(self.tokenizer) if stream else None)
        self._requests[seq.request_id] = req
        if stream:
            self._streaming[seq.seq_id] = req
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
        req = self._pop(str(request_id))
        if req is not None:
            self.scheduler.abort(req.seq)

    def _pop(self, request_id: str) -> _Request | None:
        req = self._requests.pop(request_id, None)
        if req is not None:
            self._streaming.pop(req.seq.seq_id, None)
        return req

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
        decodes = sum(1 for s in batch.seqs if len(s.token_ids) == 1 and s.num_generated > 0)
        self.last_step = StepStats(batch.num_tokens - decodes, decodes, time.perf_counter() - start)
        outputs = [self._final_output(seq) for seq in finished]
        if self._streaming:
            outputs += self._stream_deltas(batch)
        return outputs

    def _stream_deltas(self, batch) -> list[RequestOutput]:
        outputs = []
        for item in batch.seqs:
            req = self._streaming.get(item.seq_id) if item.sample else None
            if req is None:
                continue
            new_ids = req.seq.output_token_ids[req.num_sent:]
            req.num_sent += len(new_ids)
            text = req.detokenizer.add(new_ids)
            outputs.append(self._output(req, text, new_ids, finished=False))
        return outputs

    def _final_output(self, seq: Sequence) -> RequestOutput:
        req = self._pop(seq.request_id)
        out_ids = seq.output_token_ids
        text = self.tokenizer.decode(out_ids, skip_special_tokens=True)
        if req.detokenizer is not None:  # streaming: only what was not sent yet
            text, out_ids = text[len(req.detokenizer.text):], out_ids[req.num_sent:]
        return self._output(req, text, out_ids, finished=True)

    @staticmethod
    def _output(req: _Request, text: str, token_ids: list[int], finished: bool) -> RequestOutput:
        seq = req.seq
        completion = CompletionOutput(index=0, text=text, token_ids=token_ids,
                                      finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)
        return RequestOutput(seq.request_id, req.prompt, seq.token_ids[:seq.num_prompt_tokens],
                             [completion], finished=finished)


def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model)
    except Exception as e:
        raise ValueError(f"cannot load a tokenizer from {model}: {e}") from e
